"""Each training sample's encoded length, found once from what is cheap to read, so that the rows can be planned
without reading a sample (``data.feeding.plan``) and each data rank reads only the samples of its own rows.

For sample ``i`` the index holds the number of tokens it encodes to under the run's encoding settings (fitted to
``data.max_seq_len`` as training fits it), or the reason it cannot be used; and, for the few samples fitting
changed, what it did (the counts training reports). A sample is measured from its text and its images' sizes,
read from their headers (``sample.unread``): the encoder gives such an image its tokens without its pixels.

The measuring is shared out over every process of the job (and ``data.num_workers`` each), gathered, and kept in
``data.index_dir`` under a key made of the data's identity (its files' size and modification time) and the
encoding settings: a later run with the same data and settings reads the index back in milliseconds. The files
are NumPy arrays, memory-mapped, and a JSON list of reasons with the digest of all three: an index edited since
it was kept is measured again; nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ...json_files import UnreadableJSON, read_json
from ..encoding.packing import FIT_COUNTS, PAD_TYPE, Row
from ..formats.kept import default_index_dir
from .workers import SampleWorkers, encode_in_order

# what the encoder counts of a sample it keeps: truncated, or its videos fitted (``packing.FIT_COUNTS``)
ENCODER_COUNTS = ("overlong_truncated", *FIT_COUNTS)
VERSION = 3  # of the index's contents: a change to how lengths are measured makes new keys
# reasons.json: {"reasons": [...], "digest": of all four}
FILES = ("lengths.npy", "patches.npy", "fitted.npy", "reasons.json")


@dataclass
class LengthIndex:
    lengths: np.ndarray  # int32 [n]: a sample's tokens, or -1 - the number of its reason in ``reasons``
    reasons: list[str]
    fitted: np.ndarray  # int64 [k, 1 + len(ENCODER_COUNTS)]: a sample fitting changed (ascending), then its counts
    patches: np.ndarray  # int32 [n]: the vision patches of a sample's images and videos (the ViT's work; 0 unusable)

    def __len__(self) -> int:
        return len(self.lengths)

    def reason(self, index: int) -> str | None:
        """Why sample ``index`` cannot be used, or None."""
        code = int(self.lengths[index])
        return self.reasons[-1 - code] if code < 0 else None

    def fit_counts(self, index: int) -> dict:
        """What fitting did to sample ``index`` (``ENCODER_COUNTS``), {} for most samples."""
        at = int(np.searchsorted(self.fitted[:, 0], index)) if len(self.fitted) else 0
        if at == len(self.fitted) or self.fitted[at, 0] != index:
            return {}
        return {name: int(n) for name, n in zip(ENCODER_COUNTS, self.fitted[at, 1:]) if n}


class Measure:
    """What measuring runs on each sample (in this process or a data worker): its length and fit counts."""

    def __init__(self, encoder):
        self.encoder = encoder
        self.stats = Counter()  # the workers' per-sample counts: nothing, the counts travel in the answer

    def __call__(self, sample) -> np.ndarray:
        self.encoder.stats = Counter()
        encoded = self.encoder(sample)
        # a preference pair encodes to a row of its own: its tokens before the padding
        length = int((encoded.token_type_ids != PAD_TYPE).sum()) if isinstance(encoded, Row) else len(encoded)
        patches = sum(int(np.prod(grid)) for grid in encoded.grids)
        return np.array([length, patches, *(self.encoder.stats[name] for name in ENCODER_COUNTS)], np.int64)


class Sizes:
    """A data set whose samples are read with their images' sizes alone (``shapes``)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        return self.dataset.shapes(index)


def index_key(dataset, encoder) -> str:
    """The data's identity and the encoding settings, hashed: what an index is kept under."""
    settings = {"version": VERSION, "data": dataset.identity(), "encoding": encoder.identity()}
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=repr).encode()).hexdigest()[:32]


def length_index(dataset, encoder, index_dir: str, env, workers: int = 0, progress: bool = True) -> LengthIndex:
    """The index of ``dataset`` under ``encoder``'s settings: read from ``index_dir`` (default: the user's cache)
    when kept there, otherwise measured by every process of the job together and kept. Every rank calls this."""
    folder = Path(index_dir or default_index_dir()) / index_key(dataset, encoder)
    found = _read(folder, len(dataset), encoder.max_seq_len)
    missing = env.all_gather_object(found is None)  # every rank asks together: a rank that lacks it, all measure
    if found is not None and not any(missing):
        return found
    parts = env.all_gather_object(_measure(dataset, encoder, env.rank, env.world_size, workers,
                                           progress and env.is_main))
    index = _merge(parts, len(dataset))
    if found is None:  # each node whose cache lacks it keeps it (a folder written whole, then renamed)
        _write(folder, index)
    return index


