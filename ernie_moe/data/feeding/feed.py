"""The training data as the trainer takes it: this rank's rows of each micro-batch of each step, and a position
that a checkpoint saves and a resume restores without reading a sample. Every kind of feed keeps one protocol
(:class:`Feed`): packed rows or preference pairs (:class:`RowFeed`) and, in the GRPO stage, the policy's
rollouts (``training.rollouts.RolloutFeed``).

The global rows do not depend on the layout: one seeded packing of the data, cut into global micro-batches of
which each data rank keeps its contiguous share (tensor- and pipeline-parallel ranks of one data rank take the
same rows), so layouts, and resumes in another layout, see the same rows. Every rank plans every row from the
samples' lengths (``data.feeding.plan``, over ``data.feeding.length_index``) and reads, decodes and encodes only
the samples of its own rows: a rank's data cost does not grow with the number of ranks.

A sample whose encoding now differs from its index entry (a file changed, an image body that turns out broken)
changes only the row it is in, on the rank that reads it: a sample that cannot be read is left out (counted under
its reason), and samples that no longer fit are left out from the end of the row (``length_mismatch``). Both are
counted by the rank that meets them. Preference pairs are planned and read the same way, a row each (their index
says which pairs are usable); a pair that cannot be read though its index found it usable stops the run with a line
naming it.

The rows of the next ``data.read_ahead_steps`` steps (1 by default) are read, in order, by one background thread
while the model trains; the memory this holds is that many steps of this rank's rows, and the saved position stays
that of the rows handed out. The reader's Python holds the interpreter, which the training
step's own Python needs between kernels: a trainer that ``gate``s the feed lets the reader work only inside
``reading()`` blocks (its backward passes, where Paddle's kernels leave the interpreter free) and while it waits
for rows.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ...config.schema import Config
from ..encoding.packing import Row, make_row
from ..encoding.tokenizer import Tokenizer
from ..formats.sample import DataError
from .length_index import length_index
from .loader import is_preference, rank_share, sample_encoder
from .plan import PackingPlan, deal_by_patches
from .workers import SampleWorkers, encode_in_order


class Feed(Protocol):
    """What the trainer takes each step's rows from, and what its checkpoints save and restore."""

    def next_step(self, micro_batch_size: int, accumulation_steps: int) -> list[list[Row]]:
        """This rank's rows of each micro-batch of the next step (``micro_batch_size`` rows per rank)."""

    def state_dict(self) -> dict:
        """The position after the rows handed out, as JSON values, the same on every rank."""

    def load_state_dict(self, state: dict) -> None:
        """Continue where ``state`` was saved (in this layout or another); DataError when it cannot be."""

    def window_metrics(self, elapsed: float) -> dict:
        """The feed's own figures of a logging window (``elapsed`` seconds of steps)."""

    def window_answers(self) -> list[dict]:
        """A few of the window's sampled answers, to show (a rollout's); empty for data read from files."""

    def gate(self) -> None:
        """From now on any reader in the background works only inside :meth:`reading` blocks."""

    def reading(self) -> AbstractContextManager:
        """Let a background reader work within the block."""

    def close(self) -> None:
        """Stop what runs in the background."""


def rows_read_of(state, max_seq_len: int) -> int:
    """The global rows a saved position has handed out; DataError when ``state`` cannot be a position (its epoch
    past what those rows could reach, too)."""
    rows = state.get("rows_read") if isinstance(state, dict) else None
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
        raise DataError(f"the saved data position's 'rows_read' must be a whole number of 0 or more, not {rows!r}")
    # each epoch puts at least one token of a usable sample into the rows: more epochs than the rows' tokens
    # is a position no run reached (the epoch picks the order every later sample is read in)
    epoch, most = state.get("epoch"), (rows + 1) * max_seq_len
    if isinstance(epoch, int) and epoch > most:
        raise DataError(f"the saved data position's 'epoch' ({epoch}) is past the last one its {rows} rows read "
                        f"could reach (epoch {most}): not a position in this data (a hand-edited checkpoint)")
    return rows


@dataclass
class _Ahead:
    """The next step's rows, being read: the shape they were planned for, and the position before them."""

    shape: tuple[int, int]
    position: dict
    rows_read: int
    rows: Future  # (rows of each micro-batch, the reasons counted while reading them)
    imbalance: float | None  # the step's largest data rank's vision patches over their mean (None: no patches)


