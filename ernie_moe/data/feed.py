"""The training data as the trainer takes it: this rank's rows of each micro-batch of each step, and a position
that a checkpoint saves and a resume restores without reading a sample.

The global rows do not depend on the layout: one seeded packing of the data, cut into global micro-batches of
which each data rank keeps its contiguous share (tensor- and pipeline-parallel ranks of one data rank take the
same rows), so layouts, and resumes in another layout, see the same rows. Every rank plans every row from the
samples' lengths (``data.plan``, over ``data.length_index``) and reads, decodes and encodes only the samples of its
own rows: a rank's data cost does not grow with the number of ranks.

A sample whose encoding now differs from its index entry (a file changed, an image body that turns out broken)
changes only the row it is in, on the rank that reads it: a sample that cannot be read is left out (counted under
its reason), and samples that no longer fit are left out from the end of the row (``length_mismatch``). Both are
counted by the rank that meets them. Preference pairs, a row each, are read by every rank from the row stream.

The rows of the step after the one handed out are read in a background thread while the model trains on it; the
saved position stays that of the rows handed out. The reader's Python holds the interpreter, which the training
step's own Python needs between kernels: a trainer that ``gate``s the feed lets the reader work only inside
``reading()`` blocks (its backward passes, where Paddle's kernels leave the interpreter free) and while it waits
for rows.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass

from .length_index import length_index
from .loader import RowStream, is_preference, rank_share, training_encoder
from .packing import Row, make_row
from .plan import PackingPlan
from .sample import DataError
from .workers import SampleWorkers, encode_in_order


@dataclass
class _Ahead:
    """The next step's rows, being read: the shape they were planned for, and the position before them."""

    shape: tuple[int, int]
    position: dict
    rows_read: int
    rows: Future  # (rows of each micro-batch, the reasons counted while reading them)


