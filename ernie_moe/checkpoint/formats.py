"""The two ways ERNIE 4.5 weights are laid out on disk, and reading a checkpoint folder in either.

- Paddle layout (this package's checkpoints, ERNIE's ``-Paddle`` releases, PaddleNLP ``model_state.pdparams``):
  linear weights ``[in, out]``, fused ``qkv_proj`` (q, k, v concatenated) and ``up_gate_proj`` (gate, up),
  router weights ``[hidden, experts]``; prefix ``model.`` or ``ernie.``.
- Hugging Face layout (PaddleFormers' ``save_pretrained``, whose ``config.json`` carries ``torch_dtype``, and
  transformers' ERNIE-4.5-VL, whose tensors are the same):
  linear weights ``[out, in]``, separate ``q/k/v_proj`` and ``gate/up_proj``. The VL model keeps its router
  weights ``[hidden, experts]``; the text models store them ``[experts, hidden]``. PaddleFormers' VL model keeps its
  multi-token prediction layers' linear weights ``[in, out]`` (split, not transposed); the text models transpose
  them as the rest.

Names are otherwise shared: experts carry global ids (vision experts numbered after text experts), the
vision router is ``gate.weight_1``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import paddle
from safetensors import safe_open

from ..config.schema import ModelConfig
from ..config.transformers_form import from_transformers, is_transformers_form
from ..json_files import UnreadableJSON, read_json, read_json_object
from ..model.parameter_kinds import DECODER_LAYER, EMBEDDING, MTP, VIT_BLOCK, is_router, is_vision
from .errors import CheckpointError
from .pdparams import load_pdparams

MODEL_TYPES = ("ernie4_5", "ernie4_5_moe", "ernie4_5_moe_vl")
VL = "ernie4_5_moe_vl"


def _is_linear(name: str, ndim: int, model_type: str) -> bool:
    """A 2-D weight that the Hugging Face layout of a ``model_type`` checkpoint stores transposed."""
    if model_type == VL and name.startswith(MTP):
        return False
    return ndim == 2 and name.endswith(".weight") and "embed_tokens" not in name and not is_router(name)


# this package's fused layers, and the layers the Hugging Face layout (and PaddleFormers' VL model) has instead
FUSED_PIECES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "up_gate_proj": ("gate_proj", "up_proj")}


def split_fused(name: str, array: np.ndarray, cfg: ModelConfig) -> list[np.ndarray]:
    """The columns of each piece of a fused layer's ``[rows, columns]`` tensor ``name`` (its weight, or a LoRA
    B): q, k and v by the config's heads, gate and up in halves."""
    if name.split(".")[-2] != "qkv_proj":
        return np.split(array, 2, axis=1)
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    if array.shape[1] != q + 2 * kv:  # the split would silently hand columns of one projection to another
        raise CheckpointError(f"'{name}' has {array.shape[1]} columns; the config's heads give q, k and v "
                              f"{q} + {kv} + {kv} = {q + 2 * kv}")
    return np.split(array, [q, q + kv], axis=1)


def to_hf(name: str, array: np.ndarray, cfg, model_type: str = VL) -> list[tuple[str, np.ndarray]]:
    """One Paddle-layout tensor of this package's model as the Hugging Face-layout tensors it becomes in a
    ``model_type`` checkpoint (a text model has no vision side and stores its routers transposed)."""
    if model_type != VL and is_vision(name):
        return []
    if model_type != VL and is_router(name):
        return [(name, np.ascontiguousarray(array.T))]
    layer, _, kind = name.rpartition(".")
    prefix, _, last = layer.rpartition(".")
    transposed = _is_linear(name, array.ndim, model_type)
    if kind == "weight" and last in FUSED_PIECES:
        return [(f"{prefix}.{piece}.weight", np.ascontiguousarray(part.T if transposed else part))
                for piece, part in zip(FUSED_PIECES[last], split_fused(name, array, cfg))]
    if transposed:
        return [(name, np.ascontiguousarray(array.T))]
    return [(name, array)]


