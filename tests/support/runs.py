"""Running the trainer as tests need it: launched as users launch it, or in this process, and reading back what a
run wrote (its metrics, its model folder)."""

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import paddle
from safetensors.numpy import load_file

from ernie_moe import faults
from ernie_moe.config import load_config
from ernie_moe.training import Trainer

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "vl_moe.yaml")  # the default run's config
# the tests' runs keep the 8 rows a step they were sized for (the default trains on 16)
SMALL = ["data.image_size=56", "data.max_seq_len=48", "data.num_eval_samples=32", "logging.progress_bar=false",
         "training.per_device_train_batch_size=8"]
# the default run's batch and ViT rate before they were raised: the learning tests start from captioners trained
# so (the README's DPO, GRPO and EMA tables were measured with them)
EARLIER_DEFAULT = ["training.per_device_train_batch_size=8", "training.vit_lr_ratio=1"]
# a run of 2 rows a step that logs every step, without evaluation or VisualDL: the fault and resume tests' size
QUIET = ["data.image_size=56", "data.max_seq_len=48", "training.per_device_train_batch_size=2",
         "data.num_eval_samples=8", "training.eval_steps=0", "logging.logging_steps=1", "logging.progress_bar=false",
         "logging.visualdl=false"]
# 8 steps whose loss is the language model's alone (router losses off), logged each step
SAME_LOSS = ["model.moe_aux_loss_lambda=0", "model.moe_z_loss_lambda=0", "model.moe_orthogonal_loss_lambda=0",
             "training.adam_epsilon=1e-6", "training.max_steps=8", "logging.logging_steps=1", "training.eval_steps=0",
             "data.num_eval_samples=0"]
# 5 steps of 2 rows, logged each step
FIVE_STEPS = ["data.image_size=56", "data.max_seq_len=48", "training.per_device_train_batch_size=2",
              "logging.visualdl=false", "training.eval_steps=0", "data.num_eval_samples=8", "training.max_steps=5",
              "logging.logging_steps=1", "training.adam_epsilon=1e-6"]


# Paddle's launcher picks a free port for its TCP store and binds it later: on a busy machine another process can
# take the port in between, and Paddle then aborts in libuv's cleanup with this message. The store is made before
# the trainer touches its output folder, so such a start simply runs again.
PORT_TAKEN = "uv__finish_close"


def run_launch(cmd, log_dir, **kwargs):
    """A ``paddle.distributed.launch`` command (``--log_dir log_dir``) through ``subprocess.run``, text captured; a
    start whose TCP store lost its port runs again, once."""
    log_dir = Path(log_dir)
    for attempt in range(2):
        result = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
        logs = "".join(log.read_text(errors="replace") for log in sorted(log_dir.glob("workerlog.*")))
        if result.returncode == 0 or attempt or PORT_TAKEN not in result.stdout + result.stderr + logs:
            return result
        shutil.rmtree(log_dir, ignore_errors=True)


def trainer_process(out, nproc, overrides, fault=None):
    """``run_trainer.py`` on the default config writing to ``out``: the script itself for one process (as
    ``python run_trainer.py``; the launcher would add only a start), under ``paddle.distributed.launch`` for more,
    its logs beside ``out``. (The process's result, each worker's log.)"""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop(faults.VARIABLE, None)
    if fault:
        env[faults.VARIABLE] = fault
    argv = [str(ROOT / "run_trainer.py"), "--config", CONFIG, f"training.output_dir={out}", *overrides]
    if nproc == 1:
        result = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=out.parent, env=env,
                                timeout=600)
        return result, [result.stderr]
    logs = out.parent / f"{out.name}_log"
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc), "--log_dir", str(logs),
           *argv]
    result = run_launch(cmd, logs, cwd=out.parent, env=env, timeout=600)
    return result, [log.read_text(errors="replace") for log in sorted(logs.glob("workerlog.*"))]


def launch(tmp_path, nproc, *overrides, name="run"):
    """The default run (``SMALL`` over it) in ``tmp_path / name``, which must succeed: (output folder, its output
    and rank 0's log)."""
    out = tmp_path / name
    result, logs = trainer_process(out, nproc, [*SMALL, *overrides])
    log = logs[0] if logs else ""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:] + log[-3000:]
    return out, result.stdout + log


