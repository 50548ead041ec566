"""The training objective is one part: a new objective is a module (its loss, its inputs, its figures and their
metrics), registered by name, that the config, the data's rows, the runner, the step's sums, the monitor and
evaluation take as they are, with no branch for it."""

import numpy as np
import paddle
import pytest
from support.runs import ROOT, SMALL

from ernie_moe.batch import IGNORE_INDEX
from ernie_moe.config import load_config
from ernie_moe.config.schema import STAGES
from ernie_moe.objectives import Objective, register, registry
from ernie_moe.training.trainer import Trainer


@pytest.fixture
def own_objectives(monkeypatch):
    """Objectives a test registers are gone after it (the config reference lists the registered stages)."""
    monkeypatch.setattr(registry, "_BUILDERS", dict(registry._BUILDERS))
    before = list(STAGES)
    yield
    STAGES[:] = before


class RowLosses(Objective):
    """Language modelling written as a new objective would be: the loss from each position's cross-entropy, with
    per-row figures (rows, summed loss, trained tokens) and a metric of its own."""

    name = "rows"
    figures = ("rows", "loss", "tokens")

    def loss(self, predictions, labels):
        per_row = predictions.per_position().astype("float32").sum(axis=1)
        tokens = (labels != IGNORE_INDEX).astype("float32").sum(axis=1)
        return per_row.sum(), paddle.stack([paddle.ones_like(per_row), per_row.detach(), tokens], axis=1)

    def metrics(self, totals, prefix):
        rows, loss, tokens = totals
        return {f"{prefix}token_loss": loss / tokens, f"{prefix}rows": rows}


def _two_steps(tmp_path, name, stage="sft"):
    cfg = load_config(ROOT / "configs" / "vl_moe.yaml", [
        *SMALL, f"training.output_dir={tmp_path / name}", "training.max_steps=2", "training.eval_steps=0",
        "training.max_eval_batches=2", f"training.stage={stage}"])
    trainer = Trainer(cfg)
    metrics = []
    for step in (1, 2):
        trainer.step = step
        metrics.append(trainer.monitor.end_window(step, [trainer.train_step().read()], trainer.parts.data_stats))
    result = trainer.evaluate()
    trainer.parts.feed.close()
    return trainer, metrics, result


def test_a_new_objective_trains_logs_and_evaluates_through_the_same_runner(tmp_path, own_objectives):
    """The same loss as language modelling, written as a new objective: the same two steps (the loss per label
    token within float tolerance, so the same gradients), its figures summed over the step's rows into its own
    metric (``rows/token_loss``, equal to the step's ``lm_loss``), and held-out data evaluated by its figures
    (``eval_token_loss``, equal to language modelling's ``eval_loss``)."""
    _, lm_windows, lm_eval = _two_steps(tmp_path, "lm")
    register("rows", lambda settings, reduce_sum: RowLosses())
    trainer, windows, evaluated = _two_steps(tmp_path, "rows", stage="rows")
    assert isinstance(trainer.parts.model.objective, RowLosses)
    for ours, lm in zip(windows, lm_windows):
        np.testing.assert_allclose(ours["lm_loss"], lm["lm_loss"], rtol=1e-5)
        np.testing.assert_allclose(ours["rows/token_loss"], ours["lm_loss"], rtol=1e-5)
        state = trainer.parts.state
        assert ours["rows/rows"] == state.micro_batch_size * trainer.cfg.training.gradient_accumulation_steps
        assert not any(k.startswith("rows/") for k in lm)
    assert "eval_loss" not in evaluated and "eval_token_loss" not in lm_eval
    np.testing.assert_allclose(evaluated["eval_token_loss"], lm_eval["eval_loss"], rtol=1e-5)


class WeightedRows(Objective):
    """A new objective with an input of its own per row, as docs/fine-tuning.md writes one: language modelling with
    each row's summed loss weighted by a number made from the row's tokens as it is read (1.0 to 1.6)."""

    name = "weighted"
    input_names = ("row_weight",)

    def __init__(self):
        self.seen = []  # (the weights the loss was given, each row's summed loss, the labels)

    def row_inputs(self, row):
        return {"row_weight": np.array(1.0 + int(row.input_ids.sum()) % 7 / 10, np.float32)}

    def loss(self, predictions, labels, weights):
        per_row = predictions.per_position().astype("float32").sum(axis=1)
        self.seen.append((weights.numpy(), per_row.numpy(), labels.numpy()))
        return (per_row * weights).sum(), None


def weighted_per_token(seen) -> float:
    return sum(float((w * losses).sum()) for w, losses, _ in seen) / \
        sum(int((labels != IGNORE_INDEX).sum()) for _, _, labels in seen)


def test_an_objective_with_a_per_row_input_is_registered_trained_and_evaluated_by_name(tmp_path, own_objectives):
    """Registered by name and named in the config (``training.stage: weighted``), with nothing of the package
    changed: its rows carry its input (training and held-out rows alike), ``collate`` stacks it per row, the step's
    logged loss is the weighted sum over the step's label tokens, and without figures of its own the held-out set is
    evaluated by its loss and token scores."""
    objective = WeightedRows()
    register("weighted", lambda settings, reduce_sum: objective)
    cfg = load_config(ROOT / "configs" / "vl_moe.yaml", [
        *SMALL, f"training.output_dir={tmp_path}", "training.max_steps=1", "training.eval_steps=0",
        "training.max_eval_batches=1", "training.stage=weighted"])
    trainer = Trainer(cfg)
    assert trainer.parts.model.objective is objective
    trainer.step = 1
    window = trainer.monitor.end_window(1, [trainer.train_step().read()], trainer.parts.data_stats)
    trained = objective.seen[:]
    rows = trainer.parts.state.micro_batch_size * trainer.cfg.training.gradient_accumulation_steps
    weights = np.concatenate([w for w, _, _ in trained])
    assert weights.shape == (rows,) and len(set(weights.round(6))) > 1  # a weight per row, not one per batch
    assert (weights >= 1).all() and (weights <= 1.6 + 1e-6).all()
    np.testing.assert_allclose(window["lm_loss"], weighted_per_token(trained), rtol=1e-5)
    objective.seen.clear()
    evaluated = trainer.evaluate()
    assert objective.seen and all(len(w) == len(labels) for w, _, labels in objective.seen)
    np.testing.assert_allclose(evaluated["eval_loss"], weighted_per_token(objective.seen), rtol=1e-5)
    assert 0 <= evaluated["eval_token_accuracy"] <= 1
    trainer.parts.feed.close()