class SourceCheckpoint:
    """A checkpoint folder: ``config.json`` plus safetensors (single file or sharded with an index) or a
    ``model_state.pdparams``. Tensors are read one at a time, as float32 NumPy arrays, under names with the
    ``model.`` prefix; :meth:`paddle_tensor` returns them in the Paddle layout whatever the folder holds."""

    def __init__(self, directory):
        self.directory = Path(directory)
        config_file = self.directory / "config.json"
        if not config_file.is_file():
            raise CheckpointError(f"{self.directory} has no config.json: not a model folder.")
        self.config = read_json_object(config_file, CheckpointError)
        if is_transformers_form(self.config):  # its tensors are in PaddleFormers' Hugging Face layout
            try:
                self.config = from_transformers(self.config)
            except ValueError as err:
                raise CheckpointError(f"{config_file}: {err}") from None
        self.model_type = self.config.get("model_type")
        if self.model_type not in MODEL_TYPES:
            raise CheckpointError(f"{config_file}: model_type {self.model_type!r} is not one of "
                                  f"{', '.join(MODEL_TYPES)}.")
        self.where, self.pdparams = self._find_tensors()
        self.hf_layout = "torch_dtype" in self.config and self.pdparams is None
        # PaddleFormers keeps a fused qkv_proj grouped per key/value head: [q of the group's heads, k, v] x kv heads
        self.qkv_grouped = "paddleformers_version" in self.config and not self.hf_layout
        self.used: set[str] = set()
        self._open: dict = {}

    @property
    def form(self) -> str:
        if self.pdparams is not None:
            return "PaddleNLP model_state.pdparams (Paddle layout)"
        return "safetensors, " + ("Hugging Face layout" if self.hf_layout else "Paddle layout")

    def _find_tensors(self):
        d = self.directory
        index = d / "model.safetensors.index.json"
        if index.is_file():
            return {_normalise(k): (d / f, k) for k, f in read_weight_map(index).items()}, None
        single = d / "model.safetensors"
        if single.is_file():
            try:
                with safe_open(str(single), framework="paddle") as f:
                    return {_normalise(k): (single, k) for k in f.keys()}, None
            except Exception as err:  # safetensors reports a truncated or garbage header in several ways
                raise CheckpointError(f"cannot read {single}: {err}") from None
        if (d / "model_state.pdparams").is_file():
            state = load_pdparams(d / "model_state.pdparams")
            return {_normalise(k): (None, k) for k in state}, state
        raise CheckpointError(f"{d} holds no weights: expected model.safetensors.index.json, model.safetensors or "
                              "model_state.pdparams.")

    def names(self) -> list[str]:
        return list(self.where)

    def check_size(self, cfg: ModelConfig) -> None:
        """CheckpointError when the folder's tensors hold another number of decoder layers or ViT blocks, or an
        embedding of another shape, than the model section ``cfg`` says: judged from the names and the stored
        shape, before a model of that size is built (a config.json's vocabulary of 10**10 allocates nothing)."""
        embedding = EMBEDDING + "weight"
        if not self.has(embedding):
            raise CheckpointError(f"{self.directory}: its tensors hold no {embedding}: not a complete model")
        stored, shape = self.stored_shape(embedding), [cfg.vocab_size, cfg.hidden_size]
        if stored != shape:
            raise CheckpointError(f"{self.directory}: config.json describes an embedding of {shape} (vocab_size, "
                                  f"hidden_size); its tensor {embedding} is {stored}")
        for what, pattern, wanted in (("decoder layers", DECODER_LAYER, cfg.num_hidden_layers),
                                      ("ViT blocks", VIT_BLOCK, cfg.vision_config.depth)):
            found = {int(m.group(1)) for m in (pattern.match(n) for n in self.where) if m}
            if what == "ViT blocks" and not found:
                continue  # a text model's folder has no vision side
            if found != set(range(wanted)):
                raise CheckpointError(f"{self.directory}: config.json describes {wanted} {what}; its tensors hold "
                                      f"{len(found)} (numbered {min(found, default=0)} to {max(found, default=-1)})")

    def has(self, name: str) -> bool:
        return name in self.where

    def stored_shape(self, name: str) -> list[int]:
        """The shape of tensor ``name`` as stored, read from the file's header alone."""
        path, key = self.where[name]
        if self.pdparams is not None:
            return list(np.shape(self.pdparams[key]))
        if not path.is_file():
            raise CheckpointError(f"'{path}', named by the index for tensor '{key}', is not a regular file")
        try:
            with safe_open(str(path), framework="numpy") as f:
                return list(f.get_slice(key).get_shape())
        except Exception as err:  # safetensors reports a truncated or corrupt header in several ways
            raise CheckpointError(f"cannot read tensor '{key}' from {path}: {err}") from err

    def raw(self, name: str) -> np.ndarray:
        """The stored tensor under its normalised name, as it is on disk."""
        path, key = self.where[name]
        self.used.add(name)
        if path is not None and not path.is_file():  # a FIFO or a folder would block or fail in the reader
            raise CheckpointError(f"'{path}', named by the index for tensor '{key}', is not a regular file")
        try:
            if self.pdparams is not None:
                value = self.pdparams[key]
            else:
                if path not in self._open:
                    self._open[path] = safe_open(str(path), framework="paddle")
                value = self._open[path].get_tensor(key)
        except Exception as err:  # safetensors reports a truncated or corrupt file in several ways
            raise CheckpointError(f"cannot read tensor '{key}' from {path or self.directory}: {err}") from err
        if isinstance(value, paddle.Tensor):
            if value.dtype in (paddle.bfloat16, paddle.float16):
                value = value.astype("float32")
            value = value.numpy()
        value = np.asarray(value)
        if value.dtype.kind != "f":  # integer bytes read as weights would load as garbage
            raise CheckpointError(f"tensor '{key}' in {path or self.directory} is stored as {value.dtype}; model "
                                  "weights are floating point")
        return value

    def paddle_tensor(self, name: str) -> tuple[np.ndarray | None, bool]:
        """(Tensor ``name`` of this package's model in the Paddle layout, whether it had to be converted);
        (None, False) when the folder lacks it."""
        for fused, pieces in FUSED_PIECES.items():
            if name.endswith(f"{fused}.weight") and not self.has(name):
                found = [self.paddle_tensor(name.replace(fused, piece))[0] for piece in pieces]
                parts = [p for p in found if p is not None]
                if len(parts) < len(found):
                    return None, False
                return np.concatenate(parts, axis=1), True
        if not self.has(name):
            return None, False
        value = self.raw(name)
        if name.endswith("self_attn.qkv_proj.weight") and self.qkv_grouped:
            heads = self.config["num_attention_heads"]
            return ungroup_qkv(value, heads, self.config.get("num_key_value_heads") or heads), True
        text_router = is_router(name) and self.model_type != VL
        if self.hf_layout and (_is_linear(name, value.ndim, self.model_type) or text_router):
            return np.ascontiguousarray(value.T), True
        return value, False


