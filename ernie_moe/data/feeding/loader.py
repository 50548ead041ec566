"""Data sources, tokenizer choice, the deterministic row stream and batching."""

from __future__ import annotations

import dataclasses
from collections import Counter, deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import paddle

from ...batch import IGNORE_INDEX, PAIR_SIDES, Batch, HostCounts
from ...config.schema import MTP_MAX_DEPTH, Config
from ..encoding.packing import BadSample, Encoded, Encoder, Row, make_row
from ..encoding.pairs import PairEncoder
from ..encoding.tokenizer import ByteTokenizer, Tokenizer, WordTokenizer, tokenizer_in
from ..formats import synthetic
from ..formats.chat import chat_format
from ..formats.preference import SyntheticPairs
from ..formats.sample import DataError, no_usable_sample
from ..formats.sources import source_dataset
from .plan import check_position, sample_order
from .workers import SampleWorkers, encode_in_order


def build_tokenizer(cfg: Config):
    """``data.tokenizer_path``'s tokenizer, else the one in ``training.model_name_or_path``'s folder (a fine-tune
    encodes as its base was trained), else a built-in one (the synthetic data's words, or bytes)."""
    d = cfg.data
    folder, given = d.tokenizer_path, bool(d.tokenizer_path)
    if not folder and cfg.training.model_name_or_path and Path(cfg.training.model_name_or_path).is_dir():
        folder = cfg.training.model_name_or_path
    if folder:
        try:
            tokenizer = tokenizer_in(folder, cfg.model.im_patch_id)
            if tokenizer is not None:
                chat_format(tokenizer)  # a chat template that cannot be read stops the run here
                return tokenizer
        except ValueError as err:
            if err.__cause__ is not None:  # sentencepiece's word for a file that is not its model: its last line
                said = str(err.__cause__).strip().splitlines()
                raise DataError(f"{err}: {said[-1]}" if said else str(err)) from None
            raise DataError(f"the tokenizer in '{folder}' cannot be read: {err}") from None  # special tokens, template
        if given:
            raise DataError(f"data.tokenizer_path '{folder}' holds no tokenizer (tokenizer.model, vocab.json or "
                            "tokenizer_config.json)")
    if d.dataset == "synthetic":
        return WordTokenizer(synthetic.vocabulary())
    return ByteTokenizer()


def build_datasets(cfg: Config):
    """(training set, held-out set or None): samples, or preference pairs with ``training.stage: dpo``."""
    d = cfg.data
    train: Any  # a source (synthetic, a file, shards) or a mix of them: each indexes samples or pairs
    if d.dataset == "synthetic":
        shapes = SyntheticPairs if is_preference(cfg) else synthetic.SyntheticShapes
        train = shapes(cfg.training.seed, "train", d.num_train_samples, d.image_size, d.blank_images)
        held_out = shapes(cfg.training.seed, "eval", d.num_eval_samples, d.image_size, d.blank_images)
        return train, held_out if d.num_eval_samples else None
    sources = [source_dataset(path, d, is_preference(cfg)) for path in d.train_files]
    texts = [source_dataset(path, d, is_preference(cfg)) for path in d.text_files]
    if texts:  # ERNIEKit's modality_ratio: the train_path files' share beside the text_path files'
        probs = [d.modality_ratio[0] * p for p in _shares(d.train_probs, len(sources))] + \
                [d.modality_ratio[1] * p for p in _shares(d.text_probs, len(texts))]
        train = MixedDataset(sources + texts, probs, cfg.training.seed)
    else:
        train = sources[0] if len(sources) == 1 else MixedDataset(sources, d.train_probs, cfg.training.seed)
    return train, source_dataset(d.eval_path, d, is_preference(cfg)) if d.eval_path else None


def is_preference(cfg: Config) -> bool:
    """Whether the run trains on preference pairs."""
    return cfg.training.stage == "dpo"


def _shares(probs: list[float], count: int) -> list[float]:
    """How one group's share is split over its ``count`` files: ``probs``, or evenly."""
    return list(probs) if probs else [1.0 / count] * count


class MixedDataset:
    """Several data sets as one. With ``probs``, sample ``i`` is drawn from source ``s`` with probability
    ``probs[s]`` (normalised) and is a random sample of it, with replacement: a function of (seed, i) only, so
    any layout reads the same global batches. Without, the sources follow one another."""

    def __init__(self, sources: list, probs: list[float], seed: int):
        self.sources, self.seed = sources, seed
        self.starts = np.cumsum([0] + [len(s) for s in sources])
        self.probs = np.asarray(probs, np.float64) / np.sum(probs) if probs else None
        if self.probs is not None:
            empty = [s.path for s, p in zip(sources, self.probs) if p > 0 and len(s) == 0]
            if empty:
                raise DataError(f"data.train_path '{empty[0]}' holds no records but its data.train_probs is not 0")

    def __len__(self) -> int:
        return int(self.starts[-1])

    def source_of(self, index: int) -> tuple[int, int]:
        """(source, index in it) of sample ``index``."""
        if self.probs is None:
            source = int(np.searchsorted(self.starts, index, side="right") - 1)
            return source, index - int(self.starts[source])
        rng = np.random.default_rng([self.seed, 0x6D6978, index])  # a stream of its own ("mix")
        source = int(rng.choice(len(self.sources), p=self.probs))
        return source, int(rng.integers(len(self.sources[source])))

    def __getitem__(self, index: int):
        source, inner = self.source_of(index)
        return self.sources[source][inner]

    def shapes(self, index: int):
        source, inner = self.source_of(index)
        return self.sources[source].shapes(inner)

    def identity(self) -> dict:
        return {"mixed": [s.identity() for s in self.sources], "probs": None if self.probs is None else
                self.probs.tolist(), "seed": self.seed}


