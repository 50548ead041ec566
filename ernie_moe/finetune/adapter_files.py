"""A LoRA adapter on disk, in PaddleFormers' form, and what it refers to.

    lora_config.json                        PaddleFormers' LoRAConfig (r, lora_alpha, rslora, target_modules, ...)
    peft_model.safetensors.index.json       weight_map of the pairs
    peft_model-0000k-of-0000n.safetensors   ``<layer>.lora_A [in, r]`` and ``<layer>.lora_B [r, out]``
    base_model.json                         the base model folder and the SHA-256 of its files

Tensors are in PaddleFormers' in-memory (Paddle) layout, so ``LoRAModel.from_pretrained`` reads them. Its
text models fuse q/k/v in another column order (``formats.group_qkv``); its VL model keeps q, k, v and gate, up
as separate layers, so a fused layer's pair becomes one pair per piece: the same A, and B's columns split.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path
from typing import cast

import numpy as np
import paddle
from safetensors import safe_open

from ..checkpoint.checkpoint import BASE_FILE, read_base
from ..checkpoint.errors import CheckpointError
from ..checkpoint.files import sha256_of
from ..checkpoint.formats import FUSED_PIECES, VL, group_qkv, split_fused, ungroup_qkv
from ..checkpoint.model_files import folder_config, save_model, trained_names
from ..config.kinds import fits
from ..config.schema import ModelConfig
from ..data.encoding.tokenizer import Tokenizer
from ..json_files import read_json
from ..nn.sharding import shard_of
from ..parallel.env import DistEnv
from ..parallel.pipeline import TrainedModel
from .lora import LoRASettings, apply_lora, is_lora, linear_layers

CONFIG = "lora_config.json"
INDEX = "peft_model.safetensors.index.json"
_WEIGHTS = (".safetensors", ".pdparams")


def base_reference(directory: str) -> dict:
    """The base model folder and a digest of its config and weight files (one pass over them)."""
    folder = Path(directory).resolve()
    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        if path.name == "config.json" or path.name.endswith(_WEIGHTS) or path.name.endswith(".index.json"):
            digest.update(f"{path.name}:{sha256_of(path)}\n".encode())
    return {"path": str(folder), "sha256": digest.hexdigest()}


def _qkv_order(name: str, array: np.ndarray, model_cfg: ModelConfig, to_paddleformers: bool) -> np.ndarray:
    """A fused q/k/v layer's B in PaddleFormers' column order (or back to this package's); any other as is."""
    if not name.endswith("self_attn.qkv_proj.lora_B"):
        return array
    heads, kv = model_cfg.num_attention_heads, model_cfg.num_key_value_heads
    return group_qkv(array, heads, kv) if to_paddleformers else ungroup_qkv(array, heads, kv)


def pieces_of(layer: str) -> list[str]:
    """The layers PaddleFormers' VL model has for one of this package's (a fused layer's pieces, or itself)."""
    prefix, _, last = layer.rpartition(".")
    return [f"{prefix}.{piece}" for piece in FUSED_PIECES[last]] if last in FUSED_PIECES else [layer]


def split_pair(name: str, array: np.ndarray, model_cfg: ModelConfig) -> list[tuple[str, np.ndarray]]:
    """A LoRA tensor as PaddleFormers' VL model holds it: for a fused layer its pieces' A (each the same) or B
    (the piece's columns); any other as is."""
    layer, _, factor = name.rpartition(".")
    pieces = pieces_of(layer)
    if len(pieces) == 1:
        return [(name, array)]
    if factor == "lora_A":
        return [(f"{piece}.lora_A", array) for piece in pieces]
    parts = split_fused(name, array, model_cfg)
    return [(f"{piece}.lora_B", np.ascontiguousarray(part)) for piece, part in zip(pieces, parts)]


def _joined_pairs(tensors: dict[str, np.ndarray], directory) -> dict[str, np.ndarray]:
    """Per-piece pairs (PaddleFormers' VL form) fused back into one pair per fused layer; CheckpointError when the
    pieces' A differ (an adapter trained with a pair per piece, which this package's fused layers cannot hold)."""
    out = dict(tensors)
    for fused, pieces in FUSED_PIECES.items():
        for name in [n for n in tensors if n.endswith(f".{pieces[0]}.lora_A")]:
            prefix = name[: -len(f".{pieces[0]}.lora_A")]
            wanted = [f"{prefix}.{piece}.{factor}" for factor in ("lora_A", "lora_B") for piece in pieces]
            missing = [n for n in wanted if n not in out]
            if missing:
                raise CheckpointError(f"the LoRA adapter in {directory} adapts {name[: -len('.lora_A')]} but holds no "
                                      f"{missing[0]}: this package adapts {', '.join(pieces)} together")
            a = [out.pop(f"{prefix}.{piece}.lora_A") for piece in pieces]
            if any(not np.array_equal(a[0], other) for other in a[1:]):
                raise CheckpointError(f"the LoRA adapter in {directory} holds a pair of its own for each of "
                                      f"{', '.join(pieces)} in {prefix}; this package trains one pair for them "
                                      "together and cannot load it")
            out[f"{prefix}.{fused}.lora_A"] = a[0]
            out[f"{prefix}.{fused}.lora_B"] = np.concatenate([out.pop(f"{prefix}.{p}.lora_B") for p in pieces], 1)
    return out


def save_adapter(model: TrainedModel, model_cfg: ModelConfig, settings: LoRASettings, directory, tokenizer: Tokenizer,
                 env: DistEnv, base: dict,
                 extra: dict[str, str] | None = None) -> Path:
    """Write the model's LoRA pairs in PaddleFormers' form for the base's model type, and the ``extra`` files
    (every rank calls this)."""
    out = Path(directory)
    names = trained_names(model)
    pieces = folder_config(base["path"]).get("model_type") == VL

    def convert(name, array):
        if pieces:
            return split_pair(name, array, model_cfg)
        return [(name, _qkv_order(name, array, model_cfg, to_paddleformers=True))]

    save_model(model, model_cfg, str(out), tokenizer, env, only=names, stem="peft_model", convert=convert,
               extra=extra)
    layers = {n for n, _, _, _ in linear_layers(model)}
    adapted = {n[: -len(".lora_A")] for n in names if n.endswith(".lora_A")}
    if pieces:  # PaddleFormers matches target_modules against its own layer names
        layers, adapted = ({piece for layer in group for piece in pieces_of(layer)} for group in (layers, adapted))
    listing = env.all_gather_object((sorted(adapted), sorted(layers))) if env.world_size > 1 else [(adapted, layers)]
    if env.is_main:
        adapted = {n for a, _ in listing for n in a}
        layers = {n for _, x in listing for n in x}
        config = {"r": settings.rank, "lora_alpha": settings.alpha, "rslora": settings.rslora,
                  "lora_dropout": settings.dropout, "scaling": settings.scaling,
                  "target_modules": target_patterns(adapted, layers), "base_model_name_or_path": base["path"],
                  "trainable_modules": None, "trainable_bias": None, "tensor_model_parallel_size": 1,
                  "dtype": "float32", "lora_plus_scale": 1.0, "merge_weights": False, "do_qat": False,
                  "loraga": False, "enable_lora_list": None, "head_dim": None}
        (out / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
        (out / BASE_FILE).write_text(json.dumps(base, indent=2))
    return out


def target_patterns(adapted: set[str], layers: set[str]) -> list[str]:
    """Regular expressions that match exactly the adapted layers among ``layers`` (PaddleFormers matches
    ``target_modules`` in full against its layer names): layer and expert numbers collapsed where that
    matches nothing else, the exact name otherwise."""
    patterns = []
    for name in sorted(adapted):
        collapsed = re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", re.escape(name))
        if all(n in adapted for n in layers if re.fullmatch(collapsed, n)):
            pattern = collapsed
        else:
            pattern = re.escape(name)
        if pattern not in patterns:
            patterns.append(pattern)
    return patterns


def read_adapter(directory, model_cfg: ModelConfig | None = None) -> tuple[LoRASettings, dict[str, np.ndarray]]:
    """(the settings of lora_config.json, the tensors) of an adapter folder; CheckpointError if unreadable. The
    tensors are as written, or with ``model_cfg`` in this package's layout (one pair per fused layer, this
    package's q/k/v column order)."""
    folder = Path(directory)
    try:
        settings = settings_of(read_json(folder / CONFIG))
        weight_map = read_json(folder / INDEX)["weight_map"]
        tensors = {}
        for file in sorted(set(weight_map.values())):
            with safe_open(str(folder / file), framework="numpy") as f:
                tensors.update({k: f.get_tensor(k) for k in f.keys()})
    except Exception as err:  # a missing file, bad JSON, or one of safetensors' ways of reporting a corrupt file
        raise CheckpointError(f"cannot read the LoRA adapter in {folder}: {err}") from None
    if model_cfg is not None:
        tensors = _joined_pairs({k: _qkv_order(k, v, model_cfg, to_paddleformers=False) for k, v in tensors.items()},
                                folder)
    return settings, tensors


def settings_of(config) -> LoRASettings:
    """The LoRA settings of an adapter's ``lora_config.json``: a rank of at least 1, an alpha and the target
    patterns (a list, or one pattern); CheckpointError when one is missing or of the wrong kind."""
    rank, alpha, targets = (config.get(key) if isinstance(config, dict) else None
                            for key in ("r", "lora_alpha", "target_modules"))
    targets = [targets] if isinstance(targets, str) else targets
    if not (fits(rank, int)[0] and cast(int, rank) >= 1 and fits(alpha, float)[0] and fits(targets, list[str])[0]):
        raise CheckpointError(f"{CONFIG} needs r (at least 1), lora_alpha (a number) and target_modules (patterns); "
                              f"it holds r={rank!r}, lora_alpha={alpha!r}, target_modules={targets!r}")
    return LoRASettings(rank=cast(int, rank), alpha=float(cast(float, alpha)), targets=tuple(cast(list, targets)),
                        rslora=bool(config.get("rslora", False)))


def load_adapter(model: TrainedModel, model_cfg: ModelConfig, directory) -> LoRASettings:
    """Add the adapter's LoRA pairs to a built model (one process) and load them."""
    settings, tensors = read_adapter(directory, model_cfg)
    # the adapted layers are those the tensors name (target_modules may name PaddleFormers' layers instead)
    layers = sorted(n[: -len(".lora_A")] for n in tensors if n.endswith(".lora_A"))
    apply_lora(model, dataclasses.replace(settings, targets=tuple(re.escape(n) for n in layers)), None)
    params = dict(model.stable_named_parameters())
    unknown = [n for n in tensors if n not in params]
    if unknown:
        raise CheckpointError(f"the LoRA adapter in {directory} holds '{unknown[0]}', which is no layer of this "
                              "model: the adapter was trained on a model of another shape")
    for name, param in params.items():
        if not is_lora(name):
            continue
        if name not in tensors:
            raise CheckpointError(f"the LoRA adapter in {directory} holds no tensor '{name}'")
        value = shard_of(param, tensors[name])
        if list(value.shape) != list(param.shape):
            raise CheckpointError(f"LoRA tensor '{name}' in {directory} has shape {list(value.shape)}; this model "
                                  f"expects {list(param.shape)}: the adapter was trained on a model of another shape")
        if not np.isfinite(value).all():
            raise CheckpointError(f"LoRA tensor '{name}' in {directory} holds nan or inf values: the adapter is "
                                  "damaged (a diverged run)")
        param.set_value(paddle.to_tensor(value).astype(param.dtype))
    return settings


def merged_weight(name: str, weight: np.ndarray, adapter: tuple[LoRASettings, dict],
                  model_cfg: ModelConfig) -> np.ndarray:
    """``weight + A B * scaling`` for a Paddle-layout weight the adapter adapts (``weight`` itself otherwise);
    ``adapter``: :func:`read_adapter` in this package's layout."""
    settings, tensors = adapter
    layer = name[: -len(".weight")]
    if not name.endswith(".weight") or f"{layer}.lora_A" not in tensors:
        return weight
    a = tensors[f"{layer}.lora_A"].astype("float32")
    b = tensors[f"{layer}.lora_B"]
    if a.shape[0] != weight.shape[0] or b.shape[1] != weight.shape[1] or a.shape[1] != b.shape[0]:
        raise CheckpointError(f"LoRA pair of '{layer}' is {list(a.shape)} x {list(b.shape)}; the base weight is "
                              f"{list(weight.shape)}: the adapter was trained on a model of another shape")
    return weight + (a @ b.astype("float32")) * settings.scaling


def adapter_base(adapter_dir, base_dir=None) -> str:
    """The base model folder to merge an adapter into: ``base_dir``, or the one it was trained on, whose files
    must still be those it was trained on (CheckpointError otherwise)."""
    saved = read_base(adapter_dir)
    if saved is None:
        raise CheckpointError(f"{adapter_dir} is not a LoRA adapter of this package (it has no {BASE_FILE})")
    saved_path, digest = saved["path"], saved["sha256"]
    if base_dir is not None:
        return str(base_dir)
    if not Path(saved_path).is_dir():
        raise CheckpointError(f"the adapter's base model {saved_path} is gone; name a copy with --base")
    if base_reference(saved_path)["sha256"] != digest:
        raise CheckpointError(f"the files in {saved_path} changed since the adapter was trained on them; name the "
                              "base it was trained on with --base")
    return saved_path