# what an objective makes of a row as it is read: its inputs by name (objectives.Objective.row_inputs)
RowInputs = Callable[[Row], dict[str, np.ndarray]]


def with_inputs(row: Row, row_inputs: RowInputs | None) -> Row:
    if row_inputs is not None:
        row.inputs.update(row_inputs(row))
    return row


class RowFeed:
    """Packed rows planned from the samples' lengths, each rank reading its own rows' samples, the next
    ``data.read_ahead_steps`` steps' in the background (:class:`Feed`); in the DPO stage, preference pairs, a row
    each, planned and read the same way."""

    def __init__(self, dataset, tokenizer: Tokenizer, cfg: Config, env, stats: Counter,
                 row_inputs: RowInputs | None = None):
        """``stats``: where skipped and fitted samples are counted (``data/...`` in the metrics); ``row_inputs``:
        the objective's inputs each row carries, made from the row as it is read (``Row.inputs``)."""
        self.row_inputs = row_inputs
        self.rank, self.world = env.data_rank, env.data_world
        self.rows_read = 0  # global rows handed out so far
        self.max_seq_len = cfg.data.max_seq_len
        self.stats = stats
        self.read_ahead = cfg.data.read_ahead_steps
        self.vision_balance = cfg.data.balance == "vision"
        self.imbalances: list[float] = []  # of the steps handed out since the last logging window
        self.aheads: deque[_Ahead] = deque()  # the next steps' rows, read in order by one background thread
        self.reader = _Reader()
        self.gated, self._may_read = False, threading.Event()
        self._may_read.set()
        self.dataset, self.pad_id = dataset, tokenizer.pad_id
        self.pairs = is_preference(cfg)
        self.encoder = sample_encoder(tokenizer, cfg, Counter())  # its counts are the plan's, made once
        index = length_index(dataset, self.encoder, cfg.data.index_dir, env, cfg.data.num_workers,
                             cfg.logging.progress_bar)
        self.plan = PackingPlan(index, cfg.training.seed, cfg.data.max_seq_len, stats, one_per_row=self.pairs)
        self.workers = SampleWorkers(dataset, self.encoder, cfg.data.num_workers) if cfg.data.num_workers else None

    def next_step(self, micro_batch_size: int, accumulation_steps: int) -> list[list[Row]]:
        shape = (micro_batch_size, accumulation_steps)
        if self.aheads and self.aheads[0].shape != shape:  # the memory guard changed the micro-batch
            self._drop_ahead()
        if not self.aheads:  # nothing read ahead (data.read_ahead_steps 0, or the first step)
            self._plan_step(shape)
        ahead = self.aheads.popleft()
        with self.reading():
            rows, counted = ahead.rows.result()
        self.stats.update(counted)
        if ahead.imbalance is not None:
            self.imbalances.append(ahead.imbalance)
        while len(self.aheads) < self.read_ahead:
            self._plan_step(shape)
        return rows

    def _plan_step(self, shape: tuple[int, int]) -> None:
        """Plan the rows of the step after those planned so far and queue their reading."""
        micro_batch_size, accumulation_steps = shape
        position, rows_read = self.plan.state_dict(), self.rows_read
        global_rows = micro_batch_size * self.world
        patches = self.plan.index.patches
        load = np.zeros(self.world, np.int64)  # each data rank's patches this step
        planned = []
        for _ in range(accumulation_steps):
            batch = [self.plan.next_row() for _ in range(global_rows)]
            dealt = deal_by_patches(batch, patches, self.world) if self.vision_balance else \
                [rank_share(batch, rank, self.world) for rank in range(self.world)]
            load += [sum(int(patches[row].sum()) for row in rows if row) for rows in dealt]
            planned.append(dealt[self.rank])
        self.rows_read += global_rows * accumulation_steps
        imbalance = float(load.max() / load.mean()) if load.any() else None
        self.aheads.append(_Ahead(shape, position, rows_read, self.reader.submit(self._read, planned), imbalance))

    def _drop_ahead(self) -> None:
        """Forget the rows planned ahead: the position goes back to before the first of them."""
        aheads, self.aheads = list(self.aheads), deque()
        if not aheads:
            return
        for ahead in aheads:
            ahead.rows.cancel()  # those the reader has not begun
        with self.reading():  # wait: the reader must be idle before anything else reads
            for ahead in aheads:
                if not ahead.rows.cancelled():
                    ahead.rows.exception()
        self.plan.load_state_dict(aheads[0].position)
        self.rows_read = aheads[0].rows_read

    def _read(self, planned: list) -> tuple[list[list[Row]], Counter]:
        """The planned rows read and encoded (in the reader thread), and the reasons counted on the way."""
        counted: Counter = Counter()
        wanted = [index for rows in planned for row in rows for index in row]
        read = encode_in_order(self.dataset, self.encoder, wanted, self.workers, Counter())

        def next_sample():
            self._may_read.wait()  # a gated feed reads only while the trainer lets it
            return next(read)

        return [[self._row([next_sample() for _ in row], counted) for row in rows] for rows in planned], counted

    def _row(self, samples: list, counted: Counter) -> Row:
        if not self.pairs:
            row = planned_row(samples, self.max_seq_len, self.pad_id, counted)
        else:
            (index, pair, reason), = samples
            row = indexed_pair(index, pair, reason)
        return with_inputs(row, self.row_inputs)

    def gate(self) -> None:
        self.gated = True
        self._may_read.clear()

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        self._may_read.set()
        try:
            yield
        finally:
            if self.gated:
                self._may_read.clear()

    def state_dict(self) -> dict:
        if self.aheads:
            return {"rows_read": self.aheads[0].rows_read, **self.aheads[0].position}
        return {"rows_read": self.rows_read, **self.plan.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        rows = rows_read_of(state, self.max_seq_len)
        self._drop_ahead()
        self.plan.load_state_dict(state)
        self.rows_read = rows

    def window_metrics(self, elapsed: float) -> dict:
        """``data/vision_imbalance``: the mean over the window's steps of the largest data rank's vision patches
        over their mean (1: even; ``data.balance: vision`` deals the rows to bring it there); the skipped samples
        are counted in ``stats``."""
        imbalances, self.imbalances = self.imbalances, []
        return {"data/vision_imbalance": float(np.mean(imbalances))} if imbalances else {}

    def window_answers(self) -> list[dict]:
        return []

    def close(self) -> None:
        self._drop_ahead()
        self.reader.close()
        if self.workers is not None:
            self.workers.close()


def planned_row(samples: list, max_seq_len: int, pad_id: int, counted: Counter) -> Row:
    """A planned row from its samples as read now (index, encoded or None, reason): one that cannot be read is
    left out under its reason, samples that no longer fit from the end of the row (``length_mismatch``)."""
    docs, used = [], 0
    for _, encoded, reason in samples:
        if reason is not None:
            counted[reason] += 1
        elif used + len(encoded) > max_seq_len:
            counted["length_mismatch"] += 1
        else:
            docs.append(encoded)
            used += len(encoded)
    return make_row(docs, max_seq_len, pad_id)


def indexed_pair(index: int, pair: Row | None, reason: str | None, held_out: bool = False) -> Row:
    """A planned preference pair's row as read now, keyed by its index (held out: ``-1 - index``). A pair that
    cannot be read though its index entry found it usable is a DataError naming it: there is no row of no pair
    that adds nothing to a preference loss."""
    if pair is None:
        raise DataError(f"{'held-out ' if held_out else ''}preference pair {index} cannot be read now ({reason}), "
                        "though its index entry, measured from its text and its images' headers, found it usable: "
                        "the data changed since it was indexed, or an image's body is broken")
    pair.key = -1 - index if held_out else index
    return pair


class _Reader:
    """One daemon thread that runs the functions it is given in order, each result in a Future: a reader left
    waiting (a run that stops on an error) does not keep the process from exiting."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None

    def submit(self, function, *args) -> Future:
        future: Future = Future()
        self.queue.put((future, function, args))
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="data-read-ahead", daemon=True)
            self.thread.start()
        return future

    def _run(self) -> None:
        while True:
            job = self.queue.get()
            if job is None:
                return
            future, function, args = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(function(*args))
                except BaseException as error:  # handed to whoever takes the rows
                    future.set_exception(error)

    def close(self) -> None:
        if self.thread is not None:
            self.queue.put(None)
            self.thread = None
