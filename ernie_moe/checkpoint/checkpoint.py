"""Training checkpoints that outlive their layout: ``output_dir/checkpoint-<step>/`` holds

- the model as the exporter writes it (full tensors under stable names, ``config.json``, index);
- the AdamW state (moments and step powers) under ``<stable name>/<state>``, full tensors, one file per
  writing rank plus ``optimizer.index.json``;
- ``trainer_state.json``: step, data position, learning-rate schedule, the config of the run;
- ``rng_state-<rank>.json``: each rank's Python, NumPy and Paddle random states;
- for a LoRA run, ``base_model.json`` (the base model folder and its digest): the model files then hold only
  what trains, the frozen base coming from that folder;
- ``COMPLETE``: the run, the parent checkpoint and every file's SHA-256 (see ``lineage``).

A checkpoint is written under ``checkpoint-<step>.tmp``, every file synced to the disk, and renamed once every
rank has finished and the marker is in, so an interrupted save is never picked up. Loading slices what each
rank holds out of the full tensors, so a checkpoint loads into any layout. Nothing here unpickles.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.base import core
from safetensors import safe_open

from .. import faults
from ..config.schema import Config, ModelConfig
from ..data.encoding.tokenizer import Tokenizer
from ..data.formats.sample import DataError
from ..json_files import read_json, read_json_object
from ..model.parameter_kinds import is_expert
from ..nn.param_spec import full_shape
from ..nn.sharding import full_tensor, shard_of
from ..parallel.env import DistEnv
from .errors import CheckpointError
from .files import BackgroundWrites, WrittenFiles, sha256_of, sync_folder
from .formats import read_weight_map
from .lineage import MARKER, Checkpoint, Run, folder_for, marker_text, prune, read
from .model_files import (
    NUMPY_DTYPES,
    SafetensorsWriter,
    folder_config,
    inference_files,
    save_model,
    trained_names,
)
from .parts import TrainingParts

BASE_FILE = "base_model.json"
ADAM_STATES = ("moment1", "moment2", "beta1_pow_acc", "beta2_pow_acc")
MASTER = "master_weight"
EMA = "ema"  # ema-<rank>.safetensors and ema.index.json: the EMA's averages (training.ema_decay)


def _barrier(env: DistEnv) -> None:
    if env.world_size > 1:
        dist.barrier()


def adam_parts(optimizer) -> list:
    """The plain AdamW optimizers behind a (sharded, MoE-aware, offloaded) optimizer."""
    inner = getattr(optimizer, "_inner_opt", optimizer)
    if inner is None:  # a rank that owns no sharded expert state
        return []
    if hasattr(inner, "parts"):
        return [adamw for part in inner.parts for adamw in adam_parts(part)]
    return [inner]


def start_checkpoint(parts: TrainingParts, cfg: Config, tokenizer: Tokenizer, env: DistEnv, run: Run,
                     parent: Checkpoint | None,
                     background: BackgroundWrites | None = None) -> PendingCheckpoint:
    """Start the checkpoint of the state's step (every rank calls this): the part that reads the training state,
    the full tensors gathered to host memory and handed to the file writes, which run now or, with
    ``background``, on its thread while training goes on. :meth:`PendingCheckpoint.finish` completes it.
    ``cfg`` is the run's config, saved with it; ``tokenizer`` is saved beside the model."""
    step = parts.state.step
    root = Path(cfg.training.output_dir)
    final = folder_for(root, step, run)
    tmp = final.with_name(final.name + ".tmp")
    if env.is_main and tmp.exists():
        shutil.rmtree(tmp, ignore_errors=True)  # a save interrupted earlier; what is left is overwritten
    _barrier(env)
    written = WrittenFiles(background)
    try:
        tmp.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        written.fail(err)
    only = trained_names(parts.model) if parts.base else None
    save_model(parts.model, cfg.model, str(tmp), tokenizer, env, written=written, only=only,
               source=folder_config(cfg.training.model_name_or_path), extra=inference_files(cfg, tokenizer))
    if parts.base and env.is_main:
        written.write(tmp / BASE_FILE, json.dumps(parts.base, indent=2))
    faults.hit("kill_during_save", step, env.rank)
    faults.hit("sigterm_during_save", step, env.rank)
    written.run(lambda: faults.hit("kill_during_background_write", step, env.rank))
    _save_optimizer(parts, env, tmp, step, written)
    _save_ema(parts, env, tmp, written)
    written.write(tmp / f"rng_state-{env.rank:05d}.json", json.dumps(rng_state()))
    if env.is_main:
        state = {**dataclasses.asdict(parts.state), "data": parts.feed.state_dict(),
                 "scheduler": parts.scheduler.state_dict(), "schedule": parts.scheduler.plan(),
                 "loss_scaler": parts.precision.state_dict(), "ema_updates": parts.ema.updates if parts.ema else 0,
                 "config": dataclasses.asdict(cfg)}
        written.write(tmp / "trainer_state.json", json.dumps(state, indent=2))
    return PendingCheckpoint(step, tmp, final, run, parent, written, root, cfg.training.save_total_limit)


