"""The training data as the trainer takes it: this rank's rows of each micro-batch of each step, and a position
that a checkpoint saves and a resume restores without reading the rows before it."""

from __future__ import annotations

from collections import Counter

from .loader import RowStream, rank_share
from .packing import Row
from .sample import DataError


class DataFeed:
    """This rank's share of the run's global training rows: the global micro-batches are cut from one seeded row
    stream, the same for any number of ranks (so layouts, and resumes in another layout, see the same rows),
    and each data rank keeps its contiguous share. Tensor- and pipeline-parallel ranks of one data rank take the
    same rows."""

    def __init__(self, dataset, tokenizer, cfg, env, stats: Counter):
        """``stats``: where skipped and changed samples are counted (``data/...`` in the metrics)."""
        self.stream = RowStream(dataset, tokenizer, cfg, stats, shuffle=True, workers=cfg.data.num_workers)
        self.rank, self.world = env.data_rank, env.data_world
        self.rows_read = 0  # global rows handed out so far

    def next_step(self, micro_batch_size: int, accumulation_steps: int) -> list[list[Row]]:
        """This rank's rows of each micro-batch of the next step (``micro_batch_size`` rows per rank)."""
        global_rows = micro_batch_size * self.world
        step = [rank_share([next(self.stream) for _ in range(global_rows)], self.rank, self.world)
                for _ in range(accumulation_steps)]
        self.rows_read += global_rows * accumulation_steps
        return step

    def state_dict(self) -> dict:
        """The position, as JSON values, the same on every rank."""
        return {"rows_read": self.rows_read, **self.stream.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Continue where ``state`` was saved (in this layout or another); DataError when it cannot be."""
        rows = state.get("rows_read") if isinstance(state, dict) else None
        if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
            raise DataError(f"the saved data position's 'rows_read' must be a whole number of 0 or more, not {rows!r}")
        self.stream.load_state_dict(state)
        self.rows_read = rows

    def close(self) -> None:
        self.stream.close()
