"""Training checkpoints that outlive their layout: ``output_dir/checkpoint-<step>/`` holds

- the model as the exporter writes it (full tensors under stable names, ``config.json``, index);
- the AdamW state (moments and step powers) under ``<stable name>/<state>``, full tensors, one file per
  writing rank plus ``optimizer.index.json``;
- ``trainer_state.json``: step, data position, learning-rate schedule, the config of the run;
- ``rng_state-<rank>.pkl``: each rank's Python, NumPy and Paddle random states.

A checkpoint is written under ``checkpoint-<step>.tmp`` and renamed once every rank has finished and the
``COMPLETE`` marker is in, so an interrupted save is never picked up. Loading slices what each rank holds
out of the full tensors, so a checkpoint loads into any layout.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import random
import shutil
from pathlib import Path

import numpy as np
import paddle
import paddle.distributed as dist
from safetensors import safe_open

from ..model.ernie_vl import is_expert
from ..parallel.tensor_parallel import full_tensor, shard_of
from .formats import CheckpointError
from .model_files import NUMPY_DTYPES, SafetensorsWriter, save_model

MARKER = "COMPLETE"
ADAM_STATES = ("moment1", "moment2", "beta1_pow_acc", "beta2_pow_acc")
MASTER = "master_weight"


def _barrier(env) -> None:
    if env.world_size > 1:
        dist.barrier()


def adam_parts(optimizer) -> list:
    """The plain AdamW optimizers behind a (sharded, MoE-aware) optimizer."""
    parts = getattr(optimizer, "parts", [optimizer])
    return [getattr(part, "_inner_opt", part) for part in parts]


def save_checkpoint(trainer, step: int) -> Path:
    env, cfg = trainer.env, trainer.cfg
    root = Path(cfg.training.output_dir)
    final, tmp = root / f"checkpoint-{step}", root / f"checkpoint-{step}.tmp"
    if env.is_main and tmp.exists():
        shutil.rmtree(tmp)
    _barrier(env)
    save_model(trainer.model, cfg.model, str(tmp), trainer.tokenizer, env)
    _save_optimizer(trainer, tmp)
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "paddle": paddle.get_rng_state()}
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / f"rng_state-{env.rank:05d}.pkl").write_bytes(pickle.dumps(rng))
    if env.is_main:
        state = {"step": step, "consumed_rows": trainer.consumed_rows,
                 "scheduler": trainer.scheduler.state_dict(), "loss_scaler": trainer.precision.state_dict(),
                 "config": dataclasses.asdict(cfg)}
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
    _barrier(env)
    if env.is_main:
        (tmp / MARKER).write_text(f"{step}\n")
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        _prune(root, cfg.training.save_total_limit)
    _barrier(env)
    return final


def _save_optimizer(trainer, directory: Path) -> None:
    """Full tensors (tensor-parallel slices gathered), each written by one rank into its own file."""
    env, model = trainer.env, trainer.model
    names = {p.name: (stable, p) for stable, p in model.stable_named_parameters()}
    writes = {True: _writes_experts(env), False: _writes_shared(env)}
    states = []  # (stable name, state, parameter, local value), the same order on every rank
    for opt in adam_parts(trainer.optimizer):
        for state in ADAM_STATES:
            for pname, value in sorted(opt._accumulators.get(state, {}).items()):
                if pname in names:  # not a second stage's copy of a tied weight
                    stable, param = names[pname]
                    states.append((stable, state, param, value))
        for pname, value in sorted(opt._master_weights.items()):  # O2: float32 copies of low-precision weights
            if pname in names:
                stable, param = names[pname]
                states.append((stable, MASTER, param, value))
    specs = [(f"{stable}/{state}", NUMPY_DTYPES[value.dtype], _full_shape(param, value))
             for stable, state, param, value in states if writes[is_expert(stable)]]
    filename = f"optimizer-{env.rank:05d}.safetensors"
    file = SafetensorsWriter(directory / filename, specs, {"format": "pd"}) if specs else None
    for stable, state, param, value in states:
        value = full_tensor(param, env.tp_group, value)  # a collective: every rank takes part
        if writes[is_expert(stable)]:
            file.write(f"{stable}/{state}", value.numpy())
    if file is not None:
        file.close()
    parts = [name for name, _, _ in specs]
    listing = [(filename, sorted(parts))]
    if env.world_size > 1:
        gathered: list = []
        dist.all_gather_object(gathered, listing[0])
        listing = gathered
    if env.is_main:
        index = {name: file for file, keys in listing for name in keys}
        (directory / "optimizer.index.json").write_text(json.dumps({"weight_map": index}, indent=2))


def _keeps_master_weights(opt, param) -> bool:
    return bool(getattr(opt, "_multi_precision", False)) and param.dtype in (paddle.bfloat16, paddle.float16)


def _full_shape(param, value) -> list[int]:
    """The unsplit shape of an optimizer state (a moment of a tensor-parallel slice is split like it)."""
    if getattr(param, "is_distributed", False) and list(value.shape) == list(param.shape):
        return list(param.full_shape)
    return list(value.shape)


def _writes_experts(env) -> bool:
    """The ranks of the expert group holding the stage's lead write the expert states (the lead alone when
    every rank holds every expert)."""
    if env.expert_group is None:
        return env.rank == env.stage_lead
    return env.stage_lead in env.expert_group.ranks


def _writes_shared(env) -> bool:
    """Tensor-parallel rank 0 of the first data-parallel replica writes the other states; under optimizer
    sharding each of its sharding ranks holds, and writes, its own share."""
    sharding = env.hcg.get_sharding_parallel_world_size() if env.sharding else 1
    return env.tp_rank == 0 and env.data_rank < sharding


def _prune(root: Path, limit: int) -> None:
    if limit <= 0:
        return
    for old in complete_checkpoints(root)[:-limit]:
        shutil.rmtree(old)


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    found = [p for p in Path(root).glob("checkpoint-*") if p.is_dir() and (p / MARKER).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def resolve(resume_from: str, output_dir: str) -> Path | None:
    """``auto``: the newest complete checkpoint in ``output_dir`` (None when there is none); else the path."""
    if resume_from == "auto":
        found = complete_checkpoints(Path(output_dir))
        return found[-1] if found else None
    path = Path(resume_from)
    if not (path / MARKER).is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no {MARKER} marker): it does not exist or "
                              "its save was interrupted.")
    return path


class _Tensors:
    """Lazy access to the tensors of a checkpoint folder through a safetensors index."""

    def __init__(self, directory: Path, index_name: str):
        self.directory = directory
        index_file = directory / index_name
        try:
            self.where = json.loads(index_file.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as err:
            raise CheckpointError(f"cannot read {index_file}: {err}") from err
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


def load_checkpoint(trainer, directory: Path) -> dict:
    """Load model weights, optimizer state and schedule into this rank's layout; returns the trainer state."""
    weights = _Tensors(directory, "model.safetensors.index.json")
    named = trainer.model.stable_named_parameters(**({"include_tied_copy": True}
                                                     if trainer.env.pp_group is not None else {}))
    for stable, param in named:
        value = shard_of(param, weights.get(stable))
        if list(value.shape) != list(param.shape):
            raise CheckpointError(f"tensor '{stable}' in {directory} has shape {list(value.shape)}; this model "
                                  f"expects {list(param.shape)}")
        param.set_value(paddle.to_tensor(value).astype(param.dtype))
    try:
        state = json.loads((directory / "trainer_state.json").read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot read {directory / 'trainer_state.json'}: {err}") from err
    states = _Tensors(directory, "optimizer.index.json")
    names = {p.name: (stable, p) for stable, p in named}
    for opt in adam_parts(trainer.optimizer):
        loaded = {"LR_Scheduler": dict(state["scheduler"])}
        for param in opt._parameter_list:
            stable, _ = names[param.name]
            for kind in ADAM_STATES:
                value = states.get(f"{stable}/{kind}")
                loaded[f"{param.name}_{kind}_0"] = paddle.to_tensor(shard_of(param, value))
            if _keeps_master_weights(opt, param):
                master = paddle.to_tensor(shard_of(param, states.get(f"{stable}/{MASTER}")))
                loaded.setdefault("master_weights", {})[param.name] = master
        opt.set_state_dict(loaded)
    trainer.scheduler.set_state_dict(state["scheduler"])
    if "loss_scaler" in state:
        trainer.precision.load_state_dict(state["loss_scaler"])
    rng_file = directory / f"rng_state-{trainer.env.rank:05d}.pkl"
    if rng_file.is_file():  # absent for a rank that the saving layout did not have
        try:
            rng = pickle.loads(rng_file.read_bytes())
        except (pickle.UnpicklingError, EOFError, ValueError) as err:
            raise CheckpointError(f"cannot read {rng_file}: {err}") from err
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        paddle.set_rng_state(rng["paddle"])
    return state