@dataclass
class PendingCheckpoint:
    """A save whose files are being written: complete once every rank's are (:meth:`finish`)."""

    step: int
    tmp: Path
    final: Path
    run: Run
    parent: Checkpoint | None
    written: WrittenFiles
    root: Path
    save_total_limit: int

    def written_here(self) -> bool:
        """Whether this rank's files are all written (or have failed)."""
        return self.written.background is None or self.written.background.idle()

    def finish(self, env: DistEnv) -> Checkpoint:
        """Every rank calls this: wait for this rank's files, then the marker, the rename and the pruning, or on
        a write error anywhere the partial folder removed and :class:`CheckpointError` raised on every rank."""
        if self.written.background is not None:
            self.written.background.wait()
        written, tmp, final, parent = self.written, self.tmp, self.final, self.parent
        outcomes = env.all_gather_object((written.digests, f"{written.error}" if written.error else None))
        error = None
        if env.is_main:
            error = next((f"rank {rank}: {e}" for rank, (_, e) in enumerate(outcomes) if e), None)
            if error is None:
                digests = {name: digest for files, _ in outcomes for name, digest in files.items()}
                error = _complete(tmp, final, self.step, self.run, parent, digests)
            if error is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        error = env.all_gather_object(error)[0]
        if error is not None:
            before = f"the previous checkpoint {parent.path} is intact" if parent else "no earlier checkpoint exists"
            raise CheckpointError(f"saving {final.name} failed on {error}. The partial {tmp.name} was removed; "
                                  f"{before}.")
        saved = read(final)
        if saved is None:  # completed above, so its marker is there
            raise CheckpointError(f"{final} was completed but cannot be read back")
        if env.is_main:
            prune(self.root, saved, self.save_total_limit)
        _barrier(env)
        return saved


def _complete(tmp: Path, final: Path, step: int, run: Run, parent: Checkpoint | None, digests: dict) -> str | None:
    """Main rank: fingerprint the files no writer reported, write the marker, rename the folder into place,
    each durably. Returns the error, if one occurs (the other ranks are waiting to hear it)."""
    try:
        for path in sorted(tmp.iterdir()):  # the small files other ranks and the tokenizer wrote
            if path.name not in digests:
                digests[path.name] = sha256_of(path, sync=True)
        marker = WrittenFiles()
        marker.write(tmp / MARKER, marker_text(step, run, parent.key if parent else None, digests))
        if marker.error is not None:
            raise marker.error
        sync_folder(tmp)
        faults.hit("kill_before_rename", step, 0)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        sync_folder(final.parent)
    except OSError as err:
        return f"rank 0: {err}"
    return None


def rng_state() -> dict:
    """This process's random states as plain JSON values."""
    version, keys, gauss = random.getstate()
    kind, mt, pos, has_gauss, cached = np.random.get_state()
    return {"python": [version, list(keys), gauss],
            "numpy": [kind, np.asarray(mt).tolist(), int(pos), int(has_gauss), float(cached)],
            "paddle": [list(g.__getstate__()) for g in paddle.get_rng_state()]}


