"""The final model as PaddleFormers lays it out: ``config.json`` + safetensors shards + index."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

SHARD_BYTES = 2 * 1024**3


def model_config_dict(model_cfg) -> dict:
    """ERNIE 4.5 VL config.json keys."""
    data = dataclasses.asdict(model_cfg)
    data.update(model_type="ernie4_5_moe_vl", architectures=["Ernie4_5_VLMoeForConditionalGeneration"],
                hidden_act="silu", use_bias=False, dtype="float32")
    data["vision_config"].update(model_type="DFNRope_vision_transformer",
                                 hidden_size=model_cfg.vision_config.embed_dim,
                                 spatial_patch_size=model_cfg.vision_config.patch_size)
    return data


def save_model(model, model_cfg, directory: str, tokenizer=None) -> Path:
    """Write every parameter (Paddle layout, [in, out] linears) under its stable name."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(model_config_dict(model_cfg), indent=2))
    tensors = {name: np.ascontiguousarray(p.numpy()) for name, p in model.state_dict().items()}
    shards, current, size = [], {}, 0
    for name, array in tensors.items():
        if current and size + array.nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name] = array
        size += array.nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / filename), metadata={"format": "pd"})
        weight_map.update({name: filename for name in shard})
    index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    if tokenizer is not None:
        tokenizer.save(out)
    return out
