"""Reading PaddleNLP's ``model_state.pdparams`` without running code from the file.

``paddle.save`` pickles a state dict as NumPy arrays (bfloat16 as uint16 bit patterns). ``paddle.load``
unpickles with Python's default rules, under which a crafted file calls any function it names. Here the
unpickler admits only what such a state dict is made of (arrays, dtypes, dicts, lists, tuples, plain values)
and refuses any other global, so a file that names one is an error, never executed.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from .errors import CheckpointError

_ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("collections", "OrderedDict"), ("builtins", "tuple"),
}


class _StateDictUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which a state dict of tensors never holds")
        return super().find_class(module, name)


def load_pdparams(path) -> dict[str, np.ndarray]:
    """The tensors of a ``.pdparams`` file as NumPy arrays (bfloat16 widened to float32)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            state = _StateDictUnpickler(f).load()
    except Exception as err:  # refused globals, truncation and garbage surface as several exception types
        raise CheckpointError(f"refusing to read {path}: {err}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"refusing to read {path}: it holds a {type(state).__name__}, not a state dict")
    tensors = {}
    for key, value in state.items():
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], np.ndarray):
            value = value[1]  # (name, array), how paddle.save writes a bare tensor
        if not isinstance(value, np.ndarray):
            continue  # bookkeeping such as 'StructuredToParameterName@@'
        if value.dtype == np.uint16:  # bfloat16 bit patterns
            value = (value.astype(np.uint32) << 16).view(np.float32)
        tensors[str(key)] = value
    return tensors

