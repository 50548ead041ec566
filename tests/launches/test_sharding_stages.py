"""Sharding stages 2 and 3 beyond the layout tests: a stage-3 run with its optimizer states offloaded against one
process, and checkpoints crossing stages, sharding degrees and world sizes both ways (a checkpoint holds full
tensors whatever the stage).

One process trains 5 steps and saves at step 3; the stage-3 run (2 ranks, offloaded states) does the same. Its
checkpoint resumes in one process and at stage 1 over 2 ranks; the one process's resumes at stage 3 over 4 ranks.
Each resumed run's last two steps and final weights are the uninterrupted one process's.
"""

import json

import numpy as np
import pytest
from support.runs import launch, load_model, records

pytestmark = pytest.mark.slow  # starts processes

STEPS, ROWS = 5, 4
COMMON = [f"training.max_steps={STEPS}", "training.save_steps=3", "logging.logging_steps=1", "training.eval_steps=0",
          "data.num_eval_samples=0", "training.adam_epsilon=1e-6", "model.global_aux_loss=true"]


def sharded(ranks: int, stage: str) -> list[str]:
    return [f"parallel.sharding_parallel_degree={ranks}", f"parallel.sharding={stage}",
            f"training.per_device_train_batch_size={ROWS // ranks}"]


def losses(out) -> list[float]:
    return [r["loss"] for r in records(out) if "loss" in r]


def assert_same_weights(out, reference) -> None:
    a, b = load_model(reference / "final_model"), load_model(out / "final_model")
    assert set(a) == set(b)
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_stage3_with_offload_and_checkpoints_across_stages(tmp_path):
    one, _ = launch(tmp_path, 1, *COMMON, f"training.per_device_train_batch_size={ROWS}", name="one")
    stage3, log = launch(tmp_path, 2, *COMMON, *sharded(2, "stage3"), "training.offload_optim=true", name="stage3")
    np.testing.assert_allclose(losses(stage3), losses(one), rtol=1e-4)
    assert_same_weights(stage3, one)
    # each rank keeps the optimizer states of the weights it owns: the two shares make the one process's states
    states = [[r for r in records(out) if "loss" in r][-1] for out in (one, stage3)]
    held = [states[1][f"memory/rank{r}/optimizer_states_gb"] for r in range(2)]
    assert min(held) > 0 and sum(held) == pytest.approx(states[0]["memory/rank0/optimizer_states_gb"], rel=0.02)
    index = json.loads((stage3 / "checkpoint-3" / "optimizer.index.json").read_text())["weight_map"]
    assert len(set(index.values())) == 2  # written by both owners, each its own share

    expected = losses(one)[3:]
    for name, layout in (("resumed_one", [f"training.per_device_train_batch_size={ROWS}"]),
                         ("resumed_stage1", sharded(2, "stage1"))):
        nproc = 1 if name == "resumed_one" else 2
        resumed, _ = launch(tmp_path, nproc, *COMMON, *layout,
                            f"training.resume_from_checkpoint={stage3 / 'checkpoint-3'}", name=name)
        np.testing.assert_allclose(losses(resumed), expected, rtol=1e-5, err_msg=name)
        assert_same_weights(resumed, one)
    # the reverse: one process's checkpoint at stage 3 over four ranks
    resumed, _ = launch(tmp_path, 4, *COMMON, *sharded(4, "stage3"),
                        f"training.resume_from_checkpoint={one / 'checkpoint-3'}", name="resumed_stage3")
    np.testing.assert_allclose(losses(resumed), expected, rtol=1e-5)
    assert_same_weights(resumed, one)