def ungroup_qkv(value: np.ndarray, heads: int, kv_heads: int) -> np.ndarray:
    """Columns of a fused q/k/v tensor ``[rows, out]`` from PaddleFormers' order (per key/value head: the
    group's query heads, its key, its value) to this package's (every query head, every key, every value)."""
    grouped = value.reshape([value.shape[0], kv_heads, -1])
    head_dim = grouped.shape[-1] // (heads // kv_heads + 2)
    q, k, v = np.split(grouped, [grouped.shape[-1] - 2 * head_dim, grouped.shape[-1] - head_dim], axis=-1)
    return np.concatenate([p.reshape([value.shape[0], -1]) for p in (q, k, v)], axis=1)


def group_qkv(value: np.ndarray, heads: int, kv_heads: int) -> np.ndarray:
    """The inverse of :func:`ungroup_qkv`."""
    rows, head_dim = value.shape[0], value.shape[1] // (heads + 2 * kv_heads)
    q, k, v = np.split(value, [heads * head_dim, (heads + kv_heads) * head_dim], axis=1)
    parts = [q.reshape([rows, kv_heads, -1]), k.reshape([rows, kv_heads, -1]), v.reshape([rows, kv_heads, -1])]
    return np.concatenate(parts, axis=-1).reshape([rows, -1])


TRANSFORMERS_VIT = "model.vision_model."


def _normalise(name: str) -> str:
    """ERNIE's own releases prefix the decoder with ``ernie.``, PaddleFormers uses ``model.``; transformers keeps
    the ViT under ``model.vision_model.``, PaddleFormers under ``vision_model.``."""
    if name.startswith("ernie."):
        return "model." + name[len("ernie."):]
    return name[len("model."):] if name.startswith(TRANSFORMERS_VIT) else name


def transformers_name(name: str) -> str:
    """A Hugging Face-layout tensor name as transformers saves it."""
    return "model." + name if name.startswith("vision_model.") else name


def read_weight_map(index: Path) -> dict[str, str]:
    """A safetensors index's ``weight_map`` (tensor name -> file); CheckpointError naming the index when it cannot
    be read or maps a name to something other than a file name."""
    try:
        weight_map = read_json(index)["weight_map"]
    except (UnreadableJSON, KeyError, TypeError) as err:
        raise CheckpointError(f"cannot read {index}: {err}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise CheckpointError(f"{index}: weight_map must map each tensor name to a file name.")
    return weight_map