class DataFeed:
    def __init__(self, dataset, tokenizer, cfg, env, stats: Counter):
        """``stats``: where skipped and fitted samples are counted (``data/...`` in the metrics)."""
        self.rank, self.world = env.data_rank, env.data_world
        self.rows_read = 0  # global rows handed out so far
        self.max_seq_len = cfg.data.max_seq_len
        self.stats = stats
        self.ahead: _Ahead | None = None  # the next step's rows, being read
        self.gated, self._may_read = False, threading.Event()
        self._may_read.set()
        if is_preference(cfg):
            self.stream, self.plan = RowStream(dataset, tokenizer, cfg, stats, shuffle=True,
                                               workers=cfg.data.num_workers), None
            return
        self.stream, self.dataset, self.pad_id = None, dataset, tokenizer.pad_id
        self.encoder = training_encoder(tokenizer, cfg, Counter())  # its counts are the plan's, made once
        index = length_index(dataset, self.encoder, cfg.data.index_dir, env, cfg.data.num_workers,
                             cfg.logging.progress_bar)
        self.plan = PackingPlan(index, cfg.training.seed, cfg.data.max_seq_len, stats)
        self.workers = SampleWorkers(dataset, self.encoder, cfg.data.num_workers) if cfg.data.num_workers else None

    def next_step(self, micro_batch_size: int, accumulation_steps: int) -> list[list[Row]]:
        """This rank's rows of each micro-batch of the next step (``micro_batch_size`` rows per rank)."""
        shape = (micro_batch_size, accumulation_steps)
        if self.plan is None:
            global_rows = micro_batch_size * self.world
            self.rows_read += global_rows * accumulation_steps
            return [rank_share([next(self.stream) for _ in range(global_rows)], self.rank, self.world)
                    for _ in range(accumulation_steps)]
        if self.ahead is not None and self.ahead.shape != shape:  # the memory guard changed the micro-batch
            self._drop_ahead()
        if self.ahead is None:
            self._read_ahead(shape)
        with self.reading():
            rows, counted = self.ahead.rows.result()
        self.ahead = None
        self.stats.update(counted)
        self._read_ahead(shape)
        return rows

    def _read_ahead(self, shape: tuple[int, int]) -> None:
        """Plan the next step's rows and start reading them."""
        micro_batch_size, accumulation_steps = shape
        position, rows_read = self.plan.state_dict(), self.rows_read
        global_rows = micro_batch_size * self.world
        planned = [rank_share([self.plan.next_row() for _ in range(global_rows)], self.rank, self.world)
                   for _ in range(accumulation_steps)]
        self.rows_read += global_rows * accumulation_steps
        self.ahead = _Ahead(shape, position, rows_read, _in_background(self._read, planned))

    def _drop_ahead(self) -> None:
        """Forget the rows being read ahead: the position goes back to before them."""
        ahead, self.ahead = self.ahead, None
        with self.reading():
            ahead.rows.exception()  # wait: the reader must be idle before anything else reads
        self.plan.load_state_dict(ahead.position)
        self.rows_read = ahead.rows_read

    def _read(self, planned: list) -> tuple[list[list[Row]], Counter]:
        """The planned rows read and encoded (in the reader thread), and the reasons counted on the way."""
        counted = Counter()
        wanted = [index for rows in planned for row in rows for index in row]
        read = encode_in_order(self.dataset, self.encoder, wanted, self.workers, Counter())

        def next_sample():
            self._may_read.wait()  # a gated feed reads only while the trainer lets it
            return next(read)

        return [[self._row([next_sample() for _ in row], counted) for row in rows] for rows in planned], counted

    def _row(self, samples: list, counted: Counter) -> Row:
        """A planned row from its samples as read now (index, encoded or None, reason)."""
        docs, used = [], 0
        for _, encoded, reason in samples:
            if reason is not None:
                counted[reason] += 1
            elif used + len(encoded) > self.max_seq_len:
                counted["length_mismatch"] += 1
            else:
                docs.append(encoded)
                used += len(encoded)
        return make_row(docs, self.max_seq_len, self.pad_id)

    def gate(self) -> None:
        """From now on the reader works only inside :meth:`reading` blocks (and while rows are awaited)."""
        self.gated = True
        self._may_read.clear()

    @contextlib.contextmanager
    def reading(self):
        """Let the reader work within the block."""
        self._may_read.set()
        try:
            yield
        finally:
            if self.gated:
                self._may_read.clear()

    def state_dict(self) -> dict:
        """The position after the rows handed out, as JSON values, the same on every rank."""
        if self.plan is None:
            return {"rows_read": self.rows_read, **self.stream.state_dict()}
        if self.ahead is not None:
            return {"rows_read": self.ahead.rows_read, **self.ahead.position}
        return {"rows_read": self.rows_read, **self.plan.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Continue where ``state`` was saved (in this layout or another); DataError when it cannot be."""
        rows = state.get("rows_read") if isinstance(state, dict) else None
        if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
            raise DataError(f"the saved data position's 'rows_read' must be a whole number of 0 or more, not {rows!r}")
        # each epoch puts at least one token of a usable sample into the rows: more epochs than the rows' tokens
        # is a position no run reached (the epoch picks the order every later sample is read in)
        epoch, most = state.get("epoch"), (rows + 1) * self.max_seq_len
        if isinstance(epoch, int) and epoch > most:
            raise DataError(f"the saved data position's 'epoch' ({epoch}) is past the last one its {rows} rows read "
                            f"could reach (epoch {most}): not a position in this data (a hand-edited checkpoint)")
        if self.ahead is not None:
            self._drop_ahead()
        (self.stream if self.plan is None else self.plan).load_state_dict(state)
        self.rows_read = rows

    def window_metrics(self, elapsed: float) -> dict:
        """The feed's own figures of a logging window: none (the skipped samples are counted in ``stats``)."""
        return {}

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
            return
        if self.ahead is not None:
            self._drop_ahead()
        if self.workers is not None:
            self.workers.close()


def _in_background(function, *args) -> Future:
    """``function(*args)`` in a daemon thread of its own: a reader left waiting (a run that stops on an error) does
    not keep the process from exiting."""
    future: Future = Future()

    def run():
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(function(*args))
            except BaseException as error:  # handed to whoever takes the rows
                future.set_exception(error)

    threading.Thread(target=run, name="data-read-ahead", daemon=True).start()
    return future
