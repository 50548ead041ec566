"""What training needs to know about a parameter beyond its tensor, in one typed record.

Set where the parameter is made or changes role (:func:`describe`), read everywhere through :func:`spec_of`:
initialisation, checkpoints, pretrained loading, LoRA, gradient synchronisation and clipping. fleet's own marks
(``is_distributed`` for a tensor-parallel slice, ``no_sync`` for a parameter its broadcasts and wrappers leave
alone) are kept in step with the record, since fleet reads them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class TensorSplit:
    """This rank's slice of a tensor-parallel parameter: every fused segment (q/k/v, gate/up) of ``full_shape``
    along ``axis`` is split evenly over ``size`` ranks and the pieces are kept in segment order."""

    axis: int
    segments: tuple[int, ...]
    full_shape: tuple[int, ...]
    rank: int
    size: int


@dataclass(frozen=True)
class ParamSpec:
    split: TensorSplit | None = None  # None: the whole tensor on every rank that holds it
    # drawn by stable name (nn.init): ("normal", std), ("xavier_uniform",), ("uniform", bound); None keeps its constant
    init: tuple | None = None
    partial_over_tp: bool = False  # sequence parallelism: each tensor-parallel rank's gradient is a part of it
    local_to_rank: bool = False  # differs between the ranks of a data group (a routed expert split over ranks)


_PLAIN = ParamSpec()


def spec_of(param) -> ParamSpec:
    return getattr(param, "ernie_spec", _PLAIN)


def describe(param, **changes):
    """Change fields of ``param``'s record (and fleet's marks with them); returns the parameter."""
    spec = dataclasses.replace(spec_of(param), **changes)
    param.ernie_spec = spec
    param.is_distributed = spec.split is not None
    param.no_sync = spec.local_to_rank
    return param


def full_shape(param) -> list[int]:
    """The shape of the whole tensor: a tensor-parallel slice's before it was split."""
    split = spec_of(param).split
    return list(split.full_shape) if split is not None else list(param.shape)
