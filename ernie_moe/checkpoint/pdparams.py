"""Reading PaddleNLP's ``model_state.pdparams`` without running code from the file.

``paddle.save`` pickles a state dict of NumPy arrays (bfloat16 as uint16 bit patterns). ``paddle.load``
unpickles it with Python's pickle, under which a crafted file calls any function it names. This reader does not
unpickle: it interprets the few opcodes such a file is made of (pickle protocols 2 to 4, those ``paddle.save``
writes), builds the dicts, lists, tuples, strings, numbers and bytes itself, and turns the names a saved array is
written with (NumPy's array and dtype reconstructors, ``OrderedDict``, ``tuple``, and protocol 2's spelling of
bytes) into arrays of plain dtypes, calling nothing the file names. Any other opcode, name or dtype is an error.
"""

from __future__ import annotations

import os
import re
import struct
from pathlib import Path
from typing import Literal

import numpy as np

from .errors import CheckpointError

# (module, name) the file may name -> what it stands for here
_NAMES = {
    ("numpy.core.multiarray", "_reconstruct"): "array", ("numpy._core.multiarray", "_reconstruct"): "array",
    ("numpy.core.multiarray", "scalar"): "scalar", ("numpy._core.multiarray", "scalar"): "scalar",
    ("numpy", "ndarray"): "ndarray", ("numpy", "dtype"): "dtype",
    ("collections", "OrderedDict"): "dict", ("builtins", "tuple"): "tuple", ("__builtin__", "tuple"): "tuple",
    ("_codecs", "encode"): "encode", ("builtins", "bytes"): "bytes", ("__builtin__", "bytes"): "bytes",
}
_PLAIN_KINDS = "biuf"  # bool, signed and unsigned integers, floats: no objects, strings or records
_TYPE_CODE = re.compile(r"[A-Za-z]\d*")  # how NumPy pickles a dtype ('f4', 'b1', 'O8'): never a parsed expression


class _Name:
    def __init__(self, kind: str):
        self.kind = kind


class _Pending:
    """An array or dtype made by REDUCE, waiting for its BUILD state; ``value`` once built (the memo may hold it
    from before)."""

    def __init__(self, kind: str, code: str | None = None):
        self.kind, self.code, self.value = kind, code, None


class _Refused(Exception):
    pass


def _dtype(code, state) -> np.dtype:
    if not isinstance(code, str) or not _TYPE_CODE.fullmatch(code):
        raise _Refused(f"it holds a dtype written {code!r}, not a type code such as 'f4'")
    if not isinstance(state, tuple) or len(state) < 5 or any(part is not None for part in state[2:5]):
        raise _Refused("it holds a structured dtype")
    order: Literal["<", ">", "="] = "<" if state[1] == "<" else ">" if state[1] == ">" else "="
    dtype = np.dtype(code).newbyteorder(order)
    if dtype.kind not in _PLAIN_KINDS:
        raise _Refused(f"it holds an array of dtype {dtype}, which a state dict of tensors never holds")
    return dtype


def _array(state) -> np.ndarray:
    if not isinstance(state, tuple) or len(state) != 5:
        raise _Refused("an array's state is not (version, shape, dtype, order, bytes)")
    _, shape, dtype, fortran, raw = state
    if not isinstance(dtype, np.dtype) or not isinstance(raw, bytes) or not isinstance(shape, tuple) or not all(
            isinstance(n, int) and n >= 0 for n in shape):
        raise _Refused("an array's state is not (version, shape, dtype, order, bytes)")
    if len(raw) != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
        raise _Refused(f"an array of shape {tuple(shape)} and dtype {dtype} holds {len(raw)} bytes")
    return np.frombuffer(raw, dtype).reshape(shape, order="F" if fortran else "C")


