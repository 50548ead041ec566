"""Reading a JSON file someone else may have written: a model folder's, a checkpoint's, an adapter's or a
tokenizer's. Its size is judged before it is read, it must be UTF-8 text, and a nesting deeper than the decoder
survives is a reason like any other. Callers put the reason into their own error, naming the file.

And writing what a run reports (``metrics.jsonl``, ``summary.json``) as strict JSON: ``NaN`` and ``Infinity`` are
not JSON, so strict readers (``jq``, a browser) refuse them; :func:`strict_json` writes ``null`` instead, with the
reason beside it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .paths import not_a_file

# far above any such file this package reads (a large model's index or a tokenizer.json is a few MiB)
MAX_BYTES = 256 * 1024 * 1024


class UnreadableJSON(ValueError):
    """Why a JSON file cannot be read (the reason alone, without the file's name)."""


def read_json(path, max_bytes: int = MAX_BYTES):
    """The value in the JSON file ``path``; UnreadableJSON saying why not."""
    path = Path(path)
    problem = not_a_file(path)
    if problem is not None:
        raise UnreadableJSON(f"it {problem}")
    try:
        size = path.stat().st_size
        data = path.read_bytes() if size <= max_bytes else None
    except OSError as err:
        raise UnreadableJSON(str(err)) from None
    if data is None:
        raise UnreadableJSON(f"it is {size:,} bytes, more than the {max_bytes:,} such a file may have")
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise UnreadableJSON("it is not UTF-8 text") from None
    except RecursionError:
        raise UnreadableJSON("it is nested too deep") from None
    except ValueError as err:  # text that is not JSON
        raise UnreadableJSON(str(err)) from None


def read_json_object(path, error: type[Exception], max_bytes: int = MAX_BYTES) -> dict:
    """The JSON object in ``path``; ``error`` naming the file and why when it cannot be read or holds a value of
    another kind."""
    try:
        value = read_json(path, max_bytes)
    except UnreadableJSON as err:
        raise error(f"cannot read {path}: {err}") from None
    if not isinstance(value, dict):
        raise error(f"{path} holds a JSON {type(value).__name__}, not an object")
    return value


def strict_json(value):
    """``value`` with every non-finite float as None; in an object, ``<key>_nonfinite`` (``"nan"``, ``"inf"`` or
    ``"-inf"``) beside such a key."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            out[key] = strict_json(item)
            if isinstance(item, float) and not math.isfinite(item):
                out[f"{key}_nonfinite"] = "nan" if math.isnan(item) else "inf" if item > 0 else "-inf"
        return out
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    return value


def dumps(value, **kwargs) -> str:
    """Strict JSON text of ``value`` (see :func:`strict_json`)."""
    return json.dumps(strict_json(value), allow_nan=False, **kwargs)
