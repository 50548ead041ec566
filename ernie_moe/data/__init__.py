"""Data: synthetic and JSONL sources, tokenizers, encoding, packing, batching."""

from .loader import RowStream, build_datasets, build_tokenizer, collate, rank_batches

__all__ = ["RowStream", "build_datasets", "build_tokenizer", "collate", "rank_batches"]
