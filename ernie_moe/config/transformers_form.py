"""Hugging Face transformers' ERNIE-4.5-VL ``config.json`` (``model_type: ernie4_5_vl_moe``) and PaddleFormers'.

transformers nests the decoder under ``text_config`` and the ViT under ``vision_config``, gives one expert count
for both modalities, lists each layer's MLP as ``dense`` or ``sparse`` and keeps the 3D rotary split as
``rope_parameters.mrope_section`` = [h, w, t] frequency slots. Its tensors are those of PaddleFormers'
``save_pretrained`` (it renames them as it loads and back as it saves), so two folders of one model differ in
``config.json`` alone. What transformers cannot express (other expert counts per modality, another router, a
layer that is MoE for one modality only) is a ValueError naming it.
"""

from __future__ import annotations

from ..config.schema import ModelConfig

TRANSFORMERS_VL = "ernie4_5_vl_moe"
PUBLISHED_VIDEO_TOKEN_ID = 103367  # the published models' video placeholder (transformers' default)
_TOKEN_IDS = ("image_start_token_id", "image_end_token_id", "video_start_token_id", "video_end_token_id",
              "video_token_id")
_SAME_TEXT = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "moe_k",
              "moe_num_shared_experts", "use_bias", "hidden_act", "bos_token_id", "eos_token_id", "pad_token_id")


def is_transformers_form(config: dict) -> bool:
    return isinstance(config, dict) and config.get("model_type") == TRANSFORMERS_VL


def from_transformers(config: dict) -> dict:
    """A transformers ERNIE-4.5-VL config.json as the PaddleFormers-form keys this package reads (``torch_dtype``
    marks the Hugging Face tensor layout)."""
    text, vision = config.get("text_config"), config.get("vision_config")
    if not isinstance(text, dict) or not isinstance(vision, dict):
        raise ValueError("a transformers ERNIE-4.5-VL config needs text_config and vision_config objects")
    out = {key: text[key] for key in _SAME_TEXT if text.get(key) is not None}
    out.update(model_type="ernie4_5_moe_vl", torch_dtype=config.get("dtype") or config.get("torch_dtype") or "float32",
               tie_word_embeddings=bool(config.get("tie_word_embeddings", True)), rope_3d=True,
               moe_use_hard_gate=True, moe_use_aux_free=True, moe_gate_act="softmax", moe_norm_gate_logits=True,
               im_patch_id=config.get("image_token_id"))
    rope = text.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"text_config.rope_parameters must be an object, not {rope!r}")
    if rope.get("rope_theta") is not None:
        out["rope_theta"] = rope["rope_theta"]
    section = rope.get("mrope_section")
    if section is not None:
        if not (isinstance(section, list) and len(section) == 3 and section[0] == section[1]):
            raise ValueError(f"rope_parameters.mrope_section {section!r}: this package's 3D rotary embedding "
                             "alternates h and w, so it needs [n, n, t]")
        out["freq_allocation"] = section[2]
    sparse = [i for i, kind in enumerate(text.get("mlp_layer_types") or []) if kind == "sparse"]
    if sparse:
        count, widths = text.get("moe_num_experts"), text.get("moe_intermediate_size")
        out.update(moe_num_experts=[count, count], moe_intermediate_size=widths,
                   moe_layer_start_index=sparse[0], moe_layer_end_index=sparse[-1],
                   moe_layer_interval=_interval(sparse))
    else:
        out["moe_num_experts"] = []
    width, heads = vision.get("hidden_size"), vision.get("num_heads")
    out["vision_config"] = {"depth": vision.get("depth"), "embed_dim": width, "num_heads": heads,
                            "patch_size": vision.get("patch_size"), "in_channels": vision.get("in_channels", 3),
                            "spatial_merge_size": vision.get("spatial_merge_size"),
                            "hidden_act": vision.get("hidden_act", "quick_gelu")}
    if isinstance(width, int) and width and isinstance(vision.get("intermediate_size"), int):
        out["vision_config"]["mlp_ratio"] = vision["intermediate_size"] / width
    out.update(pixel_hidden_size=width, spatial_conv_size=vision.get("spatial_merge_size"),
               temporal_conv_size=vision.get("temporal_merge_size", 2))
    out.update({key: config[key] for key in _TOKEN_IDS if key in config})  # kept for a conversion back
    return {k: v for k, v in out.items() if v is not None}


def _interval(sparse: list[int]) -> int:
    """The interval whose MoE layers between the first and last sparse layer are exactly ``sparse``: the one gap
    between them, when the first is a multiple of it (one pass, however long the list a config.json holds)."""
    gaps = {b - a for a, b in zip(sparse, sparse[1:])}
    interval = gaps.pop() if len(gaps) == 1 else 1 if not gaps else 0
    if not interval or (sparse[0] + 1) % interval:
        raise ValueError(f"mlp_layer_types puts MoE layers at {sparse[:8]}{' ...' if len(sparse) > 8 else ''}, "
                         "which no (start, end, interval) describes")
    return interval


