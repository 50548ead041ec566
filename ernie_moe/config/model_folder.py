"""The ``model`` section that describes a model folder (PaddleFormers' / Hugging Face ``config.json`` of an
ERNIE 4.5 model, transformers' ERNIE-4.5-VL, or this package's own output): the architecture of a run started
from a checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..json_files import read_json_object
from .errors import ConfigError
from .kinds import fits
from .transformers_form import from_transformers, is_transformers_form

_SAME_NAME = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "max_position_embeddings", "rope_theta", "rms_norm_eps", "tie_word_embeddings", "initializer_range",
              "moe_k", "moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval",
              "moe_num_shared_experts", "moe_capacity", "moe_norm_gate_logits", "moe_use_hard_gate",
              "moe_use_aux_free", "moe_aux_loss_lambda", "moe_z_loss_lambda", "moe_orthogonal_loss_lambda",
              "global_aux_loss", "rope_3d", "freq_allocation", "im_patch_id", "spatial_conv_size",
              "temporal_conv_size", "pixel_hidden_size", "num_nextn_predict_layers", "multi_token_pred_lambda")
_VISION_KEYS = ("depth", "embed_dim", "num_heads", "mlp_ratio", "patch_size", "spatial_merge_size", "in_channels",
                "hidden_act")


_TUNING = frozenset({"moe_capacity", "moe_aux_loss_lambda", "moe_z_loss_lambda", "moe_orthogonal_loss_lambda",
                     "global_aux_loss", "multi_token_pred_lambda", "num_nextn_predict_layers", "initializer_range",
                     "max_position_embeddings"})
_GROWN = frozenset({"moe_num_experts", "moe_intermediate_size", "moe_layer_start_index", "moe_layer_end_index",
                    "moe_layer_interval", "moe_num_shared_experts", "moe_k", "moe_use_aux_free"})


def tuning_keys() -> frozenset[str]:
    """The ``model`` keys that are a run's choices over a model folder's (from the config file too): how its
    routers are trained and held to capacity, the MTP depths it trains (new depths start as
    ``training.mtp_init`` says), the longest row it accepts."""
    return _TUNING


def grown_keys() -> frozenset[str]:
    """The ``model`` keys a run may change on the command line, from what a model folder gives: its expert
    layout, which the loader grows (a dense model upcycled into experts, a text MoE given vision experts). The
    folder's other keys are its architecture and its inputs' encoding, which only the folder sets."""
    return _GROWN


def model_config_from(directory) -> dict:
    """The ``model`` section (this package's keys) that describes the checkpoint in ``directory``."""
    config_file = Path(directory) / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"'{directory}' has no config.json: not a model folder.")
    source = read_json_object(config_file, ConfigError)
    if is_transformers_form(source):
        try:
            source = from_transformers(source)
        except ValueError as err:
            raise ConfigError(f"{config_file}: {err}") from None
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads") if k not in source]
    if missing:
        raise ConfigError(f"{config_file} lacks {', '.join(missing)}: not an ERNIE 4.5 model config.")
    for key in ("hidden_size", "num_attention_heads"):  # the head width is derived from them here
        if not fits(source[key], int)[0] or source[key] < 1:
            raise ConfigError(f"{config_file}: {key} must be a positive whole number, not {source[key]!r}.")
    if source.get("use_bias"):
        raise ConfigError(f"{directory}: use_bias=true (biases in attention and MLP) is not supported.")
    if source.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{directory}: hidden_act {source['hidden_act']!r} is not supported (only silu).")
    out = {key: source[key] for key in _SAME_NAME if source.get(key) is not None}
    if source.get("mtp_loss_scaling_factor") is not None:  # PaddleFormers' name of the MTP loss weight
        out.setdefault("multi_token_pred_lambda", source["mtp_loss_scaling_factor"])
    heads = source["num_attention_heads"]
    out["num_key_value_heads"] = source.get("num_key_value_heads") or heads
    out["head_dim"] = source.get("head_dim") or source["hidden_size"] // heads
    experts = [n for n in _numbers(source, "moe_num_experts", config_file) if n]
    width_key = "moe_intermediate_size" if source.get("moe_intermediate_size") else "intermediate_size"
    widths = _numbers(source, width_key, config_file)
    widths = (widths * len(experts) if fits(source.get(width_key), int)[0] else widths)[: len(experts)]
    out.update(moe_num_experts=experts, moe_intermediate_size=widths if experts else [])
    gate_act = source.get("moe_gate_act") or source.get("scoring_func")
    if gate_act:
        out["moe_gate_act"] = gate_act
    out.setdefault("rope_3d", False)
    if source.get("model_type") == "ernie4_5_moe":
        out.setdefault("moe_use_aux_free", True)  # PaddleFormers' default for the text MoE model
    if isinstance(source.get("vision_config"), dict):
        vision = source["vision_config"]
        out["vision_config"] = {key: vision[key] for key in _VISION_KEYS if vision.get(key) is not None}
    return out


def _numbers(source: dict, key: str, config_file: Path) -> list[int]:
    """``key``'s whole number, or list of them, as a list (absent or 0: an empty list)."""
    value: Any = source.get(key) or []
    if fits(value, int)[0]:
        return [int(value)]
    if not fits(value, list[int])[0]:
        raise ConfigError(f"{config_file}: {key} must be a whole number or a list of them, not {value!r}.")
    return [int(v) for v in value]
