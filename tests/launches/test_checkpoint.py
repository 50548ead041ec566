"""Training checkpoints: exact resume, resume in another layout, corrupt files named. Crashes during a save,
flipped bytes, a full disk and lineage rules are in checkpoint/test_save_faults.py."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from support.runs import ROOT, launch, load_model, records

from ernie_moe.checkpoint.lineage import MARKER, scan

pytestmark = pytest.mark.slow  # starts processes

COMMON = ["training.max_steps=6", "training.save_steps=3", "logging.logging_steps=1", "training.eval_steps=0",
          "training.adam_epsilon=1e-6", "model.global_aux_loss=true", "model.moe_use_aux_free=true"]


def losses(out):
    return {r["step"]: r["loss"] for r in records(out) if "loss" in r}


def test_resume_continues_bit_for_bit(tmp_path):
    whole, _ = launch(tmp_path, 1, *COMMON, "training.per_device_train_batch_size=4", name="whole")
    assert [c.path.name for c in scan(whole)] == ["checkpoint-3", "checkpoint-6"]
    resumed, log = launch(tmp_path, 1, *COMMON, "training.per_device_train_batch_size=4",
                          f"training.resume_from_checkpoint={whole / 'checkpoint-3'}", name="resumed")
    assert "resumed from" in log and "at step 3" in log
    assert {s: v for s, v in losses(whole).items() if s > 3} == losses(resumed)  # exactly equal
    a, b = load_model(whole / "final_model"), load_model(resumed / "final_model")
    for name in a:
        np.testing.assert_array_equal(b[name], a[name], err_msg=name)


def test_a_checkpoint_loads_into_other_layouts(tmp_path):
    """Saved by tensor parallel with experts on the tensor ranks, in the background (``training.async_save``: each
    rank's writes finish on its own thread, the checkpoint completes when every rank's have), resumed on one
    process and by expert parallel."""
    saved, _ = launch(tmp_path, 2, *COMMON, "training.per_device_train_batch_size=4",
                      "parallel.tensor_parallel_degree=2", "parallel.moe_group=mp", "training.async_save=true",
                      name="tp2")
    assert [c.path.name for c in scan(saved)] == ["checkpoint-3", "checkpoint-6"]
    checkpoint = f"training.resume_from_checkpoint={saved / 'checkpoint-3'}"
    one, _ = launch(tmp_path, 1, *COMMON, "training.per_device_train_batch_size=4", checkpoint, name="one")
    ep2, _ = launch(tmp_path, 2, *COMMON, "training.per_device_train_batch_size=2",
                    "parallel.expert_parallel_degree=2", checkpoint, name="ep2")
    expected = [v for s, v in sorted(losses(saved).items()) if s > 3]
    for out in (one, ep2):
        np.testing.assert_allclose([v for _, v in sorted(losses(out).items())], expected, rtol=1e-4)


def test_sharded_optimizer_state_resumes_in_a_pipeline(tmp_path):
    """Saved with optimizer sharding (each rank writes the states it owns, in the background), resumed by two
    pipeline stages."""
    accumulate = [*COMMON, "training.gradient_accumulation_steps=2"]
    saved, _ = launch(tmp_path, 2, *accumulate, "training.per_device_train_batch_size=1",
                      "parallel.sharding_parallel_degree=2", "parallel.sharding=stage1", "training.async_save=true",
                      name="sharding2")
    assert len(list((saved / "checkpoint-3").glob("optimizer-*.safetensors"))) == 2
    pp2, _ = launch(tmp_path, 2, *accumulate, "training.per_device_train_batch_size=2",
                    "parallel.pipeline_parallel_degree=2",
                    f"training.resume_from_checkpoint={saved / 'checkpoint-3'}", name="pp2")
    expected = [v for s, v in sorted(losses(saved).items()) if s > 3]
    np.testing.assert_allclose([v for _, v in sorted(losses(pp2).items())], expected, rtol=1e-4)


def test_a_corrupt_checkpoint_is_an_error_naming_the_file(tmp_path):
    out, _ = launch(tmp_path, 1, "training.max_steps=1", "training.eval_steps=0", "logging.logging_steps=1",
                    name="run")
    broken = tmp_path / "broken"
    shutil.copytree(out / "checkpoint-1", broken)
    shard = broken / "model-00001-of-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    result = subprocess.run(
        [sys.executable, str(ROOT / "run_trainer.py"), "--config", str(ROOT / "configs" / "vl_moe.yaml"),
         f"training.output_dir={tmp_path / 'again'}", f"training.resume_from_checkpoint={broken}"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "checkpoint error" in result.stderr and "model-00001-of-00001.safetensors" in result.stderr
    assert "Traceback" not in result.stderr
    (broken / MARKER).unlink()
    result = subprocess.run(
        [sys.executable, str(ROOT / "run_trainer.py"), "--config", str(ROOT / "configs" / "vl_moe.yaml"),
         f"training.output_dir={tmp_path / 'again'}", f"training.resume_from_checkpoint={broken}"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "not a complete checkpoint" in result.stderr
    assert json.loads((out / "checkpoint-1" / "trainer_state.json").read_text())["step"] == 1


def test_a_pipeline_and_tensor_parallel_checkpoint_resumes_with_expert_parallelism(tmp_path):
    """Saved by tp2 x pp2 on 4 processes, resumed by ep2 on 2: the same 4 rows per micro-batch, 2 micro-batches."""
    accumulate = [*COMMON, "training.gradient_accumulation_steps=2"]
    saved, _ = launch(tmp_path, 4, *accumulate, "training.per_device_train_batch_size=4",
                      "parallel.tensor_parallel_degree=2", "parallel.pipeline_parallel_degree=2", name="tp2_pp2")
    ep2, _ = launch(tmp_path, 2, *accumulate, "training.per_device_train_batch_size=2",
                    "parallel.expert_parallel_degree=2",
                    f"training.resume_from_checkpoint={saved / 'checkpoint-3'}", name="ep2")
    expected = [v for s, v in sorted(losses(saved).items()) if s > 3]
    np.testing.assert_allclose([v for _, v in sorted(losses(ep2).items())], expected, rtol=1e-4)
