"""A LoRA adapter in PEFT's form for transformers' ERNIE-4.5-VL: ``adapter_config.json`` and
``adapter_model.safetensors``, which ``peft.PeftModel.from_pretrained`` reads over the base in transformers' form.

PEFT adapts ``torch.nn.Linear`` modules under their transformers names (``model.language_model.layers.3.self_attn.
q_proj``, ``model.vision_tower.blocks.0.attn.qkv``, ``model.resampler_model.spatial_linear.fc1``), holding
``lora_A.weight [r, in]`` and ``lora_B.weight [out, r]``. A fused layer's pair becomes one per piece, as for
PaddleFormers' VL model. transformers holds each modality's routed experts as one stacked tensor, not as linear
layers, so an adapter on them has no PEFT form: merge it instead (``export --merge-lora``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from ..checkpoint.checkpoint import read_base
from ..checkpoint.errors import CheckpointError
from ..config.schema import ModelConfig
from ..model.parameter_kinds import is_expert
from .adapter_files import read_adapter, split_pair

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_RENAMES = ((r"^model\.layers\.", "model.language_model.layers."), (r"^vision_model\.", "model.vision_tower."),
            (r"_linear\.0$", "_linear.fc1"), (r"_linear\.2$", "_linear.fc2"))


def transformers_module(layer: str) -> str:
    """transformers' module name of one of PaddleFormers' VL linear layers; CheckpointError for a routed expert."""
    if is_expert(layer):
        raise CheckpointError(f"the adapter adapts the routed expert layer {layer}: transformers holds each "
                              "modality's experts as one stacked tensor, which PEFT cannot adapt; merge the adapter "
                              "instead (python -m ernie_moe.export ADAPTER OUT --merge-lora --format transformers)")
    for pattern, replacement in _RENAMES:
        layer = re.sub(pattern, replacement, layer)
    return layer


def write_peft_adapter(adapter_dir, out_dir, model_cfg: ModelConfig, base_dir) -> dict:
    """Write the adapter in ``adapter_dir`` in PEFT's form to ``out_dir``, over the base model at ``base_dir``
    (the transformers-form folder it is to be loaded on)."""
    settings, tensors = read_adapter(adapter_dir, model_cfg)
    weights, layers = {}, set()
    for name, array in tensors.items():
        for piece, value in split_pair(name, array, model_cfg):
            layer, _, factor = piece.rpartition(".")
            module = transformers_module(layer)
            layers.add(module)
            weights[f"base_model.model.{module}.{factor}.weight"] = np.ascontiguousarray(value.T.astype(np.float32))
    saved = read_base(adapter_dir)
    config = {"peft_type": "LORA", "task_type": None, "r": settings.rank, "lora_alpha": settings.alpha,
              "lora_dropout": 0.0, "use_rslora": settings.rslora, "bias": "none", "fan_in_fan_out": False,
              # PEFT matches a string in full against each module name: exactly the adapted ones
              "target_modules": "|".join(re.escape(n) for n in sorted(layers)), "modules_to_save": None,
              "init_lora_weights": True, "inference_mode": True,
              "base_model_name_or_path": str(base_dir or (saved or {}).get("path", ""))}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / WEIGHTS), metadata={"format": "pt"})
    (out / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
    return {"tensors": len(weights), "layers": len(layers),
            "bytes": sum(v.nbytes for v in weights.values())}
