"""How a parameter split over tensor-parallel ranks is made, sliced from the whole tensor, and put back together.

A split parameter carries ``is_distributed``, ``split_axis`` and ``segments`` (the fused pieces, such as q/k/v or
gate/up, each split evenly), which is how fleet marks them; ``full_shape``, ``tp_rank`` and ``tp_size`` say which
slice it holds. Initialisation, checkpoints, LoRA and the exporter read them through these functions.
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.distributed as dist
from paddle import nn


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
    param.is_distributed, param.split_axis, param.segments = True, axis, list(segments)
    param.full_shape, param.tp_rank, param.tp_size = list(shape), group.rank, group.nranks
    param.init_rule = ("normal", std)
    return param


def shard_of(param, full: np.ndarray) -> np.ndarray:
    """This rank's slice of ``full`` for ``param`` (``full`` itself for a parameter that is not split)."""
    if not getattr(param, "is_distributed", False) or list(full.shape) != param.full_shape:
        return full
    return np.take(full, shard_index(param.segments, param.tp_rank, param.tp_size), axis=param.split_axis)


def full_tensor(param: paddle.Tensor, group, value: paddle.Tensor | None = None) -> paddle.Tensor:
    """The unsplit tensor of a tensor-parallel parameter, or of ``value`` split like it (an optimizer moment):
    a collective over ``group``."""
    value = param if value is None else value
    if not getattr(param, "is_distributed", False) or group is None or value.shape != param.shape:
        return value
    pieces: list[paddle.Tensor] = []
    dist.all_gather(pieces, value.detach(), group=group)
    axis = param.split_axis
    chunks = [paddle.split(p, [n // group.nranks for n in param.segments], axis=axis) for p in pieces]
    return paddle.concat([chunks[r][s] for s in range(len(param.segments)) for r in range(group.nranks)], axis=axis)