def set_rng_state(state: dict) -> None:
    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    kind, mt, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(mt, dtype=np.uint32), pos, has_gauss, cached))
    generators = []
    for values in state["paddle"]:
        generator = core.GeneratorState.__new__(core.GeneratorState)
        generator.__setstate__(tuple(values))
        generators.append(generator)
    paddle.set_rng_state(generators)


def _save_optimizer(parts: TrainingParts, env: DistEnv, directory: Path, step: int, written: WrittenFiles) -> None:
    """Full tensors (tensor-parallel slices gathered), each written by one rank into its own file."""
    names = {p.name: (stable, p) for stable, p in parts.model.stable_named_parameters()}
    writes = {True: _writes_experts(env, _experts_sharded(parts.optimizer)), False: _writes_shared(env)}
    states = []  # (stable name, state, parameter, local value), the same order on every rank
    for opt in adam_parts(parts.optimizer):
        for state in ADAM_STATES:
            for pname, value in sorted(opt._accumulators.get(state, {}).items()):
                if pname in names:  # not a second stage's copy of a tied weight
                    stable, param = names[pname]
                    states.append((stable, state, param, value))
        for pname, value in sorted(opt._master_weights.items()):  # O2: float32 copies of low-precision weights
            if pname in names:
                stable, param = names[pname]
                states.append((stable, MASTER, param, value))
    entries = [(f"{stable}/{state}", param, value, writes[is_expert(stable)]) for stable, state, param, value in states]
    _write_full_tensors(entries, env, directory, "optimizer", written, step)


def _save_ema(parts: TrainingParts, env: DistEnv, directory: Path, written: WrittenFiles) -> None:
    """The EMA's averages, each written by the rank that owns it (tensor-parallel rank 0, or for the experts the
    rule of expert states sharded over their replicas)."""
    if parts.ema is None or not parts.ema.started:
        return
    # at sharding stage 3 the shared weights' averages are split as their optimizer states are
    shared = _writes_shared(env) if env.sharding == "stage3" else env.tp_rank == 0
    writes = {True: _writes_experts(env, sharded=True), False: shared}
    entries = [(name, param, value, writes[is_expert(name)]) for name, param, value in parts.ema.saved_states()]
    _write_full_tensors(entries, env, directory, EMA, written)


def _write_full_tensors(entries: list, env: DistEnv, directory: Path, kind: str, written: WrittenFiles,
                        step: int | None = None) -> None:
    """``entries``: (tensor name, parameter, this rank's value split like it, whether this rank writes it), the
    same parameters in the same order on the ranks of a tensor-parallel group. Each rank writes its tensors whole
    into ``<kind>-<rank>.safetensors``; rank 0 writes ``<kind>.index.json``. ``step``: where the disk-full fault
    may strike."""
    specs = [(name, NUMPY_DTYPES[value.dtype], _full_shape(param, value))
             for name, param, value, writes in entries if writes]
    filename = f"{kind}-{env.rank:05d}.safetensors"
    file = None
    try:
        if step is not None:
            faults.hit("disk_full", step, env.rank)
        file = SafetensorsWriter(directory / filename, specs, {"format": "pd"}, written) if specs else None
    except OSError as err:
        written.fail(err)
    for name, param, value, writes in entries:
        value = full_tensor(param, env.tp_group, value)  # a collective: every rank takes part
        if writes and file is not None:
            file.write(name, value.numpy())
    if file is not None:
        file.close(written)
    listing = env.all_gather_object((filename, sorted(name for name, _, _ in specs)))
    if env.is_main:
        index = {name: file for file, keys in listing for name in keys}
        written.write(directory / f"{kind}.index.json", json.dumps({"weight_map": index}, indent=2))


def _keeps_master_weights(opt, param) -> bool:
    return bool(getattr(opt, "_multi_precision", False)) and param.dtype in (paddle.bfloat16, paddle.float16)


def _full_shape(param, value) -> list[int]:
    """The unsplit shape of an optimizer state (a moment of a tensor-parallel slice is split like it)."""
    return full_shape(param) if list(value.shape) == list(param.shape) else list(value.shape)


