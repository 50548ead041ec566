"""Writing the model as ``config.json`` + safetensors shards + index, full tensors whatever the layout: in the
Paddle layout (training checkpoints) or the Hugging Face layout PaddleFormers' ``from_pretrained`` reads
(the final model)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import paddle

from ..config.schema import Config, ModelConfig
from ..config.transformers_form import special_ids, to_transformers
from ..data.encoding.processor_config import processor_file
from ..data.encoding.tokenizer import Tokenizer
from ..json_files import UnreadableJSON, read_json
from ..model.parameter_kinds import MTP, is_expert
from ..moe.layer import router_counts
from ..nn.param_spec import full_shape
from ..nn.sharding import full_tensor
from ..parallel.env import DistEnv
from ..parallel.pipeline import TrainedModel
from ..parallel.zero import held
from ..paths import write_output
from .engines import MARKER_IDS
from .files import WrittenFiles
from .formats import VL, to_hf, transformers_name

PADDLEFORMERS, TRANSFORMERS = "paddleformers", "transformers"  # the config.json forms a model folder can take
ARCHITECTURES = {"ernie4_5": "Ernie4_5ForCausalLM", "ernie4_5_moe": "Ernie4_5_MoeForCausalLM",
                 VL: "Ernie4_5_VLMoeForConditionalGeneration"}


def folder_config(directory) -> dict:
    """The ``config.json`` of the model folder a run started from, as it is there ({} for none, or one that cannot
    be read): what the run writes keeps its keys, PaddleFormers' own settings among them."""
    if not directory:
        return {}
    try:
        config = read_json(Path(directory) / "config.json")
    except UnreadableJSON:
        return {}
    return config if isinstance(config, dict) and config.get("model_type") in ARCHITECTURES else {}


def model_config_dict(model_cfg: ModelConfig, hf_layout: bool = False, model_type: str = VL,
                      base: dict | None = None, special: dict[str, int] | None = None) -> dict:
    """ERNIE 4.5 config.json keys (``torch_dtype`` marks the Hugging Face layout), on top of ``base`` (the
    source's config.json when converting, which keeps keys such as the special token ids), as the serving
    engines read them (``checkpoint.engines``): the MoE layer range resolved, per modality for the VL model;
    ``special``: the tokenizer's special ids (``special_ids``), the image and video markers' among them. The text
    model types describe the decoder alone: ``ernie4_5`` needs a dense model, ``ernie4_5_moe`` one shared expert
    pool."""
    experts = list(model_cfg.moe_num_experts)
    if model_type == "ernie4_5" and experts:
        raise ValueError(f"an ernie4_5 (dense) checkpoint cannot hold this model's experts {experts}; "
                         "export it as ernie4_5_moe_vl.")
    if model_type == "ernie4_5_moe" and len(experts) != 1:
        raise ValueError(f"an ernie4_5_moe checkpoint holds one expert pool; this model has {experts} "
                         "(text, vision): export it as ernie4_5_moe_vl.")
    data = {k: v for k, v in (base or {}).items() if k not in ("torch_dtype", "dtype")}
    given = data.get("vision_config")
    vision_base: dict = given if isinstance(given, dict) else {}
    data.update(dataclasses.asdict(model_cfg))
    data.update(model_type=model_type, architectures=[ARCHITECTURES[model_type]], hidden_act="silu", use_bias=False,
                mtp_loss_scaling_factor=model_cfg.multi_token_pred_lambda)  # PaddleFormers' name for it
    data["torch_dtype" if hf_layout else "dtype"] = "float32"
    starts, ends = model_cfg.moe_layer_range()  # no engine resolves -1: each compares layers with it literally
    if model_type == VL:
        if experts:  # per modality, as the published config writes them (the engines index them)
            data.update(moe_layer_start_index=starts, moe_layer_end_index=ends)
        vision = model_cfg.vision_config
        data["vision_config"] = {**vision_base, **data["vision_config"], "model_type": "DFNRope_vision_transformer",
                                 "hidden_size": vision.embed_dim, "spatial_patch_size": vision.patch_size,
                                 "in_chans": vision.in_channels}  # SGLang's name for the channels
        data["use_temporal_conv"] = True  # the adapter merges frames in time (a still image repeats its frame)
        for key in MARKER_IDS:  # null: the vocabulary has no such marker
            data[key] = (special or {}).get(key, data.get(key))
        if not model_cfg.moe_capacity and experts:
            # PaddleFormers has no dropless mode: a factor of the expert count gives every expert room for every
            # token, which is dropless
            data["moe_capacity"] = [float(sum(experts))] * 3
        # its unpadded all-to-all dispatch (the published one) computes what this package's dispatcher does
        data.setdefault("moe_multimodal_dispatch_use_allgather", "v2-alltoall-unpad")
        return data
    # transformers knows the text model types: a VL base's remote code would build the wrong config
    for key in ("vision_config", "pixel_hidden_size", "im_patch_id", "spatial_conv_size", "temporal_conv_size",
                "rope_3d", "freq_allocation", "auto_map", *MARKER_IDS):
        data.pop(key, None)
    if model_type == "ernie4_5_moe":
        data.update(moe_num_experts=experts[0], moe_intermediate_size=model_cfg.moe_intermediate_size[0],
                    moe_layer_start_index=starts[0], moe_layer_end_index=ends[0])
    else:
        for key in [k for k in data if k.startswith("moe_") or k == "global_aux_loss"]:
            data.pop(key)
    return data


