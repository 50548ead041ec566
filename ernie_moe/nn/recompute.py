"""Where a forward pass runs under recompute: the state that layers and kernels below the model read, the
recompute call that sets it (fleet's ``recompute``, which restores the RNG state for the second run), and
:class:`Recomputable`, the layers whose pieces may run through it.

:func:`ernie_moe.model.recompute.apply_recompute` chooses which pieces of a model run through it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import NamedTuple

import paddle
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


class Recomputable:
    """Mixed into a layer whose methods may be recomputed: the layer calls them through :meth:`piece`, which
    runs one chosen by :meth:`set_recompute` through :func:`recomputed` while the layer trains, plainly
    otherwise (evaluation, generation)."""

    def set_recompute(self, method: str, use_reentrant: bool | None) -> None:
        """Recompute ``method`` with fleet's reentrant form or not; None: run it plainly."""
        chosen = {**getattr(self, "_recomputed", {}), method: use_reentrant}
        self._recomputed = {name: how for name, how in chosen.items() if how is not None}

    def recomputes(self, method: str) -> bool:
        return method in getattr(self, "_recomputed", {})

    def piece(self, method: str, *args, **kwargs):
        """``self.<method>(*args, **kwargs)``, recomputed if chosen. Keyword arguments are bound, not passed to
        recompute, which takes tensors and plain values."""
        plain = getattr(self, method)
        use_reentrant = getattr(self, "_recomputed", {}).get(method)
        if use_reentrant is None or not getattr(self, "training", False):  # nn.Layer's flag, beside this mixin
            return plain(*args, **kwargs)
        return recomputed(functools.partial(plain, **kwargs), *_taking_gradient(args, self),
                          use_reentrant=use_reentrant)


def _taking_gradient(args: tuple, layer) -> tuple:
    """fleet's recompute gives its outputs a gradient only when an input has one. Where no input needs one
    (everything before the block frozen, as under LoRA) but the block trains, its first float input takes one."""
    tensors = [a for a in args if isinstance(a, paddle.Tensor)]
    if any(not t.stop_gradient for t in tensors) or all(p.stop_gradient for p in layer.parameters()):
        return args
    given = list(args)
    for i, a in enumerate(given):
        if isinstance(a, paddle.Tensor) and a.dtype in (paddle.float32, paddle.bfloat16, paddle.float16):
            given[i] = a.detach()
            given[i].stop_gradient = False
            break
    return tuple(given)
