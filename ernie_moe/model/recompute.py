"""Activation recompute through fleet's ``recompute``, applied to a built model by :func:`apply_recompute`.

Granularities (what is dropped after the forward pass and computed again in the backward pass):
``full`` the whole decoder layer, ``full_attn`` the attention block (norm + attention), ``core_attn`` the
softmax(q k^T) v core, ``moe`` the MoE block (router, dispatch, experts, shared experts). With ``full`` and
``full_attn`` each ViT block recomputes too (its attention over an image's patches is the largest activation of
a high-resolution image).
"""

from __future__ import annotations

GRANULARITIES = ("full", "full_attn", "core_attn", "moe")


def selected_layers(layers: int | list[int], num_layers: int) -> set[int]:
    """``recompute_layers``: 0 = every layer, N = the first N, a list = those layers."""
    if isinstance(layers, list):
        return set(layers)
    return set(range(layers if layers > 0 else num_layers))


def apply_recompute(model, granularity: str | None, layers: int | list[int] = 0, use_reentrant: bool = True) -> None:
    """Make a built model (or pipeline stage) recompute at ``granularity`` (None: nothing) in the chosen decoder
    layers, replacing whatever was applied before; multi-token prediction depth k recomputes as decoder layer k
    does (PaddleFormers builds it as layer k). Only while training: evaluation runs the plain methods."""
    chosen = selected_layers(layers, model.cfg.num_hidden_layers) if granularity else set()
    for layer in model.decoder_layers() + model.mtp_layers():
        on = layer.layer_idx in chosen
        for kind, (owner, method) in _points(layer).items():
            owner.set_recompute(method, use_reentrant if on and kind == granularity else None)
        # what each layer does, for whoever inspects the model
        layer.recompute = granularity if on else None
        layer.self_attn.recompute_core = on and granularity == "core_attn"
    for vision in model.vision_modules():
        for block in getattr(vision, "blocks", []):  # the ViT's blocks; the adapter has none
            block.set_recompute("body", use_reentrant if granularity in ("full", "full_attn") else None)


def _points(layer) -> dict:
    """Granularity -> the (object, method) of a decoder layer whose activations it drops."""
    points = {"full": (layer, "body"), "full_attn": (layer, "attention_block"), "core_attn": (layer.self_attn, "core")}
    if layer.is_moe:
        points["moe"] = (layer, "moe_block")
    return points

