"""The final model as PaddleFormers lays it out: ``config.json`` + safetensors shards + index."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import paddle.distributed as dist
from safetensors.numpy import save_file

from ..model.ernie_vl import is_expert
from ..parallel.tensor_parallel import full_tensor


def model_config_dict(model_cfg) -> dict:
    """ERNIE 4.5 VL config.json keys."""
    data = dataclasses.asdict(model_cfg)
    data.update(model_type="ernie4_5_moe_vl", architectures=["Ernie4_5_VLMoeForConditionalGeneration"],
                hidden_act="silu", use_bias=False, dtype="float32")
    data["vision_config"].update(model_type="DFNRope_vision_transformer",
                                 hidden_size=model_cfg.vision_config.embed_dim,
                                 spatial_patch_size=model_cfg.vision_config.patch_size)
    return data


def stable_state(model, tp_group=None) -> dict:
    """Every parameter under its stable name and in full (tensor-parallel slices gathered: a collective
    over ``tp_group``)."""
    return {name: full_tensor(param, tp_group) for name, param in model.stable_named_parameters()}


def save_model(model, model_cfg, directory: str, tokenizer=None, env=None) -> Path:
    """Write every parameter in full (Paddle layout, [in, out] linears) under its stable name.

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
                parts[name] = np.ascontiguousarray(tensor.numpy())
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
        (out / "config.json").write_text(json.dumps(model_config_dict(model_cfg), indent=2))
        if tokenizer is not None:
            tokenizer.save(out)
    return out
