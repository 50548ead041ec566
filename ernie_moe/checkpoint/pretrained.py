"""Starting a run from a published ERNIE 4.5 checkpoint (``training.model_name_or_path``).

The folder's ``config.json`` gives the model's shape (:func:`model_config_from`); keys set in the run's
``model`` section override it, which is how a dense or text-only source grows experts or a vision side.
:func:`load_pretrained` then fills every parameter it can and says what it did with each:

- loaded: the same tensor under the same name;
- converted: transposed from the Hugging Face layout, q/k/v or gate/up fused, rows of a correction bias;
- upcycled: a routed expert copied from the dense MLP of the same layer (sparse upcycling);
- new: nothing in the source for it (routers of upcycled layers, shared experts, the vision side of a
  text model), so it keeps its seeded initial value;
- ignored: tensors of the source this model has no place for (multi-token-prediction blocks, a tied head).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import numpy as np
import paddle

from ..parallel.tensor_parallel import shard_of
from .formats import CheckpointError, SourceCheckpoint

_SAME_NAME = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "max_position_embeddings", "rope_theta", "rms_norm_eps", "tie_word_embeddings", "initializer_range",
              "moe_k", "moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval",
              "moe_num_shared_experts", "moe_capacity", "moe_norm_gate_logits", "moe_use_hard_gate",
              "moe_use_aux_free", "moe_aux_loss_lambda", "moe_z_loss_lambda", "moe_orthogonal_loss_lambda",
              "global_aux_loss", "rope_3d", "freq_allocation", "im_patch_id", "spatial_conv_size",
              "temporal_conv_size", "pixel_hidden_size")
_VISION_KEYS = ("depth", "embed_dim", "num_heads", "mlp_ratio", "patch_size", "spatial_merge_size", "in_channels",
                "hidden_act")


def model_config_from(directory) -> dict:
    """The ``model`` section (this package's keys) that describes the checkpoint in ``directory``."""
    config_file = Path(directory) / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"'{directory}' has no config.json: not a model folder.")
    try:
        source = json.loads(config_file.read_text())
    except ValueError as err:
        raise CheckpointError(f"cannot read {config_file}: {err}") from err
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads") if k not in source]
    if missing:
        raise CheckpointError(f"{config_file} lacks {', '.join(missing)}: not an ERNIE 4.5 model config.")
    if source.get("use_bias"):
        raise CheckpointError(f"{directory}: use_bias=true (biases in attention and MLP) is not supported.")
    if source.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{directory}: hidden_act {source['hidden_act']!r} is not supported (only silu).")
    out = {key: source[key] for key in _SAME_NAME if source.get(key) is not None}
    heads = source["num_attention_heads"]
    out["num_key_value_heads"] = source.get("num_key_value_heads") or heads
    out["head_dim"] = source.get("head_dim") or source["hidden_size"] // heads
    experts = source.get("moe_num_experts") or 0
    experts = [experts] if isinstance(experts, int) else list(experts)
    experts = [n for n in experts if n] if any(experts) else []
    widths = source.get("moe_intermediate_size") or source.get("intermediate_size")
    widths = [widths] * len(experts) if isinstance(widths, int) else list(widths)[: len(experts)]
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


def load_pretrained(model, directory, env=None) -> dict:
    """Fill this rank's parameters from ``directory``; returns the report (all ranks' names, on every rank)."""
    source = SourceCheckpoint(directory)
    report = defaultdict(list)
    named = model.stable_named_parameters(include_tied_copy=True)
    for stable, param in named:
        full_shape = list(param.full_shape) if getattr(param, "is_distributed", False) else list(param.shape)
        value, how = _source_tensor(source, stable, full_shape)
        if value is None:
            report["new"].append(stable)
            continue
        if list(value.shape) != full_shape:
            raise CheckpointError(f"tensor '{stable}' from {directory} has shape {list(value.shape)}; this model "
                                  f"expects {full_shape} (check the model section of the config against "
                                  f"{directory}/config.json)")
        param.set_value(paddle.to_tensor(np.ascontiguousarray(shard_of(param, value))).astype(param.dtype))
        report[how].append(stable)
    report["read"] = sorted(source.used)
    if env is not None and env.world_size > 1:  # each rank filled its own parameters
        gathered = env.all_gather_object(dict(report))
        report = defaultdict(list)
        for part in gathered:
            for key, names in part.items():
                report[key].extend(names)
    result = {key: sorted(set(report[key])) for key in ("loaded", "converted", "upcycled", "new")}
    result["ignored"] = sorted(set(source.names()) - set(report["read"]))
    result.update(source=str(directory), model_type=source.model_type, form=source.form)
    return result


def _source_tensor(source: SourceCheckpoint, stable: str, full_shape: list[int]):
    """(Paddle-layout tensor for ``stable``, how it was obtained), or (None, 'new')."""
    value, converted = source.paddle_tensor(stable)
    if value is not None:
        if stable == "lm_head.weight" and list(value.shape) != full_shape and list(value.T.shape) == full_shape:
            value, converted = np.ascontiguousarray(value.T), True  # text models keep a [vocab, hidden] head
        rows = full_shape[0] - value.shape[0] if value.ndim == 2 else 0
        if stable.endswith("e_score_correction_bias") and rows > 0 and value.shape[1] == full_shape[1]:
            # a text model's [1, experts] bias: the vision row starts at zero
            value, converted = np.concatenate([value, np.zeros([rows, value.shape[1]], value.dtype)]), True
        return value, "converted" if converted else "loaded"
    match = re.match(r"(model\.layers\.\d+\.mlp\.)experts\.\d+\.(.*)$", stable)
    if match and not any(n.startswith(match.group(1) + "experts.") for n in source.names()):
        dense_name = match.group(1) + match.group(2)
        dense, _ = source.paddle_tensor(dense_name)
        if dense is not None:
            if list(dense.shape) != full_shape:
                raise CheckpointError(
                    f"cannot upcycle {dense_name} {list(dense.shape)} into {stable} {full_shape}: an expert copied "
                    "from the dense MLP needs its width (set model.moe_intermediate_size to the source's "
                    "intermediate_size)")
            return dense, "upcycled"
    return None, "new"


def format_report(report: dict, limit: int = 6) -> str:
    """A few lines for the log: a count per kind and the names, layer and expert numbers folded."""
    lines = [f"initialised from {report['source']} ({report['model_type']}, {report['form']}):"]
    for kind in ("loaded", "converted", "upcycled", "new", "ignored"):
        names = report[kind]
        if not names:
            continue
        folded = sorted({re.sub(r"\.(layers|experts|blocks|mtp_block)\.\d+\.", r".\1.*.", n) for n in names})
        shown = ", ".join(folded[:limit]) + (f", ... ({len(folded) - limit} more)" if len(folded) > limit else "")
        lines.append(f"  {kind:9s} {len(names):5d}  {shown}")
    return "\n".join(lines)
