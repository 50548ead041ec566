"""Where a forward pass runs under recompute: the state that layers and kernels below the model read, and the
recompute call that sets it (fleet's ``recompute``, which restores the RNG state for the second run).

:func:`ernie_moe.model.recompute.apply_recompute` chooses which blocks of a model run through it.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import NamedTuple

from paddle.distributed.fleet.utils import recompute


class Pass(NamedTuple):
    replaying: bool = False  # a recomputed forward runs again, in the backward pass
    hooked: bool = False  # fleet's saved-tensor hooks take what autograd saves (a non-reentrant recompute's first pass)


# the pass that the innermost recomputed call is in, set by that call for its own duration
_OUTSIDE = Pass()
_PASS: contextvars.ContextVar[Pass] = contextvars.ContextVar("recompute_pass", default=_OUTSIDE)


def replaying() -> bool:
    """True while a recomputed forward runs again in the backward pass: statistics must not count it twice."""
    return _PASS.get().replaying


def saved_tensors_hooked() -> bool:
    """True during a non-reentrant recompute's first pass, whose hooks take every tensor autograd saves: no
    backward pass of its own can run there."""
    return _PASS.get().hooked


@contextlib.contextmanager
def _in_pass(replaying: bool, hooked: bool):
    token = _PASS.set(Pass(replaying, hooked))
    try:
        yield
    finally:
        _PASS.reset(token)


def recomputed(function, *args, use_reentrant: bool = True):
    """``function(*args)`` whose activations are recomputed in backward (the RNG state is restored by fleet)."""
    calls = []

    def run(*inputs):
        calls.append(None)
        first = len(calls) == 1
        with _in_pass(replaying=not first, hooked=first and not use_reentrant):
            return function(*inputs)

    return recompute(run, *args, use_reentrant=use_reentrant)