def drain(process, kept: list) -> None:
    """Keep a process's pipe drained; what it printed, once it closes, is appended to ``kept``."""
    kept.append(process.stdout.read())


def start(argv, cwd, marker: str, later: list | None = None):
    """A command that prints ``marker``'s line once it is ready: (process, that line's match); what it prints
    after that is appended to ``later``."""
    process = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)))
    seen = []
    for line in process.stdout:
        seen.append(line)
        found = re.search(marker, line)
        if found:
            kept = later if later is not None else []
            threading.Thread(target=drain, args=(process, kept), daemon=True).start()
            return process, found
    raise AssertionError("the command ended before it was ready:\n" + "".join(seen[-40:]))


def records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def load_model(model_dir, index="model.safetensors.index.json"):
    """The tensors of a safetensors index in ``model_dir`` (a model's, or a checkpoint's optimizer or EMA)."""
    index = json.loads((model_dir / index).read_text())
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(str(model_dir / shard)))
    assert set(tensors) == set(index["weight_map"])
    return tensors


def train(out, *overrides, fault=None, nproc=1, check=True):
    """The trainer as users start it (``QUIET`` over the default run), with the fault ``fault`` injected: the
    process's result, every worker's log appended to its stdout."""
    result, logs = trainer_process(out, nproc, [*QUIET, *overrides], fault)
    if nproc > 1:
        result.stdout += "".join(logs)
    if check:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def losses(out) -> dict:
    return {r["step"]: r["loss"] for r in records(out) if "loss" in r}


def quiet_trainer(tmp_path, *overrides):
    """The trainer, in this process, at ``QUIET``'s size."""
    return Trainer(load_config(CONFIG, [*QUIET, f"training.output_dir={tmp_path}", *overrides]))


def same_loss_trainer(tmp_path, *overrides):
    """The trainer, in this process, for ``SAME_LOSS``'s 8 steps of 4 rows."""
    return Trainer(load_config(ROOT / "configs" / "vl_moe.yaml", [
        "data.image_size=56", "data.max_seq_len=48", "training.per_device_train_batch_size=4",
        "logging.visualdl=false", f"training.output_dir={tmp_path}", *SAME_LOSS, *overrides]))


def trained(tmp_path, *overrides):
    """``FIVE_STEPS`` in this process: (each step's language-model loss, the final weights, the trainer)."""
    tr = Trainer(load_config(ROOT / "configs" / "vl_moe.yaml", [*FIVE_STEPS, f"training.output_dir={tmp_path}",
                                                                  *overrides]))
    losses = []
    for tr.step in range(1, 6):
        result = tr.train_step().read()
        losses.append(result.lm_loss_sum / result.label_tokens)
    return losses, {name: p.numpy() for name, p in tr.parts.model.stable_named_parameters()}, tr


def fine_tune(base, folder, out, *overrides):
    """Two steps of the README's fine-tuning config on the conversations, from ``base``."""
    from support.ernie import BUDGET

    cfg = load_config(ROOT / "configs" / "finetune_ernie45_vl.yaml", [
        f"training.model_name_or_path={base}", f"training.output_dir={out}", f"data.train_path={folder / 'data.jsonl'}",
        f"data.tokenizer_path={folder / 'tokenizer'}", *(f"data.{k}={v}" for k, v in BUDGET.items()),
        "data.max_seq_len=1024", "training.max_steps=2", "training.gradient_accumulation_steps=1",
        "training.eval_steps=0", "training.save_steps=0", "training.warmup_steps=0", "training.learning_rate=1e-2",
        "logging.progress_bar=false", "logging.visualdl=false", *overrides])
    Trainer(cfg).train()
    return out / "final_model"


def adapter(folder) -> dict:
    """The tensors of a LoRA adapter folder."""
    return load_model(folder, "peft_model.safetensors.index.json")


def poison_gradients(tr, steps: set):
    """Make one gradient inf in the given steps (1-based, counted from the trainer's first step)."""
    real, calls = tr.forward_backward, []

    def forward_backward(micro_batches):
        result = real(micro_batches)
        calls.append(None)
        if len(calls) in steps:
            param = tr.parts.model.model.layers[0].self_attn.o_proj.weight
            param.grad.set_value(paddle.full_like(param.grad, float("inf")))
        return result

    tr.forward_backward = forward_backward