def _experts_sharded(optimizer) -> bool:
    return any(hasattr(part, "owner") for part in getattr(optimizer, "parts", []) if part is not None)


def _writes_experts(env: DistEnv, sharded: bool) -> bool:
    """The ranks of the expert group holding the stage's lead write the expert states (the lead alone when
    every rank holds every expert). When the states are sharded over the experts' replicas, each rank holds,
    and writes, its share (on tensor-parallel rank 0 unless the experts are split over the tensor ranks)."""
    if sharded:
        return env.tp_rank == 0 or env.expert_group is env.tp_group
    if env.expert_group is None:
        return env.rank == env.stage_lead
    return env.stage_lead in env.expert_group.ranks


def _writes_shared(env: DistEnv) -> bool:
    """Tensor-parallel rank 0 of the first data-parallel replica writes the other states; under optimizer
    sharding each of its sharding ranks holds, and writes, its own share."""
    sharding = env.hcg.get_sharding_parallel_world_size() if env.sharding else 1
    return env.tp_rank == 0 and env.data_rank < sharding


class IndexedTensors:
    """Lazy access to the tensors of a checkpoint folder through a safetensors index (its model, optimizer states
    or EMA)."""

    def __init__(self, directory: Path, index_name: str):
        self.directory = directory
        self.where = read_weight_map(directory / index_name)
        self.files: dict = {}

    def get(self, name: str) -> np.ndarray:
        if name not in self.where:
            raise CheckpointError(f"{self.directory} holds no tensor '{name}'")
        path = self.directory / self.where[name]
        try:
            if path not in self.files:
                self.files[path] = safe_open(str(path), framework="numpy")
            return self.files[path].get_tensor(name)
        except Exception as err:  # safetensors reports a truncated or corrupt file in several ways
            raise CheckpointError(f"cannot read tensor '{name}' from {path}: {err}") from err


def read_base(folder: Path) -> dict | None:
    """The ``base_model.json`` of a LoRA checkpoint or adapter (``path``, ``sha256``); None when the folder has
    none, CheckpointError when it cannot be read."""
    path = Path(folder) / BASE_FILE
    if not path.is_file():
        return None
    try:
        saved = read_json(path)
        if not isinstance(saved.get("path"), str) or not isinstance(saved.get("sha256"), str):
            raise ValueError("it needs a path and a sha256")
    except (ValueError, AttributeError) as err:
        raise CheckpointError(f"cannot read {path}: {err}") from err
    return saved


def _check_base(directory: Path, base: dict | None) -> dict | None:
    """The base model a LoRA checkpoint was trained on, checked against this run's."""
    saved = read_base(directory)
    if saved is None:
        return None
    if base is None:
        raise CheckpointError(f"{directory} is a LoRA run's checkpoint (only the adapter, on the base model "
                              f"{saved['path']}): resume it with training.fine_tuning: lora")
    if saved["sha256"] != base["sha256"]:
        raise CheckpointError(f"{directory} was trained on the base model {saved['path']} (sha256 "
                              f"{saved['sha256'][:12]}...); training.model_name_or_path {base['path']} holds other "
                              f"weights (sha256 {base['sha256'][:12]}...)")
    return saved


# model settings a resume may change: how training weighs the router losses and caps the experts' load
RESUME_MAY_CHANGE = ("moe_aux_loss_lambda", "moe_z_loss_lambda", "moe_orthogonal_loss_lambda",
                     "moe_aux_free_update_coef", "moe_capacity")