def _measure(dataset, encoder, rank: int, world: int, workers: int, progress: bool):
    """This process's share (every ``world``-th sample from ``rank``): lengths (int32; unusable: -1 - the reason's
    number in this share's reasons), reasons, fitted rows, patches (int32)."""
    sizes, measure = Sizes(dataset), Measure(encoder)
    pool = SampleWorkers(sizes, measure, workers) if workers else None
    indices = range(rank, len(dataset), world)
    lengths = np.zeros(len(indices), np.int32)
    patches = np.zeros(len(indices), np.int32)
    reasons: list[str] = []
    fitted = []
    bar = tqdm(total=len(dataset), desc="data index", mininterval=2.0, disable=not progress, unit="samples")
    try:
        for at, (index, measured, reason) in enumerate(encode_in_order(sizes, measure, indices, pool, Counter())):
            if reason is not None:
                if reason not in reasons:
                    reasons.append(reason)
                lengths[at] = -1 - reasons.index(reason)
            else:
                lengths[at], patches[at] = measured[:2]
                if measured[2:].any():
                    fitted.append([index, *measured[2:]])
            bar.update(world)
    finally:
        bar.close()
        if pool is not None:
            pool.close()
    return lengths, reasons, np.array(fitted, np.int64).reshape(-1, 1 + len(ENCODER_COUNTS)), patches


def _merge(parts: list, size: int) -> LengthIndex:
    """The shares of every process as one index (each share's reason numbers mapped to the whole's)."""
    world = len(parts)
    lengths, patches = np.zeros(size, np.int32), np.zeros(size, np.int32)
    reasons: list[str] = []
    for rank, (share, share_reasons, _, share_patches) in enumerate(parts):
        patches[rank::world] = share_patches
        for reason in share_reasons:
            if reason not in reasons:
                reasons.append(reason)
        codes = share.copy()
        bad = share < 0
        codes[bad] = [-1 - reasons.index(share_reasons[-1 - c]) for c in share[bad]]
        lengths[rank::world] = codes
    fitted = np.concatenate([f for _, _, f, _ in parts])
    return LengthIndex(lengths, reasons, fitted[np.argsort(fitted[:, 0], kind="stable")], patches)


def _write(folder: Path, index: LengthIndex) -> None:
    tmp = folder.with_name(f"{folder.name}.tmp-{secrets.token_hex(4)}")
    try:
        tmp.mkdir(parents=True)
        np.save(tmp / "lengths.npy", index.lengths)
        np.save(tmp / "fitted.npy", index.fitted)
        np.save(tmp / "patches.npy", index.patches)
        digest = _digest(index.lengths, index.fitted, index.reasons, index.patches)
        (tmp / "reasons.json").write_text(json.dumps({"reasons": index.reasons, "digest": digest}))
        if folder.is_dir():  # a damaged or edited index, measured again: set aside, then replaced
            stale = folder.with_name(f"{folder.name}.stale-{secrets.token_hex(4)}")
            folder.rename(stale)
            shutil.rmtree(stale, ignore_errors=True)
        tmp.rename(folder)
    except OSError:  # another process kept it first, or the cache cannot be written: the index is still used
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _read(folder: Path, size: int, max_seq_len: int) -> LengthIndex | None:
    """The index kept in ``folder``, or None when there is none (or it cannot be one for ``size`` samples of at
    most ``max_seq_len`` tokens: it is measured again)."""
    if not all((folder / name).is_file() for name in FILES):
        return None
    try:
        lengths = np.load(folder / "lengths.npy", mmap_mode="r", allow_pickle=False)
        fitted = np.load(folder / "fitted.npy", allow_pickle=False)
        patches = np.load(folder / "patches.npy", mmap_mode="r", allow_pickle=False)
        kept = read_json(folder / "reasons.json")
    except (OSError, ValueError, UnreadableJSON):
        return None
    reasons = kept.get("reasons") if isinstance(kept, dict) else None
    if not isinstance(kept, dict) or not isinstance(reasons, list):
        return None
    ok = (lengths.dtype == np.int32 and lengths.shape == (size,) and fitted.dtype == np.int64 and fitted.ndim == 2
          and fitted.shape[1] == 1 + len(ENCODER_COUNTS) and isinstance(reasons, list)
          and all(isinstance(r, str) for r in reasons) and int(lengths.min(initial=0)) >= -len(reasons)
          and int(lengths.max(initial=0)) <= max_seq_len and patches.dtype == np.int32 and patches.shape == (size,)
          and kept.get("digest") == _digest(lengths, fitted, reasons, patches))
    return LengthIndex(lengths, reasons, fitted, patches) if ok else None


def _digest(lengths: np.ndarray, fitted: np.ndarray, reasons: list[str], patches: np.ndarray) -> str:
    """The digest of an index's contents, kept beside them: one edited by hand no longer matches it."""
    digest = hashlib.blake2b(digest_size=16)
    for array in (lengths, fitted, patches):
        digest.update(np.ascontiguousarray(array).tobytes())
    digest.update(json.dumps(reasons).encode())
    return digest.hexdigest()