def training_encoder(tokenizer: Tokenizer, cfg: Config, stats: Counter) -> Encoder:
    """Samples encoded as the run's ``data`` section says; skipped samples counted in ``stats``."""
    return Encoder(tokenizer, cfg.model, cfg.data.max_seq_len, cfg.data.overlong, cfg.data.max_image_side, stats,
                   cfg.data.pixel_budget, cfg.data.video_budget)


def sample_encoder(tokenizer: Tokenizer, cfg, stats: Counter) -> Encoder | PairEncoder:
    """What encodes the run's training records: :func:`training_encoder`, or a pair encoder around it (each pair
    a row of its own)."""
    encoder = training_encoder(tokenizer, cfg, stats)
    return PairEncoder(encoder) if is_preference(cfg) else encoder


class RowStream:
    """Packed rows of a dataset, in an order that does not depend on how many processes read it. A sample
    found unusable is counted once and passed over without being read again in later epochs. With
    ``workers`` background processes read and encode the samples (``data.num_workers``), in the same order.

    The stream is an iterator whose position is a few numbers (:meth:`state_dict`): the epoch, how far into the
    epoch's order the packer has read, the samples of the row it is filling and the samples found unusable. A
    stream given that state (:meth:`load_state_dict`) continues with the rows it would have made, reading only the
    samples of the open row again: a resume costs the same at step 20 as at step 20,000."""

    def __init__(self, dataset, tokenizer: Tokenizer, cfg: Config, stats: Counter, shuffle: bool, workers: int = 0,
                 held_out: bool = False):
        """``held_out``: the rows of a held-out set (a pair's key is then ``-1 - index``)."""
        self.dataset, self.tokenizer, self.stats, self.shuffle = dataset, tokenizer, stats, shuffle
        self.held_out = held_out
        self.unusable: set[int] = set()
        self.seed = cfg.training.seed
        self.max_seq_len = cfg.data.max_seq_len
        self.encoder = sample_encoder(tokenizer, cfg, stats)
        self.pairs = is_preference(cfg)  # a row per pair, not packed samples
        self.workers = SampleWorkers(dataset, self.encoder, workers) if workers else None
        self.epoch, self.position = 0, 0  # the next sample: epoch, place in that epoch's order
        self.pending: list[tuple[int, Encoded]] = []  # (index, sample) of the row being filled
        self.used = 0  # their tokens
        self._source: Iterator[tuple[int, Any]] | None = None  # from (epoch, position) on, begun at the first row

    def _order(self):
        size = len(self.dataset)
        return sample_order(self.seed, self.epoch, size) if self.shuffle else range(size)

    def _indices(self, order, sent: deque):
        """The indices of ``order`` from the position on, but the unusable ones; each one's place into ``sent``."""
        for place in range(self.position, len(order)):
            if int(order[place]) not in self.unusable:
                sent.append(place)
                yield int(order[place])

    def _samples(self):
        """(index, encoded sample) of each usable sample from (epoch, position) on, the position moving past
        each sample as it is handed out (workers may have read further ahead)."""
        while True:
            sent = deque()  # the place in the order of each index asked for and not yet handed out
            indices = self._indices(self._order(), sent)
            for index, encoded, reason in encode_in_order(self.dataset, self.encoder, indices, self.workers,
                                                          self.stats):
                self.position = sent.popleft() + 1
                if reason is not None:
                    self.stats[reason] += 1
                    self.unusable.add(index)
                    continue
                if self.pairs:
                    encoded.key = -1 - index if self.held_out else index
                yield index, encoded
            if not self.shuffle:
                return
            if len(self.unusable) >= len(self.dataset):
                raise no_usable_sample(dict(self.stats))
            self.epoch, self.position = self.epoch + 1, 0

    def __iter__(self):
        return self

    def __next__(self) -> Row | Encoded:
        """The next packed row (greedy: a sample that does not fit closes the row and starts the next), or with
        preference pairs the next pair."""
        if self._source is None:
            self._source = self._samples()
        source = self._source
        if self.pairs:
            return next(source)[1]
        for index, sample in source:
            if self.pending and self.used + len(sample) > self.max_seq_len:
                row, self.pending, self.used = self._row(), [(index, sample)], len(sample)
                return row
            self.pending.append((index, sample))
            self.used += len(sample)
        if not self.pending:
            raise StopIteration
        row, self.pending, self.used = self._row(), [], 0
        return row

    def _row(self) -> Row:
        return make_row([sample for _, sample in self.pending], self.max_seq_len, self.tokenizer.pad_id)

    def state_dict(self) -> dict:
        """Where the stream is, as JSON values: the same on every rank (the stream is the global one)."""
        return {"epoch": self.epoch, "position": self.position, "open_row": [i for i, _ in self.pending],
                "unusable": sorted(self.unusable), "skipped": dict(self.stats)}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (of :meth:`state_dict`): the open row's samples are read again, nothing
        else. DataError naming the field when a value cannot be a position in this data."""
        if self._source is not None:
            raise RuntimeError("a row stream's position is set before its first row")
        size = len(self.dataset)
        check_position(state, size, self.max_seq_len, ("epoch", "position", "open_row", "unusable", "skipped"))
        self.epoch, self.position = state["epoch"], state["position"]
        self.unusable = set(state["unusable"])
        pending: list[tuple[int, Any]] = []
        for index in state["open_row"]:
            try:
                pending.append((index, self.encoder(self.dataset[index])))
            except BadSample as bad:
                raise DataError(f"sample {index} of the row the checkpoint was filling cannot be read now "
                                f"({bad.reason}): the data changed since it was saved") from None
        self.pending, self.used = pending, sum(len(sample) for _, sample in pending)
        self.stats.clear()  # the counts as saved, without the open row's samples counted twice
        self.stats.update(state["skipped"])

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()


def rank_batches(rows, global_rows: int, rank: int, world: int, drop_last: bool = True):
    """Cut the row stream into global batches of ``global_rows`` and yield this rank's contiguous share.

    A short last batch (``drop_last=False``) that leaves a rank without rows gives it a copy of the batch's
    first row with no labels: every rank runs the same number of forwards, which expert-parallel ranks need
    (they exchange tokens in every MoE layer), and the copy adds nothing to losses or accuracies.
    """
    batch: list[Row] = []
    for row in rows:
        batch.append(row)
        if len(batch) == global_rows:
            yield rank_share(batch, rank, world)
            batch = []
    if batch and not drop_last:
        yield short_share(batch, rank, world) or [unlabelled(batch[0])]


def rank_share(batch: list, rank: int, world: int) -> list:
    """Data rank ``rank``'s contiguous share of a global batch whose size ``world`` divides."""
    per_rank = len(batch) // world
    return batch[rank * per_rank: (rank + 1) * per_rank]