def _read_state(directory: Path, model_cfg: ModelConfig) -> dict:
    """``trainer_state.json``, its fields of the right kind; CheckpointError naming what is wrong, and naming the
    model settings of this run that differ from the checkpoint's (they change what the weights compute)."""
    path = directory / "trainer_state.json"
    state = read_json_object(path, CheckpointError)
    for key, kind in (("step", int), ("scheduler", dict)):
        value = state.get(key)
        if not isinstance(value, kind) or isinstance(value, bool) or (isinstance(value, int) and value < 0):
            wanted = "a whole number of 0 or more" if kind is int else "an object"
            raise CheckpointError(f"{path}: '{key}' must be {wanted}, not {value!r}")
    saved = (state.get("config") or {}).get("model") if isinstance(state.get("config"), dict) else None
    if isinstance(saved, dict):
        now = dataclasses.asdict(model_cfg)
        changed = [f"model.{k}: {saved[k]!r} in the checkpoint, {now[k]!r} now" for k in now
                   if k in saved and k not in RESUME_MAY_CHANGE and saved[k] != now[k]]
        if changed:
            raise CheckpointError(f"{directory} was trained with other model settings ({'; '.join(changed)}): its "
                                  "weights compute something else under these; resume with the checkpoint's "
                                  "settings, or start a new run from it (training.model_name_or_path)")
    return state


def load_checkpoint(parts: TrainingParts, directory: Path, env: DistEnv) -> dict:
    """Load model weights, optimizer state, schedule, loss scaling and the data position into this rank's layout;
    returns the saved ``trainer_state.json`` (the caller restores the step from it)."""
    state = _read_state(directory, parts.model.cfg)
    weights = IndexedTensors(directory, "model.safetensors.index.json")
    named = parts.model.stable_named_parameters(include_tied_copy=True)
    base = _check_base(directory, parts.base)
    for stable, param in named:
        if base and param.stop_gradient:
            continue  # the frozen base: loaded from training.model_name_or_path, checked by its digest
        value = shard_of(param, weights.get(stable))
        if list(value.shape) != list(param.shape):
            raise CheckpointError(f"tensor '{stable}' in {directory} has shape {list(value.shape)}; this model "
                                  f"expects {list(param.shape)}")
        param.set_value(paddle.to_tensor(value).astype(param.dtype))
    states = IndexedTensors(directory, "optimizer.index.json")
    names = {p.name: (stable, p) for stable, p in named}
    for opt in adam_parts(parts.optimizer):
        loaded: dict[str, Any] = {"LR_Scheduler": dict(state["scheduler"])}
        for param in opt._parameter_list:
            stable, _ = names[param.name]
            for kind in ADAM_STATES:
                value = states.get(f"{stable}/{kind}")
                loaded[f"{param.name}_{kind}_0"] = paddle.to_tensor(shard_of(param, value))
            if _keeps_master_weights(opt, param):
                master = paddle.to_tensor(shard_of(param, states.get(f"{stable}/{MASTER}")))
                loaded.setdefault("master_weights", {})[param.name] = master
        opt.set_state_dict(loaded)
    parts.scheduler.set_state_dict(state["scheduler"])
    _load_ema(parts, directory, state)
    if "loss_scaler" in state:
        parts.precision.load_state_dict(state["loss_scaler"])
    if "data" in state:  # where the data stream stopped (a checkpoint from before positions were kept has none)
        try:
            parts.feed.load_state_dict(state["data"])
        except DataError as err:
            raise CheckpointError(f"{directory / 'trainer_state.json'}: {err}") from None
    rng_file = directory / f"rng_state-{env.rank:05d}.json"
    if rng_file.is_file():  # absent for a rank that the saving layout did not have
        try:
            set_rng_state(read_json(rng_file))
        except (ValueError, TypeError, KeyError, RuntimeError) as err:
            raise CheckpointError(f"cannot read {rng_file}: {err}") from err
    return state


def _load_ema(parts: TrainingParts, directory: Path, state: dict) -> None:
    """The EMA where the checkpoint has one; a run that turns the EMA on at a resume starts it afresh."""
    updates = state.get("ema_updates", 0)
    if parts.ema is None:
        return
    if not isinstance(updates, int) or isinstance(updates, bool) or updates < 0:
        raise CheckpointError(f"{directory}/trainer_state.json: 'ema_updates' must be a whole number of 0 or more, "
                              f"not {updates!r}")
    if not updates:  # none taken yet: the EMA starts afresh
        parts.ema.load(lambda name, param: None, 0)
        return
    averages = IndexedTensors(directory, f"{EMA}.index.json")
    parts.ema.load(lambda name, param: shard_of(param, averages.get(name)), updates)
