"""Whether a value read from YAML or JSON is of one of the config's types."""

from __future__ import annotations

import re
import typing

_SCIENTIFIC = re.compile(r"[-+]?\d+(\.\d*)?[eE][-+]?\d+")


def fits(value, hint) -> tuple[bool, object]:
    """(whether ``value``, as YAML or JSON gives it, is a ``hint``: bool, int, float, str or a list of one; the value
    as one). A bool is not a number; an int is a float; "1e-3", which PyYAML reads as a string, is a float."""
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            return False, None
        items = [fits(v, item) for v in value]
        return all(ok for ok, _ in items), [v for _, v in items]
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if hint is float:
        if isinstance(value, str) and _SCIENTIFIC.fullmatch(value.strip()):
            value = float(value)  # PyYAML reads "1e-3" (no dot) as a string
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else None
    if hint is str:
        return isinstance(value, str), value
    raise TypeError(f"unsupported config type {hint}")
