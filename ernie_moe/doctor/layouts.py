"""A few training steps of data, tensor, expert and pipeline parallelism and sharding stages 2 and 3 on two local
processes, each against one process with the same seed and global batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import paddle

from .kernels import Check

TRAIN = Path(__file__).with_name("train.py")
STEPS = 3
ROWS = 4  # rows of each global micro-batch
COMMON = [f"training.max_steps={STEPS}", "logging.logging_steps=1", "training.eval_steps=0",
          "data.num_eval_samples=0", "data.image_size=56", "data.max_seq_len=48", "logging.visualdl=false",
          "logging.progress_bar=false", "training.adam_epsilon=1e-6", "training.gradient_accumulation_steps=2",
          "model.global_aux_loss=true", "training.memory_guard_fraction=0"]
# name: (data ranks, overrides)
LAYOUTS = {"data parallel x2": (2, []),
           "tensor parallel x2": (1, ["parallel.tensor_parallel_degree=2"]),
           "expert parallel x2": (2, ["parallel.expert_parallel_degree=2"]),
           "pipeline x2": (1, ["parallel.pipeline_parallel_degree=2"]),
           # gradients, then weights, split over the two (reduced and gathered by NCCL on GPUs)
           "sharding stage 2 x2": (2, ["parallel.sharding_parallel_degree=2", "parallel.sharding=stage2"]),
           "sharding stage 3 x2": (2, ["parallel.sharding_parallel_degree=2", "parallel.sharding=stage3"]),
           # the ViT over each rank's share of the frames, the loss over chunks of which each rank holds a piece
           "sequence parallel x2, loss over chunks": (1, ["parallel.tensor_parallel_degree=2",
                                                          "parallel.sequence_parallel=true", "parallel.moe_group=mp",
                                                          "training.loss_subbatch_seqlen=16"])}
TOLERANCE = 1e-4  # relative, on each step's loss


def losses(workdir: Path, nproc: int, overrides: list[str]) -> list[float]:
    out = workdir / "run"
    workdir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    command = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc),
               "--log_dir", str(workdir / "log"), str(TRAIN), f"training.output_dir={out}", *COMMON, *overrides]
    done = subprocess.run(command, capture_output=True, text=True, cwd=workdir, env=env, timeout=900)
    if done.returncode != 0:
        log = workdir / "log" / "workerlog.0"
        tail = log.read_text()[-2000:] if log.is_file() else done.stderr[-2000:]
        raise RuntimeError(f"the run with {' '.join(overrides) or 'one process'} failed:\n{tail}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    found = [r["loss"] for r in records if "loss" in r]
    if len(found) != STEPS:
        raise RuntimeError(f"the run with {' '.join(overrides)} logged {len(found)} losses, not {STEPS}")
    return found


def check_layouts(workdir: Path) -> list[Check]:
    """One Check per layout: the largest relative difference of a step's loss from one process's."""
    if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() < 2:
        raise RuntimeError("--layouts needs 2 devices; this machine has "
                           f"{paddle.device.cuda.device_count()}")
    one = losses(workdir / "one", 1, [f"training.per_device_train_batch_size={ROWS}"])
    checks = []
    for name, (data_ranks, overrides) in LAYOUTS.items():
        many = losses(workdir / name.replace(" ", "_"), 2,
                      [*overrides, f"training.per_device_train_batch_size={ROWS // data_ranks}"])
        difference = max(abs(a - b) / abs(b) for a, b in zip(many, one))
        checks.append(Check(name, "float32", difference, TOLERANCE))
    return checks
