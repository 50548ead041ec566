"""Held-out rows as the evaluation takes them, each data rank reading only the samples of its own rows.

The rows are those one process packs from the held-out set in its own order (``plan.rows_in_order``, from the
samples' lengths, measured once over every rank and kept like the training data's); each evaluation batch of
``rows_per_rank x data ranks`` rows gives every rank its contiguous share, and a short last batch that leaves a
rank without rows gives it an unlabelled copy of the batch's first row, so every rank runs the same forwards
(``loader.rank_batches``). Preference pairs are read the same way, a row each.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from ...config.schema import Config
from ..encoding.packing import Row
from ..encoding.tokenizer import Tokenizer
from .feed import RowInputs, indexed_pair, planned_row, with_inputs
from .length_index import length_index
from .loader import is_preference, rank_share, sample_encoder, short_share, unlabelled
from .plan import rows_in_order
from .workers import encode_in_order


def held_out_batches(dataset, tokenizer: Tokenizer, cfg: Config, env, rows_per_rank: int,
                     stats: Counter, row_inputs: RowInputs | None = None) -> Iterator[list[Row]]:
    """This data rank's rows of each held-out batch; the samples skipped, and what fitting changed, counted in
    ``stats`` (every rank counts every sample: the figures are the whole set's); ``row_inputs``: the objective's
    inputs of each row (``feed.RowFeed``)."""
    for rows in _held_out_rows(dataset, tokenizer, cfg, env, rows_per_rank, stats):
        yield [with_inputs(row, row_inputs) for row in rows]


def _held_out_rows(dataset, tokenizer: Tokenizer, cfg: Config, env, rows_per_rank: int,
                   stats: Counter) -> Iterator[list[Row]]:
    rank, world = env.data_rank, env.data_world
    encoder = sample_encoder(tokenizer, cfg, Counter())  # its counts are the plan's
    index = length_index(dataset, encoder, cfg.data.index_dir, env, cfg.data.num_workers, progress=False)
    planned = rows_in_order(index, cfg.data.max_seq_len, stats, one_per_row=is_preference(cfg))
    global_rows = rows_per_rank * world
    for start in range(0, len(planned), global_rows):
        batch = planned[start:start + global_rows]
        if len(batch) == global_rows:
            yield _read(dataset, encoder, rank_share(batch, rank, world), cfg, tokenizer, stats)
            continue
        mine = short_share(batch, rank, world)
        if mine:
            yield _read(dataset, encoder, mine, cfg, tokenizer, stats)
        else:  # no row of the short last batch: an unlabelled copy of its first row
            yield [unlabelled(_read(dataset, encoder, batch[:1], cfg, tokenizer, Counter())[0])]


def _read(dataset, encoder, rows: list[list[int]], cfg: Config, tokenizer: Tokenizer, stats: Counter) -> list[Row]:
    """The planned rows read and encoded (a preference pair's row keyed ``-1 - index``, as held out)."""
    read = encode_in_order(dataset, encoder, [index for row in rows for index in row], None, Counter())
    if not is_preference(cfg):
        return [planned_row([next(read) for _ in row], cfg.data.max_seq_len, tokenizer.pad_id, stats)
                for row in rows]
    return [indexed_pair(index, pair, reason, held_out=True) for index, pair, reason in read]
