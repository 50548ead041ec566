"""Where a forward pass runs under recompute: the state that layers and kernels below the model read, and the
recompute call that sets it (fleet's ``recompute``, which restores the RNG state for the second run).

:func:`ernie_moe.model.recompute.apply_recompute` chooses which blocks of a model run through it.
"""

from __future__ import annotations

import contextlib

from paddle.distributed.fleet.utils import recompute


class _Pass:
    replaying = False  # a recomputed forward runs again, in the backward pass
    hooked = False  # fleet's saved-tensor hooks take what autograd saves (a non-reentrant recompute's first pass)


def replaying() -> bool:
    """True while a recomputed forward runs again in the backward pass: statistics must not count it twice."""
    return _Pass.replaying


def saved_tensors_hooked() -> bool:
    """True during a non-reentrant recompute's first pass, whose hooks take every tensor autograd saves: no
    backward pass of its own can run there."""
    return _Pass.hooked


@contextlib.contextmanager
def _in_pass(replaying: bool, hooked: bool):
    previous = _Pass.replaying, _Pass.hooked
    _Pass.replaying, _Pass.hooked = replaying, hooked
    try:
        yield
    finally:
        _Pass.replaying, _Pass.hooked = previous


def recomputed(function, *args, use_reentrant: bool = True):
    """``function(*args)`` whose activations are recomputed in backward (the RNG state is restored by fleet)."""
    calls = []

    def run(*inputs):
        calls.append(None)
        first = len(calls) == 1
        with _in_pass(replaying=not first, hooked=first and not use_reentrant):
            return function(*inputs)

    return recompute(run, *args, use_reentrant=use_reentrant)
