"""Which samples each global row holds, decided from the samples' lengths alone.

The plan packs as :class:`~.loader.RowStream` packs (greedily, in the seeded order of each epoch, unusable samples
passed over), but from a :class:`~.length_index.LengthIndex`: it reads no sample, so every data rank plans every
row and then reads only the samples of its own. Its position is a few numbers (the epoch, the place in its order,
the samples of the row being filled, the counts so far), which a checkpoint keeps and a resume restores at once.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from ..formats.sample import DataError, no_usable_sample
from .length_index import LengthIndex


def sample_order(seed: int, epoch: int, size: int) -> np.ndarray:
    """The permutation of epoch ``epoch``: a function of (seed, epoch) only (int32 below 2**31 samples: the same
    permutation in half the memory)."""
    indices = np.arange(size, dtype=np.int32 if size < 2 ** 31 else np.int64)
    return np.random.default_rng([seed, epoch]).permutation(indices)


class PackingPlan:
    def __init__(self, index: LengthIndex, seed: int, max_seq_len: int, stats: Counter, one_per_row: bool = False):
        """``stats``: the counts of skipped samples (each once, in the first epoch) and of fitted ones (each time
        one is planned), as reading the samples in order would count them; ``one_per_row``: each row one sample
        (preference pairs), in the same order."""
        self.one_per_row = one_per_row
        if not (index.lengths >= 0).any():
            raise no_usable_sample(dict(Counter(index.reason(i) for i in range(len(index)))))
        self.index, self.seed, self.max_seq_len, self.stats = index, seed, max_seq_len, stats
        self.epoch, self.position = 0, 0
        self.open: list[int] = []  # the samples of the row being filled
        self.used = 0  # their tokens
        self._order: tuple[int, np.ndarray] = (-1, np.zeros(0, np.int64))  # (epoch, its order)

    def next_row(self) -> list[int]:
        """The samples of the next row, in order."""
        while True:
            if self._order[0] != self.epoch:
                self._order = (self.epoch, sample_order(self.seed, self.epoch, len(self.index)))
            order = self._order[1]
            if self.position == len(order):
                self.epoch, self.position = self.epoch + 1, 0
                continue
            sample = int(order[self.position])
            self.position += 1
            length = int(self.index.lengths[sample])
            if length < 0:
                if self.epoch == 0:
                    self.stats[self.index.reason(sample)] += 1
                continue
            self.stats.update(self.index.fit_counts(sample))
            if self.open and (self.one_per_row or self.used + length > self.max_seq_len):
                row, self.open, self.used = self.open, [sample], length
                return row
            self.open.append(sample)
            self.used += length

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "open_row": list(self.open),
                "skipped": dict(self.stats)}

    def load_state_dict(self, state: dict) -> None:
        """DataError naming the field when ``state`` cannot be a position in this data."""
        check_position(state, len(self.index), self.max_seq_len, ("epoch", "position", "open_row", "skipped"))
        lengths = self.index.lengths[np.asarray(state["open_row"], np.int64)]
        if (lengths < 0).any():
            raise DataError("the saved data position's open row holds a sample this data cannot use: the data "
                            "changed since it was saved")
        if int(lengths.sum()) > self.max_seq_len or (self.one_per_row and len(lengths) > 1):
            raise DataError(f"the saved data position's open row ({len(state['open_row'])} samples, "
                            f"{int(lengths.sum())} tokens) is no row the plan fills: its samples fit "
                            f"data.max_seq_len ({self.max_seq_len}) together (a hand-edited checkpoint, or other data)")
        self.epoch, self.position = state["epoch"], state["position"]
        self.open, self.used = list(state["open_row"]), int(lengths.sum())
        self.stats.clear()
        self.stats.update(state["skipped"])


def rows_in_order(index: LengthIndex, max_seq_len: int, stats: Counter, one_per_row: bool = False) -> list[list[int]]:
    """The samples of each row of one pass over the data in its own order, packed as an unshuffled
    :class:`~.loader.RowStream` packs them (a held-out set: the last row may be short; ``one_per_row``: preference
    pairs, a row each), from the lengths alone; unusable samples are counted in ``stats`` by reason, and what
    fitting changed by its counts."""
    rows: list[list[int]] = []
    row: list[int] = []
    used = 0
    for sample, length in enumerate(index.lengths.tolist()):
        if length < 0:
            stats[index.reason(sample)] += 1
            continue
        stats.update(index.fit_counts(sample))
        if row and (one_per_row or used + length > max_seq_len):
            rows.append(row)
            row, used = [], 0
        row.append(sample)
        used += length
    return rows + [row] if row else rows


def deal_by_patches(rows: list[list[int]], patches: np.ndarray, world: int) -> list[list[list[int]]]:
    """The rows of a global micro-batch (their samples) dealt to ``world`` data ranks, as many to each, so that each
    rank's vision patches are as even as a greedy deal makes them: the rows by their patches, most first, each to
    the rank with the fewest so far that has room (ties: the lower rank); each rank's rows in their batch order.
    Every rank deals the same rows alike."""
    per_rank = len(rows) // world
    cost = [int(patches[row].sum()) if row else 0 for row in rows]
    taken: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for i in sorted(range(len(rows)), key=lambda i: (-cost[i], i)):
        rank = min((r for r in range(world) if len(taken[r]) < per_rank), key=lambda r: (load[r], r))
        taken[rank].append(i)
        load[rank] += cost[i]
    return [[rows[i] for i in sorted(mine)] for mine in taken]


def check_position(state, size: int, max_seq_len: int, fields: tuple[str, ...]) -> None:
    """DataError unless ``state``'s ``fields`` make a position in a data set of ``size`` samples."""
    def whole(value, high=None) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0 and (high is None or
                                                                                          value <= high)

    def indices(values, most: int) -> bool:
        return isinstance(values, list) and len(values) <= most and all(whole(v, size - 1) for v in values)

    checks = {
        "epoch": (lambda v: whole(v), "a whole number of 0 or more"),
        "position": (lambda v: whole(v, size), f"a place in an epoch of {size} samples (0 to {size})"),
        "open_row": (lambda v: indices(v, max_seq_len), f"a list of at most {max_seq_len} sample indices below {size}"),
        "unusable": (lambda v: indices(v, size), f"a list of sample indices below {size}"),
        "skipped": (lambda v: isinstance(v, dict) and all(isinstance(k, str) and whole(n) for k, n in v.items()),
                    "an object of counts"),
    }
    if not isinstance(state, dict):
        raise DataError(f"the saved data position must be an object, not {type(state).__name__}")
    for name in fields:
        ok, wanted = checks[name]
        if not ok(state.get(name)):
            shown = repr(state.get(name))
            raise DataError(f"the saved data position's '{name}' must be {wanted}, not "
                            f"{shown if len(shown) <= 80 else shown[:80] + '...'}: not a position in this data (a "
                            "checkpoint of other data, or a hand-edited one)")
