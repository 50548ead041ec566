"""The EMA of the weights (training.ema_*): its recurrence, its evaluation beside the model, its resume, and what
it is saved as. Every layout's EMA against one process is in test_layouts.py."""

import json

import numpy as np
import pytest
from support.runs import EARLIER_DEFAULT, ROOT, load_model, records, same_loss_trainer, train

from ernie_moe import export
from ernie_moe.config import ConfigError, load_config
from ernie_moe.memory.estimate import estimate, sample_workload

DECAY, START, EVERY = 0.8, 3, 2


def test_the_ema_follows_the_numpy_recurrence_exactly(tmp_path):
    """Ten steps: nothing before step 3, a copy of the weights after it, then the recurrence every second step."""
    tr = same_loss_trainer(tmp_path, f"training.ema_decay={DECAY}", f"training.ema_start_step={START}",
                 f"training.ema_update_every={EVERY}", "data.num_eval_samples=4")
    params = dict(tr.parts.model.stable_named_parameters())
    assert [n for n, _, _ in tr.parts.ema.owned] == [n for n, p in params.items() if not p.stop_gradient]
    expected, updates = None, 0
    for step in range(1, 11):
        tr.step = step
        tr.train_step()
        weights = {n: params[n].numpy().astype(np.float32) for n, _, _ in tr.parts.ema.owned}
        if step < START:
            assert not tr.parts.ema.started
            continue
        if expected is None:
            expected, updates = weights, 1
        elif (step - START) % EVERY == 0:
            expected = {n: expected[n] * np.float32(DECAY) + weights[n] * np.float32(1 - DECAY) for n in weights}
            updates += 1
        assert tr.parts.ema.updates == updates
        for name, value in expected.items():
            np.testing.assert_array_equal(tr.parts.ema.values[id(params[name])].numpy(), value, err_msg=name)
    assert updates == 1 + 3  # steps 3 (the copy), 5, 7, 9

    online = {n: p.numpy() for n, p in params.items()}
    figures = tr.evaluate()
    assert {"eval_loss", "ema_eval_loss", "ema_eval_caption_accuracy"} <= set(figures)
    assert figures["ema_eval_loss"] != figures["eval_loss"]
    for name, param in params.items():  # evaluating the EMA leaves the trained weights as they were
        np.testing.assert_array_equal(param.numpy(), online[name], err_msg=name)


@pytest.mark.slow
def test_a_resumed_run_continues_the_ema_exactly_and_export_writes_it(tmp_path):
    """dp2, the EMA split over the two ranks: 6 steps straight against 3 steps, then a resume to 6 (in a new
    folder) from the straight run's checkpoint-3. ``export --ema`` writes the checkpoint's EMA as a model, and
    ``save_ema_as_final`` makes final_model the EMA."""
    args = ["training.max_steps=6", "training.save_steps=3", "training.ema_decay=0.7", "training.ema_start_step=2",
            "training.save_ema_as_final=true"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(straight, *args, nproc=2)
    shares = set(json.loads((straight / "checkpoint-3" / "ema.index.json").read_text())["weight_map"].values())
    assert shares == {"ema-00000.safetensors", "ema-00001.safetensors"}  # each rank wrote its own share
    result = train(resumed, *args, f"training.resume_from_checkpoint={straight / 'checkpoint-3'}", nproc=2)
    assert "resumed from" in result.stdout
    a, b = (load_model(out / "checkpoint-6", "ema.index.json") for out in (straight, resumed))
    assert set(a) == set(b)
    for name in a:
        np.testing.assert_array_equal(b[name], a[name], err_msg=name)

    # final_model (Hugging Face layout) is the EMA: what export --ema makes of the checkpoint, not its weights
    assert json.loads((straight / "summary.json").read_text())["final_model_weights"] == "ema"
    for flag, out in (["--ema"], tmp_path / "ema"), ([], tmp_path / "trained"):
        assert export.main([str(straight / "checkpoint-6"), str(out), *flag]) == 0
    final, averaged, trained = (load_model(d) for d in (straight / "final_model", tmp_path / "ema",
                                                         tmp_path / "trained"))
    assert set(final) == set(averaged) == set(trained)
    for name in final:
        np.testing.assert_array_equal(averaged[name], final[name], err_msg=name)
    assert not all(np.array_equal(trained[n], final[n]) for n in final)


@pytest.mark.slow
def test_on_the_default_task_the_ema_evaluates_better_than_the_model(tmp_path):
    """A constant, high learning rate leaves the trained weights noisy late in training; their average is not:
    at every evaluation after the EMA's start its held-out loss is below the model's, on average by more than
    EMA_MARGIN (the figures are in the README)."""
    out = tmp_path / "run"
    train(out, *EMA_TASK)
    evals = [r for r in records(out) if "ema_eval_loss" in r]
    assert [r["step"] for r in evals] == [40, 60, 80, 100, 120]
    assert evals[0]["ema_eval_loss"] == evals[0]["eval_loss"]  # at its start the EMA is the weights
    gaps = [r["eval_loss"] - r["ema_eval_loss"] for r in evals[1:]]
    assert min(gaps) > 0 and np.mean(gaps) > EMA_MARGIN, gaps


# the default task at a constant, high learning rate; its gaps measured 0.011, 0.024, 0.090, 0.015 (mean 0.035)
EMA_TASK = ["training.max_steps=120", "training.lr_scheduler_type=constant", "training.warmup_steps=5",
            "training.learning_rate=1e-2", "training.ema_decay=0.95", "training.ema_start_step=40",
            "training.eval_steps=20", "data.num_eval_samples=16", "logging.logging_steps=10", *EARLIER_DEFAULT]
EMA_MARGIN = 0.01


@pytest.mark.parametrize("override, words", [
    ("training.ema_decay=1", "ema_decay"),
    ("training.ema_update_every=0", "ema_update_every"),
    ("training.save_ema_as_final=true", "needs an EMA"),
    ("training.save_ema_as_final=true training.ema_decay=0.9 training.ema_start_step=1001", "after the run's last"),
    ("training.replica_check=sometimes", "replica_check"),
    ("training.memory_guard_capacity=-1", "memory_guard_capacity"),
])
def test_bad_ema_replica_and_capacity_settings_are_config_errors(override, words):
    with pytest.raises(ConfigError, match=words):
        load_config(str(ROOT / "configs" / "vl_moe.yaml"), override.split())


def test_the_planner_counts_each_ranks_share_of_the_ema(tmp_path):
    """One process holds the whole EMA in float32 (4 bytes per trained weight); the planner adds that, over the
    data ranks, to each rank's states."""
    tr = same_loss_trainer(tmp_path, "training.ema_decay=0.9")
    tr.step = 1
    tr.train_step()
    held = sum(v.size * v.element_size() for v in tr.parts.ema.values.values())
    trained = sum(p.size for p in tr.parts.model.parameters() if not p.stop_gradient)
    assert held == 4 * trained
    for data_world in (1, 2):
        with_ema, without = (estimate(c, sample_workload(c, data_world), data_world)[0].optimizer
                             for c in (tr.cfg, load_config(ROOT / "configs" / "vl_moe.yaml", ["data.image_size=56"])))
        assert with_ema - without == pytest.approx(held / data_world)