def to_transformers(model_cfg: ModelConfig, special_ids: dict[str, int], source: dict | None = None) -> dict:
    """The transformers config.json of this package's model. ``special_ids``: the tokenizer's ids of
    ``bos/eos/pad`` and the image / video start, end and placeholder tokens it has; ``source``: the config.json
    of the folder converted, whose own token ids are kept where the tokenizer has none."""
    m = model_cfg
    experts, widths = list(m.moe_num_experts), list(m.moe_intermediate_size)
    problems = []
    if experts and (len(experts) != 2 or experts[0] != experts[1]):
        problems.append(f"moe_num_experts {experts} (transformers has one expert count for text and vision)")
    if experts and not m.moe_use_hard_gate:
        problems.append("moe_use_hard_gate false (transformers routes each modality to its own experts)")
    if m.moe_gate_act != "softmax" or not m.moe_norm_gate_logits:
        problems.append(f"moe_gate_act {m.moe_gate_act!r} with moe_norm_gate_logits {m.moe_norm_gate_logits} "
                        "(transformers' router is a softmax with renormalised top-k weights)")
    if not m.rope_3d:
        problems.append("rope_3d false (transformers' text model uses the 3D rotary embedding)")
    layers = [_layer_kind(m, i) for i in range(m.num_hidden_layers)]
    if "mixed" in layers:
        problems.append(f"MoE layer ranges that differ between text and vision ({m.moe_layer_start_index} to "
                        f"{m.moe_layer_end_index})")
    if problems:
        raise ValueError("transformers' ERNIE-4.5-VL cannot express " + "; ".join(problems))
    source = source or {}
    half = m.head_dim // 2
    text = {"model_type": "ernie4_5_vl_moe_text", "vocab_size": m.vocab_size, "hidden_size": m.hidden_size,
            "intermediate_size": m.intermediate_size, "num_hidden_layers": m.num_hidden_layers,
            "num_attention_heads": m.num_attention_heads, "num_key_value_heads": m.num_key_value_heads,
            "head_dim": m.head_dim, "max_position_embeddings": m.max_position_embeddings,
            "rms_norm_eps": m.rms_norm_eps, "hidden_act": "silu", "use_bias": False, "use_cache": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta,
                                "mrope_section": [(half - m.freq_allocation) // 2] * 2 + [m.freq_allocation]},
            "mlp_layer_types": layers, "moe_num_experts": experts[0] if experts else 0,
            "moe_intermediate_size": widths or [m.intermediate_size, m.intermediate_size], "moe_k": m.moe_k,
            "moe_num_shared_experts": m.moe_num_shared_experts, "moe_norm_min": 1e-12,
            "router_aux_loss_coef": m.moe_aux_loss_lambda}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        text[key] = special_ids.get(key, source.get(key))
    v = m.vision_config
    vision = {"model_type": "ernie4_5_vl_moe_vision", "depth": v.depth, "hidden_size": v.embed_dim,
              "intermediate_size": int(v.embed_dim * v.mlp_ratio), "num_heads": v.num_heads,
              "in_channels": v.in_channels, "patch_size": v.patch_size, "spatial_merge_size": v.spatial_merge_size,
              "temporal_merge_size": m.temporal_conv_size, "hidden_act": v.hidden_act, "rms_norm_eps": 1e-6}
    out = {"model_type": TRANSFORMERS_VL, "architectures": ["Ernie4_5_VLMoeForConditionalGeneration"],
           "dtype": "float32", "tie_word_embeddings": m.tie_word_embeddings, "text_config": text,
           "vision_config": vision, "image_token_id": m.im_patch_id}
    for key in _TOKEN_IDS:
        value = special_ids.get(key, source.get(key))
        if value is not None:
            out[key] = value
    if "video_token_id" not in out:
        # a vocabulary without a video placeholder: this package marks a video's tokens with the image placeholder
        # (their token type tells them apart); transformers' own default lies outside such a vocabulary
        out["video_token_id"] = PUBLISHED_VIDEO_TOKEN_ID if PUBLISHED_VIDEO_TOKEN_ID < m.vocab_size else m.im_patch_id
    return out


def _layer_kind(m, i: int) -> str:
    """``sparse`` when layer i is an MoE layer for both modalities, ``dense`` for neither, ``mixed`` otherwise."""
    present = len(m.moe_modalities_at(i)) if m.moe_num_experts else 0
    return "dense" if present == 0 else ("sparse" if present == m.num_modalities else "mixed")


def special_ids(tokenizer) -> dict[str, int]:
    """The ids of the tokenizer's special tokens that transformers' config names (those it has)."""
    if tokenizer is None:
        return {}
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
    for key, token in (("image_start_token_id", "<|IMAGE_START|>"), ("image_end_token_id", "<|IMAGE_END|>"),
                       ("video_start_token_id", "<|VIDEO_START|>"), ("video_end_token_id", "<|VIDEO_END|>"),
                       ("video_token_id", "<|VIDEO_PLACEHOLDER|>")):
        ids[key] = tokenizer.token_id(token)
    return {k: int(v) for k, v in ids.items() if v is not None}
