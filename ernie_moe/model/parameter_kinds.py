"""What a parameter is, read from its stable name: the one place that knows the names' shapes.

Stable names are the checkpoint keys of PaddleFormers' ERNIE 4.5 (VL) models, whatever the layout:
``model.layers.3.mlp.experts.5.up_gate_proj.weight``, ``model.layers.3.mlp.gate.weight_1`` (the vision router),
``vision_model.blocks.0.attn.qkv.weight``, ``model.resampler_model.spatial_linear.0.weight``. Optimizer groups,
checkpoints, LoRA targets, frozen parts, learning-rate ratios and folder checks all ask here.
"""

from __future__ import annotations

import re

VISION = "vision_model."  # the ViT
ADAPTER = "model.resampler_model."  # the adapter between the ViT and the decoder
PATCH_EMBEDDING = VISION + "patch_embed."
EMBEDDING, FINAL_NORM, HEAD = "model.embed_tokens.", "model.norm.", "lm_head."
MTP = "model.mtp_"  # multi-token prediction: mtp_block.{k}, mtp_emb_norm.{k}, mtp_hidden_norm.{k}, mtp_linear_proj.{k}
DECODER_LAYER = re.compile(r"model\.layers\.(\d+)\.")
VIT_BLOCK = re.compile(r"vision_model\.blocks\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")
_ROUTER = re.compile(r"\.mlp\.gate\.weight(_\d+)?$")
_ROUTED_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.)experts\.\d+\.(.*)$")


def is_expert(name: str) -> bool:
    """A routed expert's parameter or layer (``...mlp.experts.<id>...``), local or stable name."""
    return ".mlp.experts." in name


def expert_id(name: str) -> int | None:
    """The routed expert a name belongs to, or None."""
    found = _EXPERT.search(name)
    return int(found.group(1)) if found else None


def expert_slot(name: str) -> tuple[str, str] | None:
    """(``model.layers.<i>.mlp.``, the rest after ``experts.<id>.``) for a routed expert's parameter, else None:
    where a dense MLP's weight would stand for it."""
    found = _ROUTED_EXPERT.match(name)
    return (found.group(1), found.group(2)) if found else None


def is_router(name: str) -> bool:
    """A router weight (``...mlp.gate.weight``, the vision router ``...mlp.gate.weight_1``)."""
    return bool(_ROUTER.search(name))


def is_router_bias(name: str) -> bool:
    """The aux-loss-free balancing bias of a router."""
    return name.endswith("e_score_correction_bias")


def is_vision(name: str) -> bool:
    """A parameter of the ViT or the adapter (stable name)."""
    return name.startswith((VISION, ADAPTER))


def vit_block(name: str) -> int | None:
    """The ViT block a name belongs to, or None."""
    found = VIT_BLOCK.match(name)
    return int(found.group(1)) if found else None


# The parts ``training.freeze`` names (ERNIEKit's freeze_vision / freeze_lm).
PARTS = {
    "vision": lambda n: n.startswith(VISION),
    "adapter": lambda n: n.startswith(ADAPTER),
    "lm": lambda n: n.startswith(("model.layers.", EMBEDDING, FINAL_NORM, HEAD)),
    "embedding": lambda n: n.startswith(EMBEDDING),
    "head": lambda n: n.startswith(HEAD),
    "router": lambda n: is_router(n) or is_router_bias(n),
    "mtp": lambda n: n.startswith(MTP),
}

# LoRA target groups by role, each a regular expression matched in full against a layer's stable name; the
# text and vision expert groups are told apart by expert number (:func:`expert_id`).
_LM = r"model\.layers\.\d+\."
LORA_TARGETS = {
    "attention": _LM + r"self_attn\.(qkv_proj|o_proj)",
    "mlp": _LM + r"mlp\.(up_gate_proj|down_proj)",
    "shared_experts": _LM + r"mlp\.shared_experts\.(up_gate_proj|down_proj)",
    "text_experts": _LM + r"mlp\.experts\.\d+\.(up_gate_proj|down_proj)",
    "vision_experts": _LM + r"mlp\.experts\.\d+\.(up_gate_proj|down_proj)",
    "vit": re.escape(VISION) + ".*",
    "adapter": re.escape(ADAPTER) + ".*",
    "mtp": re.escape(MTP) + r"(block\.\d+\.(self_attn\.(qkv_proj|o_proj)|mlp\.(up_gate_proj|down_proj))"
                            r"|linear_proj\.\d+)",
}

# The linear layers ``training.quantize_base`` holds in low precision: the language model's attention, dense MLP,
# shared and routed experts (the ViT, adapter, routers, embedding and head stay as they are); the LoRA groups'
# patterns, of which text_experts covers the vision experts too (the groups differ by expert number only)
BASE_LINEAR = re.compile("|".join(f"(?:{LORA_TARGETS[group]})"
                                  for group in ("attention", "mlp", "shared_experts", "text_experts")))
