"""The final model as PaddleFormers lays it out: ``config.json`` + safetensors shards + index."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import paddle.distributed as dist
from safetensors.numpy import save_file


def model_config_dict(model_cfg) -> dict:
    """ERNIE 4.5 VL config.json keys."""
    data = dataclasses.asdict(model_cfg)
    data.update(model_type="ernie4_5_moe_vl", architectures=["Ernie4_5_VLMoeForConditionalGeneration"],
                hidden_act="silu", use_bias=False, dtype="float32")
    data["vision_config"].update(model_type="DFNRope_vision_transformer",
                                 hidden_size=model_cfg.vision_config.embed_dim,
                                 spatial_patch_size=model_cfg.vision_config.patch_size)
    return data


def stable_state(model) -> dict:
    """The state dict under stable names: routed experts carry their global ids, wherever they live."""
    renames = {}
    for moe in model.moe_layers():
        prefix = f"model.layers.{moe.layer_idx}.mlp.experts."
        renames.update({f"{prefix}{local}.": f"{prefix}{j}." for local, j in enumerate(moe.experts.global_ids)})
    state = {}
    for name, tensor in model.state_dict().items():
        if ".mlp.experts." in name:
            head, _, tail = name.partition(".mlp.experts.")
            local, _, rest = tail.partition(".")
            name = renames[f"{head}.mlp.experts.{local}."] + rest
        state[name] = tensor
    return state


def save_model(model, model_cfg, directory: str, tokenizer=None, env=None) -> Path:
    """Write every parameter (Paddle layout, [in, out] linears) under its stable name.

    Called on every rank. Without expert groups rank 0 writes one shard; with them, rank r of the first
    expert group writes shard r + 1 with the experts it holds, rank 0 adding every shared parameter.
    """
    out = Path(directory)
    ep_group = getattr(env, "ep_group", None)
    rank = env.rank if env else 0
    writers = ep_group.nranks if ep_group is not None else 1
    parts = {}
    if rank < writers:
        for name, tensor in stable_state(model).items():
            if rank == 0 or ".mlp.experts." in name:
                parts[name] = np.ascontiguousarray(tensor.numpy())
        out.mkdir(parents=True, exist_ok=True)
        filename = f"model-{rank + 1:05d}-of-{writers:05d}.safetensors"
        save_file(parts, str(out / filename), metadata={"format": "pd"})
    listing = [(rank, sorted(parts), sum(a.nbytes for a in parts.values()))]
    if env is not None and env.world_size > 1:
        gathered: list = []
        dist.all_gather_object(gathered, listing[0])
        listing = gathered
    if rank == 0:
        weight_map = {name: f"model-{r + 1:05d}-of-{writers:05d}.safetensors"
                      for r, names, _ in listing if r < writers for name in names}
        index = {"metadata": {"total_size": sum(size for _, _, size in listing)}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        (out / "config.json").write_text(json.dumps(model_config_dict(model_cfg), indent=2))
        if tokenizer is not None:
            tokenizer.save(out)
    return out
