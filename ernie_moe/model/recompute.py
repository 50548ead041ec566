"""Activation recompute through fleet's ``recompute``, applied to a built model by :func:`apply_recompute`.

Granularities (what is dropped after the forward pass and computed again in the backward pass):
``full`` the whole decoder layer, ``full_attn`` the attention block (norm + attention), ``core_attn`` the
softmax(q k^T) v core, ``moe`` the MoE block (router, dispatch, experts, shared experts). With ``full`` and
``full_attn`` each ViT block recomputes too (its attention over an image's patches is the largest activation of
a high-resolution image).
"""

from __future__ import annotations

import functools

import paddle

from ..nn.recompute import recomputed

GRANULARITIES = ("full", "full_attn", "core_attn", "moe")


def selected_layers(layers: int | list[int], num_layers: int) -> set[int]:
    """``recompute_layers``: 0 = every layer, N = the first N, a list = those layers."""
    if isinstance(layers, list):
        return set(layers)
    return set(range(layers if layers > 0 else num_layers))


def apply_recompute(model, granularity: str | None, layers: int | list[int] = 0, use_reentrant: bool = True) -> None:
    """Make a built model (or pipeline stage) recompute at ``granularity`` (None: nothing) in the chosen decoder
    layers, replacing whatever was applied before. Only while training: evaluation runs the plain methods."""
    chosen = selected_layers(layers, model.cfg.num_hidden_layers) if granularity else set()
    for layer in model.decoder_layers():
        on = layer.layer_idx in chosen
        for kind, (owner, method) in _points(layer).items():
            _wrap(owner, method, on and kind == granularity, use_reentrant)
        # what each layer does, for whoever inspects the model
        layer.recompute = granularity if on else None
        layer.self_attn.recompute_core = on and granularity == "core_attn"
    for vision in model.vision_modules():
        for block in getattr(vision, "blocks", []):  # the ViT's blocks; the adapter has none
            _wrap(block, "forward", granularity in ("full", "full_attn"), use_reentrant)


def _points(layer) -> dict:
    """Granularity -> the (object, method) of a decoder layer whose activations it drops."""
    points = {"full": (layer, "body"), "full_attn": (layer, "attention_block"), "core_attn": (layer.self_attn, "core")}
    if layer.is_moe:
        points["moe"] = (layer, "moe_block")
    return points


def _wrap(owner, method: str, on: bool, use_reentrant: bool) -> None:
    """Route ``owner.<method>`` through :func:`recomputed` while ``owner`` trains (on), or back to the plain
    method (off). Keyword arguments are bound, not passed to recompute, which takes tensors and plain values."""
    owner.__dict__.pop(method, None)
    if not on:
        return
    plain = getattr(owner, method)

    def run(*args, **kwargs):
        if not owner.training:
            return plain(*args, **kwargs)
        return recomputed(functools.partial(plain, **kwargs), *_taking_gradient(args, owner),
                          use_reentrant=use_reentrant)

    object.__setattr__(owner, method, run)


def _taking_gradient(args: tuple, owner) -> tuple:
    """fleet's recompute gives its outputs a gradient only when an input has one. Where no input needs one
    (everything before the block frozen, as under LoRA) but the block trains, its first float input takes one."""
    tensors = [a for a in args if isinstance(a, paddle.Tensor)]
    if any(not t.stop_gradient for t in tensors) or all(p.stop_gradient for p in owner.parameters()):
        return args
    args = list(args)
    for i, a in enumerate(args):
        if isinstance(a, paddle.Tensor) and a.dtype in (paddle.float32, paddle.bfloat16, paddle.float16):
            args[i] = a.detach()
            args[i].stop_gradient = False
            break
    return tuple(args)