_DTYPES = {np.dtype("float32"): "F32", np.dtype("float16"): "F16", np.dtype("float64"): "F64",
           np.dtype("int64"): "I64", np.dtype("int32"): "I32"}


NUMPY_DTYPES: dict[Any, np.dtype] = {paddle.float32: np.dtype("float32"), paddle.float16: np.dtype("float16"),
                paddle.float64: np.dtype("float64")}


def _saved_dtype(dtype) -> np.dtype:
    """Weights are written in their own dtype; bfloat16 (which NumPy lacks) as float32."""
    return NUMPY_DTYPES.get(dtype, np.dtype("float32"))


class SafetensorsWriter:
    """A safetensors file written one tensor at a time: the header (names, dtypes, shapes, offsets) is known
    beforehand, so no more than the tensor being written is held in memory. The bytes are hashed on the way
    out and synced on close; a write error is kept in ``error`` (and later writes skipped) instead of raised,
    so the caller still takes part in the collectives around the writes.

    With ``written`` writing in the background (``checkpoint.files.BackgroundWrites``) the tensors are kept as
    handed over (host copies) and the file is written on its thread at :meth:`close`."""

    def __init__(self, path: Path, specs: list[tuple[str, np.dtype, list[int]]], metadata: dict,
                 written: WrittenFiles | None = None):
        header, offset = {"__metadata__": metadata}, 0
        for name, dtype, shape in specs:
            size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            header[name] = {"dtype": _DTYPES[np.dtype(dtype)], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            offset += size
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        self.expected = [(name, np.dtype(dtype), list(shape)) for name, dtype, shape in specs]
        self.total = offset
        self.path = Path(path)
        self.hash = hashlib.sha256()
        self.error: OSError | None = None
        self.file: BinaryIO | None = None
        # in the background: the header and tensors, in order, until close hands them to the writer's thread
        self.pending: list | None = [] if written is not None and written.background is not None else None
        if self.pending is None:
            self._open()
        self._put(struct.pack("<Q", len(encoded)) + encoded)

    def _open(self) -> None:
        try:
            self.file = open(self.path, "wb")
        except OSError as err:
            self.error = err

    def _put(self, data) -> None:
        """``data``: bytes, or the bytes of a contiguous array."""
        if self.pending is not None:
            self.pending.append(data)
            return
        if self.error is not None:
            return
        try:
            assert self.file is not None  # opened, or its error kept above
            self.file.write(data)
        except OSError as err:
            self.error = err
        self.hash.update(data)

    def write(self, name: str, array: np.ndarray) -> None:
        expected = self.expected.pop(0)
        if expected != (name, array.dtype, list(array.shape)):
            raise ValueError(f"tensor {name} {array.dtype} {list(array.shape)} written where {expected} was announced")
        self._put(np.ascontiguousarray(array).reshape(-1).view(np.uint8))

    def close(self, written: WrittenFiles | None = None) -> None:
        """Flush and sync; record the file's digest (or the write error) in ``written``. Without ``written``
        a write error is raised here. In the background this happens on the writer's thread."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            assert written is not None  # a pending write is a background one, which written carries
            written.run(lambda: self._write_all(pending, written))
            return
        self._close(written)

    def _write_all(self, pending: list, written: WrittenFiles) -> None:
        self._open()
        for data in pending:
            self._put(data)
        self._close(written)

    def _close(self, written: WrittenFiles | None) -> None:
        if self.file is not None:
            try:
                self.file.flush()
                os.fsync(self.file.fileno())
            except OSError as err:
                self.error = self.error or err
            self.file.close()
        if written is None:
            if self.error is not None:
                raise self.error
        elif self.error is not None:
            written.fail(self.error)
        else:
            written.digests[self.path.name] = self.hash.hexdigest()


def trained_names(model: TrainedModel) -> set[str]:
    """Stable names of the parameters that train (all that a LoRA run's checkpoints and adapter hold)."""
    return {n for n, p in model.stable_named_parameters() if not p.stop_gradient}


def save_model(model: TrainedModel, model_cfg: ModelConfig, directory: str, tokenizer: Tokenizer | None = None,
               env: DistEnv | None = None,
               hf_layout: bool = False,
               written: WrittenFiles | None = None, only: set[str] | None = None, stem: str = "model",
               convert=None, source: dict | None = None, extra: dict[str, str] | None = None,
               form: str = PADDLEFORMERS) -> Path:
    """Write every parameter in full under its stable name, in the Paddle layout ([in, out] linears, fused
    q/k/v and gate/up) or, with ``hf_layout``, the Hugging Face one. ``only``: the stable names to write
    (a LoRA run's adapter); ``stem`` names the files (``<stem>-0000k-of-0000n.safetensors``, ``<stem>.
    safetensors.index.json``); ``convert(name, array) -> [(name, array)]`` replaces the layout conversion;
    ``source``: the config.json of the folder the run started from, whose keys config.json keeps; ``extra``:
    more files for rank 0 to write, {name: text} (:func:`inference_files`); ``form``: the config.json of
    PaddleFormers (``paddleformers``) or transformers (``transformers``), over the same tensors.

    Called on every rank. In each pipeline stage, rank r of the expert group holding the stage's lead rank
    writes a shard with its experts, the lead adding the stage's other parameters; without expert groups
    the lead writes the stage's shard. Tensors are gathered (tensor-parallel slices), converted and written
    one at a time. With ``written`` (a checkpoint) write errors are recorded there, else raised.
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
    tp_group = env.tp_group if env else None
    # transformers' ERNIE-4.5-VL has no multi-token prediction: its form leaves those layers out
    named = [(n, p) for n, p in model.stable_named_parameters()
             if (only is None or n in only) and not (form == TRANSFORMERS and n.startswith(MTP))]
    mine = {name for name, _ in named if writer is not None and (rank == lead or is_expert(name))}

    def converted(name, array):
        if convert is not None:
            return convert(name, array)
        if form == TRANSFORMERS:
            return [(transformers_name(n), a) for n, a in to_hf(name, array, model_cfg)]
        return to_hf(name, array, model_cfg) if hf_layout else [(name, array)]

    specs = []
    for name, param in named:
        if name in mine:
            # only its names and shapes after conversion are used
            empty = np.empty(full_shape(param), _saved_dtype(param.dtype))
            specs += [(n, a.dtype, list(a.shape)) for n, a in converted(name, empty)]
    # the engines and transformers create a correction bias in every MoE layer: zeros where the run had none
    zeros = absent_correction_biases(model) if (hf_layout or form == TRANSFORMERS) and only is None and rank == lead \
        else []
    specs += [(name, array.dtype, list(array.shape)) for name, array in zeros]
    file = None
    if writer is not None:
        out.mkdir(parents=True, exist_ok=True)
        filename = f"{stem}-{writer + 1:05d}-of-{writers:05d}.safetensors"
        file = SafetensorsWriter(out / filename, specs, {"format": "pd"}, written)
    for name, param in named:
        with held(model, [param]):  # sharding stage 3: gathered from its owner, one weight at a time
            tensor = full_tensor(param, tp_group)  # a collective over the tensor-parallel group: every rank calls it
            full = None if name not in mine else \
                tensor.numpy() if tensor.dtype in NUMPY_DTYPES else tensor.astype("float32").numpy()
        if full is not None:
            assert file is not None  # this rank writes the names it was given
            for part_name, part in converted(name, full):
                file.write(part_name, part)
    for name, array in zeros:
        assert file is not None
        file.write(name, array)
    if file is not None:
        file.close(written)
    listing = [(writer, sorted(n for n, _, _ in specs), file.total if file is not None else 0)]
    if env is not None:
        listing = env.all_gather_object(listing[0])
    if rank == 0:
        weight_map = {name: f"{stem}-{w + 1:05d}-of-{writers:05d}.safetensors"
                      for w, names, _ in listing if w is not None for name in names}
        index = {"metadata": {"total_size": sum(size for _, _, size in listing)}, "weight_map": weight_map}
        texts = {f"{stem}.safetensors.index.json": json.dumps(index, indent=2),
                 "config.json": json.dumps(written_config(model_cfg, hf_layout, source, tokenizer, form), indent=2),
                 **(extra or {})}
        if written is None:
            for name, text in texts.items():
                write_output(out / name, text)
            if tokenizer is not None:
                tokenizer.save(out)
            return out
        for name, text in texts.items():
            written.write(out / name, text)
        if tokenizer is not None and written.error is None:
            try:
                tokenizer.save(out)  # its files are fingerprinted with the rest before the folder is renamed
            except OSError as err:
                written.fail(err)
    return out


def absent_correction_biases(model: TrainedModel) -> list[tuple[str, np.ndarray]]:
    """Zeros (no shift) as the aux-loss-free correction bias of each of this stage's MoE layers that has none:
    transformers', vLLM's and SGLang's ERNIE-4.5 models always hold one (transformers would report it newly
    initialised, vLLM refuse the folder, SGLang add uninitialised memory to the router's scores)."""
    return [(f"model.layers.{moe.layer_idx}.mlp.moe_statics.e_score_correction_bias",
             np.zeros([len(moe.router_counts), max(moe.router_counts)], np.float32))
            for moe in model.moe_layers() if moe.moe_statics is None]


def correction_bias_zeros(model_cfg: ModelConfig, names: set[str]) -> list[tuple[str, np.ndarray]]:
    """Zeros as the correction bias of each MoE layer of ``model_cfg`` whose bias is not among ``names`` (a
    folder's tensors), shaped as its router's groups and experts, for the export that has no model built."""
    out = []
    for layer in range(model_cfg.num_hidden_layers):
        modalities = model_cfg.moe_modalities_at(layer)
        name = f"model.layers.{layer}.mlp.moe_statics.e_score_correction_bias"
        if modalities and name not in names:
            counts = router_counts(model_cfg, modalities)
            out.append((name, np.zeros([len(counts), max(counts)], np.float32)))
    return out


def written_config(model_cfg: ModelConfig, hf_layout: bool, source: dict | None, tokenizer: Tokenizer | None,
                   form: str = PADDLEFORMERS) -> dict:
    """The config.json a run writes: the source folder's keys, this model's, and the tokenizer's special ids
    where the source names none; in transformers' form, its ERNIE-4.5-VL config (ValueError for a model it
    cannot express)."""
    if form == TRANSFORMERS:
        return to_transformers(model_cfg, special_ids(tokenizer), source)
    config = model_config_dict(model_cfg, hf_layout, base=source, special=special_ids(tokenizer))
    if tokenizer is not None:
        for key, value in (("bos_token_id", tokenizer.bos_id), ("eos_token_id", tokenizer.eos_id),
                           ("pad_token_id", tokenizer.pad_id)):
            config.setdefault(key, int(value))
    return config


def inference_files(cfg: Config, tokenizer: Tokenizer, form: str = PADDLEFORMERS) -> dict[str, str]:
    """What a folder needs beside its weights to be used as the run used it: the processor settings (how inputs
    were encoded, for the library of ``form``) and PaddleFormers' / transformers' ``generation_config.json``: the
    base model's (its sampling settings) where the run started from a folder that has one, with the special ids
    of the tokenizer the run used."""
    files = processor_file(cfg.data, cfg.model, cfg.training.seed, form == TRANSFORMERS)
    if tokenizer is not None:
        generation = {"do_sample": False, "use_cache": True, **base_generation_config(cfg.training.model_name_or_path),
                      "bos_token_id": int(tokenizer.bos_id), "eos_token_id": int(tokenizer.eos_id),
                      "pad_token_id": int(tokenizer.pad_id)}
        files["generation_config.json"] = json.dumps(generation, indent=2)
    return files


def base_generation_config(folder: str) -> dict:
    """The ``generation_config.json`` of the folder a run started from ({} for none, or one that cannot be read:
    the defaults then stand)."""
    if not folder or not (Path(folder) / "generation_config.json").exists():
        return {}
    try:
        config = read_json(Path(folder) / "generation_config.json", max_bytes=1024 * 1024)
    except UnreadableJSON:
        return {}
    return config if isinstance(config, dict) else {}
