"""Activation recompute through fleet's ``recompute``, chosen per decoder layer.

Granularities (what is dropped after the forward pass and computed again in the backward pass):
``full`` the whole decoder layer, ``full_attn`` the attention block (norm + attention), ``core_attn`` the
softmax(q k^T) v core, ``moe`` the MoE block (router, dispatch, experts, shared experts). With ``full`` and
``full_attn`` each ViT block recomputes too (its attention over an image's patches is the largest activation of
a high-resolution image).
"""

from __future__ import annotations

import contextlib

from paddle.distributed.fleet.utils import recompute

GRANULARITIES = ("full", "full_attn", "core_attn", "moe")
_replaying = False


def replaying() -> bool:
    """True while a recomputed forward runs again in the backward pass: statistics must not count it twice."""
    return _replaying


@contextlib.contextmanager
def _replay(active: bool):
    global _replaying
    previous, _replaying = _replaying, active
    try:
        yield
    finally:
        _replaying = previous


def recomputed(function, *args, use_reentrant: bool = True):
    """``function(*args)`` whose activations are recomputed in backward (the RNG state is restored by fleet)."""
    calls = []

    def run(*inputs):
        calls.append(None)
        with _replay(len(calls) > 1):
            return function(*inputs)

    return recompute(run, *args, use_reentrant=use_reentrant)


def selected_layers(layers: int | list[int], num_layers: int) -> set[int]:
    """``recompute_layers``: 0 = every layer, N = the first N, a list = those layers."""
    if isinstance(layers, list):
        return set(layers)
    return set(range(layers if layers > 0 else num_layers))


def configure_recompute(decoder_layers, training_cfg, num_layers: int, vision_models=()) -> None:
    """Mark the decoder layers (of this pipeline stage) that recompute, and what; and the ViT blocks."""
    chosen = selected_layers(training_cfg.recompute_layers, num_layers) if training_cfg.recompute else set()
    for vision in vision_models:
        vision.recompute_blocks = training_cfg.recompute and training_cfg.recompute_granularity in ("full",
                                                                                                   "full_attn")
        vision.recompute_use_reentrant = training_cfg.recompute_use_reentrant
    for layer in decoder_layers:
        on = layer.layer_idx in chosen
        layer.recompute = training_cfg.recompute_granularity if on else None
        layer.recompute_use_reentrant = training_cfg.recompute_use_reentrant
        layer.self_attn.recompute_core = on and training_cfg.recompute_granularity == "core_attn"
        layer.self_attn.recompute_use_reentrant = training_cfg.recompute_use_reentrant
