"""Data: synthetic and JSONL sources, tokenizers, encoding, packing, batching."""

from .feeding.loader import DataError, RowStream, build_datasets, build_tokenizer, collate, rank_batches

__all__ = ["DataError", "RowStream", "build_datasets", "build_tokenizer", "collate", "rank_batches"]