def _call(target, args):
    """REDUCE: what an admitted name applied to ``args`` makes."""
    kind = target.kind if isinstance(target, _Name) else None
    if kind == "array" and len(args) == 3 and isinstance(args[0], _Name) and args[0].kind == "ndarray":
        return _Pending("array")
    if kind == "dtype" and len(args) == 3:
        return _Pending("dtype", args[0])
    if kind == "scalar" and len(args) == 2 and isinstance(args[0], np.dtype) and isinstance(args[1], bytes):
        return _array((1, (), args[0], False, args[1]))[()]
    if kind == "dict" and not args:
        return {}
    if kind == "tuple" and len(args) == 1 and isinstance(args[0], list | tuple):
        return tuple(args[0])
    if kind == "bytes" and not args:  # protocol 2's empty bytes
        return b""
    if kind == "encode" and len(args) == 2 and isinstance(args[0], str) and args[1] in ("latin1", "latin-1"):
        return args[0].encode("latin1")
    raise _Refused("it calls something other than a saved array's, dtype's or container's constructor")


class _Reader:
    def __init__(self, f):
        self.f = f
        self.size = os.fstat(f.fileno()).st_size  # a length past the end is refused before anything is allocated
        self.stack: list = []
        self.marks: list[list] = []
        self.memo: dict[int, object] = {}

    def take(self, n: int) -> bytes:
        data = self.f.read(n) if n <= self.size - self.f.tell() else b""
        if len(data) != n:
            raise _Refused("it ends early")
        return data

    def number(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def line(self) -> str:
        data = self.f.readline()
        if not data.endswith(b"\n"):
            raise _Refused("it ends early")
        return data[:-1].decode("utf-8")

    def since_mark(self) -> tuple[list, list]:
        """(the items pushed since the last mark, the stack below it, which is the stack again)."""
        if not self.marks:
            raise _Refused("it is not a pickle of a state dict")
        items, self.stack = self.stack, self.marks.pop()
        return items, self.stack

    def named(self, module: str, name: str) -> _Name:
        kind = _NAMES.get((module, name))
        if kind is None:
            raise _Refused(f"it names {module}.{name}, which a state dict of tensors never holds")
        return _Name(kind)

    def read(self):
        s = self.stack
        while True:
            code = self.take(1)
            if code == b".":  # STOP
                if len(s) != 1 or self.marks:
                    raise _Refused("it is not a pickle of a state dict")
                return s[0]
            if code == b"\x80":  # PROTO
                self.take(1)
            elif code == b"\x95":  # FRAME: a length hint only
                self.take(8)
            elif code == b"(":
                self.marks.append(s)
                s = self.stack = []
            elif code in (b"}", b"]", b")"):
                s.append({} if code == b"}" else [] if code == b"]" else ())
            elif code == b"t":
                items, s = self.since_mark()
                s.append(tuple(items))
            elif code in (b"\x85", b"\x86", b"\x87"):  # TUPLE1..3
                n = code[0] - 0x84
                if len(s) < n:
                    raise _Refused("it is not a pickle of a state dict")
                items = tuple(s[-n:])
                del s[-n:]
                s.append(items)
            elif code in (b"l", b"d"):  # LIST, DICT from the mark
                items, s = self.since_mark()
                s.append(list(items) if code == b"l" else dict(zip(items[::2], items[1::2])))
            elif code in (b"a", b"e"):  # APPEND, APPENDS
                items, s = ([s.pop()], s) if code == b"a" else self.since_mark()
                if not isinstance(s[-1], list):
                    raise _Refused("it appends to something other than a list")
                s[-1].extend(items)
            elif code in (b"s", b"u"):  # SETITEM, SETITEMS
                if code == b"s":
                    items = [s[-2], s[-1]]
                    del s[-2:]
                else:
                    items, s = self.since_mark()
                if not isinstance(s[-1], dict) or len(items) % 2:
                    raise _Refused("it sets items of something other than a dict")
                for key, value in zip(items[::2], items[1::2]):
                    s[-1][key] = value
            elif code in (b"X", b"\x8c", b"\x8d"):  # BINUNICODE, SHORT_BINUNICODE, BINUNICODE8
                n = self.number({b"X": "<I", b"\x8c": "<B", b"\x8d": "<Q"}[code])
                s.append(self.take(n).decode("utf-8"))
            elif code in (b"B", b"C", b"\x8e"):  # BINBYTES, SHORT_BINBYTES, BINBYTES8
                s.append(self.take(self.number({b"B": "<I", b"C": "<B", b"\x8e": "<Q"}[code])))
            elif code in (b"J", b"K", b"M"):  # BININT, BININT1, BININT2
                s.append(self.number({b"J": "<i", b"K": "<B", b"M": "<H"}[code]))
            elif code == b"\x8a":  # LONG1
                s.append(int.from_bytes(self.take(self.number("<B")), "little", signed=True))
            elif code == b"G":
                s.append(self.number(">d"))
            elif code in (b"N", b"\x88", b"\x89"):
                s.append({b"N": None, b"\x88": True, b"\x89": False}[code])
            elif code == b"c":  # GLOBAL
                s.append(self.named(self.line(), self.line()))
            elif code == b"\x93":  # STACK_GLOBAL
                name, module = s.pop(), s.pop()
                if not isinstance(module, str) or not isinstance(name, str):
                    raise _Refused("it is not a pickle of a state dict")
                s.append(self.named(module, name))
            elif code == b"R":
                args = s.pop()
                if not isinstance(args, tuple):
                    raise _Refused("it is not a pickle of a state dict")
                s[-1] = _call(s[-1], args)
            elif code == b"b":  # BUILD
                state = s.pop()
                target = s[-1]
                if not isinstance(target, _Pending) or target.value is not None:
                    raise _Refused("it sets the state of something other than a new array")
                target.value = _dtype(target.code, state) if target.kind == "dtype" else _array(state)
                s[-1] = target.value
            elif code in (b"q", b"r", b"p", b"\x94"):  # BINPUT, LONG_BINPUT, PUT, MEMOIZE
                key = (self.number("<B") if code == b"q" else self.number("<I") if code == b"r"
                       else int(self.line()) if code == b"p" else len(self.memo))
                self.memo[key] = s[-1]
            elif code in (b"h", b"j", b"g"):  # BINGET, LONG_BINGET, GET
                key = self.number("<B") if code == b"h" else self.number("<I") if code == b"j" else int(self.line())
                if key not in self.memo:
                    raise _Refused("it refers to an object it never stored")
                value = self.memo[key]
                s.append(value.value if isinstance(value, _Pending) and value.value is not None else value)
            else:
                raise _Refused(f"it uses pickle opcode {code!r}, which a state dict of tensors never needs")


def load_pdparams(path) -> dict[str, np.ndarray]:
    """The tensors of a ``.pdparams`` file as NumPy arrays (bfloat16 widened to float32)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            state = _Reader(f).read()
    except _Refused as err:
        raise CheckpointError(f"refusing to read {path}: {err}") from None
    except (IndexError, UnicodeDecodeError, ValueError, TypeError):  # an empty stack, bad text, a bad dtype code
        raise CheckpointError(f"refusing to read {path}: it is not a pickle of a state dict") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"refusing to read {path}: it holds a {type(state).__name__}, not a state dict")
    tensors = {}
    for key, value in state.items():
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], np.ndarray | _Pending):
            value = value[1]  # (name, array), how paddle.save writes a bare tensor
        if isinstance(value, _Pending):
            raise CheckpointError(f"refusing to read {path}: its '{key}' is an array without its data")
        if not isinstance(value, np.ndarray):
            continue  # bookkeeping such as 'StructuredToParameterName@@'
        if not value.dtype.isnative:
            value = value.astype(value.dtype.newbyteorder("="))
        if value.dtype == np.uint16:  # bfloat16 bit patterns
            value = (value.astype(np.uint32) << 16).view(np.float32)
        tensors[str(key)] = value
    return tensors