def short_share(batch: list, rank: int, world: int) -> list:
    """Data rank ``rank``'s contiguous share of a short last batch (each rank the same number, the last ranks
    fewer or none)."""
    share = -(-len(batch) // world)
    return batch[rank * share: (rank + 1) * share]


def unlabelled(row: Row) -> Row:
    """A copy of ``row`` with no labels: a forward that adds nothing to losses or accuracies."""
    return dataclasses.replace(row, labels=np.full_like(row.labels, IGNORE_INDEX), scored=np.zeros_like(row.scored))


def _stacked(rows: list[Row], field: str, dtype) -> paddle.Tensor | None:
    """The rows' ``field`` stacked into one tensor, or None where the rows do not have it."""
    if getattr(rows[0], field) is None:
        return None
    return paddle.to_tensor(np.stack([np.asarray(getattr(r, field), dtype) for r in rows]))


def objective_inputs(rows: list[Row]) -> dict[str, np.ndarray]:
    """Each input the rows carry, stacked over the rows (the same names in every row, or the batch is refused)."""
    names = rows[0].inputs.keys()
    if any(r.inputs.keys() != names for r in rows):
        raise ValueError(f"a batch's rows carry different objective inputs: {sorted({tuple(r.inputs) for r in rows})}")
    return {name: np.stack([r.inputs[name] for r in rows]) for name in names}


def collate(rows: list[Row]) -> Batch:
    patches = [p for row in rows for p in row.patches]
    grids = [g for row in rows for g in row.grids]
    channels = patches[0].shape[1] if patches else 0
    labels, types = np.stack([r.labels for r in rows]), np.stack([r.token_type_ids for r in rows])
    key_ends = np.stack([r.key_ends for r in rows])
    inputs = objective_inputs(rows)
    return Batch(
        input_ids=paddle.to_tensor(np.stack([r.input_ids for r in rows])),
        labels=paddle.to_tensor(labels),
        token_type_ids=paddle.to_tensor(types),
        position_ids=paddle.to_tensor(np.stack([r.position_ids for r in rows])),
        key_ends=paddle.to_tensor(key_ends),
        pixel_patches=paddle.to_tensor(np.concatenate(patches) if patches else np.zeros([0, channels], np.float32)),
        grid_thw=np.stack(grids) if grids else np.zeros([0, 3], np.int64),
        objective_inputs={name: paddle.to_tensor(value) for name, value in inputs.items()},
        row_keys=np.array([r.key for r in rows], np.int64),
        routes=_stacked(rows, "routes", np.int32),
        # MTP_MAX_DEPTH: whatever depths the model has
        counts=HostCounts.of(labels, types, inputs.get(PAIR_SIDES), key_ends, MTP_MAX_DEPTH),
    )
