"""Arrays kept in the user's cache between runs (a JSONL file's line offsets, the length index's parts): written
whole under a temporary name, memory-mapped back, with a digest after the values where an edit must be noticed.
Plain NumPy files, read without pickle."""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

import numpy as np


def default_index_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ernie_moe" / "data_index"


def seal(values: np.ndarray) -> int:
    """A 64-bit digest of an int64 array's values, kept after them: an array edited by hand, or cut short, no longer
    matches it."""
    return int.from_bytes(hashlib.blake2b(np.ascontiguousarray(values).tobytes(), digest_size=8).digest(), "little",
                          signed=True)


def keep_array(path: Path, values: np.ndarray, sealed: bool = False) -> bool:
    """Write ``values`` to ``path`` whole (a temporary name, then renamed), with ``sealed`` their digest after them;
    whether it was kept."""
    tmp = path.with_name(f"{path.stem}.tmp-{secrets.token_hex(4)}.npy")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(tmp, np.append(values, np.int64(seal(values))) if sealed else values)
        tmp.rename(path)
        return True
    except OSError:  # a cache that cannot be written: the values are used from memory
        tmp.unlink(missing_ok=True)
        return False


def kept_array(path: Path, dtype, sealed: bool = False, check: bool = True) -> np.ndarray | None:
    """The 1-D array of ``dtype`` kept at ``path``, memory-mapped; None when there is none, it is not one (nor a
    regular file: a FIFO would block the read), or, ``sealed``, its values do not match the digest kept after them
    (``check=False``: not computed again, where this process's parent did)."""
    if not path.is_file():
        return None
    try:
        values = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError):
        return None
    if values.dtype != dtype or values.ndim != 1:
        return None
    if not sealed:
        return values
    if not len(values) or (check and seal(values[:-1]) != int(values[-1])):
        return None
    return values[:-1]
