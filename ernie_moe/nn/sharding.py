"""How a parameter split over tensor-parallel ranks is made, sliced from the whole tensor, and put back together.

A split parameter's record (``param_spec.ParamSpec``) holds its :class:`~.param_spec.TensorSplit`: the axis, the
fused pieces (q/k/v, gate/up) each split evenly, the whole shape and which slice this rank holds.
Initialisation, checkpoints, LoRA and the exporter read it through these functions.
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.distributed as dist
from paddle import nn

from .param_spec import TensorSplit, describe, spec_of


def shard_index(segments: list[int], rank: int, size: int) -> np.ndarray:
    """Indices of rank's share: every segment is split evenly and the pieces are kept in segment order."""
    index, start = [], 0
    for n in segments:
        per = n // size
        index.append(np.arange(start + rank * per, start + (rank + 1) * per))
        start += n
    return np.concatenate(index)


def sharded_parameter(layer: nn.Layer, shape: list[int], axis: int, segments: list[int], group,
                      std: float) -> paddle.Tensor:
    """This rank's slice of a ``shape`` tensor, drawn later by name (``nn.init``) from the whole tensor."""
    local = list(shape)
    local[axis] = shape[axis] // group.nranks
    param = layer.create_parameter(local, default_initializer=nn.initializer.Constant(0.0))
    split = TensorSplit(axis, tuple(segments), tuple(shape), group.rank, group.nranks)
    return describe(param, split=split, init=("normal", std))


def shard_of(param, full: np.ndarray) -> np.ndarray:
    """This rank's slice of ``full`` for ``param`` (``full`` itself for a parameter that is not split)."""
    split = spec_of(param).split
    if split is None or tuple(full.shape) != split.full_shape:
        return full
    return np.take(full, shard_index(list(split.segments), split.rank, split.size), axis=split.axis)


def full_tensor(param: paddle.Tensor, group, value: paddle.Tensor | None = None) -> paddle.Tensor:
    """The unsplit tensor of a tensor-parallel parameter, or of ``value`` split like it (an optimizer moment):
    a collective over ``group``."""
    value, split = param if value is None else value, spec_of(param).split
    if split is None or group is None or value.shape != param.shape:
        return value
    pieces: list[paddle.Tensor] = []
    dist.all_gather(pieces, value.detach(), group=group)
    chunks = [paddle.split(p, [n // group.nranks for n in split.segments], axis=split.axis) for p in pieces]
    return paddle.concat([chunks[r][s] for s in range(len(split.segments)) for r in range(group.nranks)],
                         axis=split.axis)
