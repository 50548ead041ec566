"""Writing the model as ``config.json`` + safetensors shards + index, full tensors whatever the layout: in the
Paddle layout (training checkpoints) or the Hugging Face layout PaddleFormers' ``from_pretrained`` reads
(the final model)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import paddle.distributed as dist
from safetensors.numpy import save_file

from ..model.ernie_vl import is_expert
from ..parallel.tensor_parallel import full_tensor
from .formats import VL, to_hf

ARCHITECTURES = {"ernie4_5": "Ernie4_5ForCausalLM", "ernie4_5_moe": "Ernie4_5_MoeForCausalLM",
                 VL: "Ernie4_5_VLMoeForConditionalGeneration"}


def model_config_dict(model_cfg, hf_layout: bool = False, model_type: str = VL, base: dict | None = None) -> dict:
    """ERNIE 4.5 config.json keys (``torch_dtype`` marks the Hugging Face layout), on top of ``base`` (the
    source's config.json when converting, which keeps keys such as the special token ids). The text model
    types describe the decoder alone: ``ernie4_5`` needs a dense model, ``ernie4_5_moe`` one shared expert pool."""
    experts = list(model_cfg.moe_num_experts)
    if model_type == "ernie4_5" and experts:
        raise ValueError(f"an ernie4_5 (dense) checkpoint cannot hold this model's experts {experts}; "
                         "export it as ernie4_5_moe_vl.")
    if model_type == "ernie4_5_moe" and len(experts) != 1:
        raise ValueError(f"an ernie4_5_moe checkpoint holds one expert pool; this model has {experts} "
                         "(text, vision): export it as ernie4_5_moe_vl.")
    data = {k: v for k, v in (base or {}).items() if k not in ("torch_dtype", "dtype")}
    data.update(dataclasses.asdict(model_cfg))
    data.update(model_type=model_type, architectures=[ARCHITECTURES[model_type]], hidden_act="silu", use_bias=False)
    data["torch_dtype" if hf_layout else "dtype"] = "float32"
    if model_type == VL:
        data["vision_config"].update(model_type="DFNRope_vision_transformer",
                                     hidden_size=model_cfg.vision_config.embed_dim,
                                     spatial_patch_size=model_cfg.vision_config.patch_size)
        return data
    for key in ("vision_config", "pixel_hidden_size", "im_patch_id", "spatial_conv_size", "temporal_conv_size",
                "rope_3d", "freq_allocation"):
        data.pop(key, None)
    if model_type == "ernie4_5_moe":
        data.update(moe_num_experts=experts[0], moe_intermediate_size=model_cfg.moe_intermediate_size[0])
    else:
        for key in [k for k in data if k.startswith("moe_") or k == "global_aux_loss"]:
            data.pop(key)
    return data


def stable_state(model, tp_group=None) -> dict:
    """Every parameter under its stable name and in full (tensor-parallel slices gathered: a collective
    over ``tp_group``)."""
    return {name: full_tensor(param, tp_group) for name, param in model.stable_named_parameters()}


def save_model(model, model_cfg, directory: str, tokenizer=None, env=None, hf_layout: bool = False) -> Path:
    """Write every parameter in full under its stable name, in the Paddle layout ([in, out] linears, fused
    q/k/v and gate/up) or, with ``hf_layout``, the Hugging Face one.

    Called on every rank. In each pipeline stage, rank r of the expert group holding the stage's lead rank
    writes a shard with its experts, the lead adding the stage's other parameters; without expert groups
    the lead writes the stage's shard.
    """
    out = Path(directory)
    rank = env.rank if env else 0
    lead = env.stage_lead if env else 0
    group = env.expert_group if env else None
    per_stage = group.nranks if group is not None else 1
    stage, stages = (env.pp_rank, env.pp_world) if env else (0, 1)
    writers = per_stage * stages
    in_group = group.rank if group is not None and lead in group.ranks else (0 if rank == lead else None)
    writer = None if in_group is None else stage * per_stage + in_group
    state = stable_state(model, env.tp_group if env else None)
    parts = {}
    if writer is not None:
        for name, tensor in state.items():
            if rank == lead or is_expert(name):
                array = np.ascontiguousarray(tensor.numpy())
                parts.update(to_hf(name, array, model_cfg) if hf_layout else [(name, array)])
        out.mkdir(parents=True, exist_ok=True)
        filename = f"model-{writer + 1:05d}-of-{writers:05d}.safetensors"
        save_file(parts, str(out / filename), metadata={"format": "pd"})
    listing = [(writer, sorted(parts), sum(a.nbytes for a in parts.values()))]
    if env is not None and env.world_size > 1:
        gathered: list = []
        dist.all_gather_object(gathered, listing[0])
        listing = gathered
    if rank == 0:
        weight_map = {name: f"model-{w + 1:05d}-of-{writers:05d}.safetensors"
                      for w, names, _ in listing if w is not None for name in names}
        index = {"metadata": {"total_size": sum(size for _, _, size in listing)}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        (out / "config.json").write_text(json.dumps(model_config_dict(model_cfg, hf_layout), indent=2))
        if tokenizer is not None:
            tokenizer.save(out)
    return out
