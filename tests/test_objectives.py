"""The training objective is one part: a new objective is a module (its loss, its inputs, its figures and their
metrics) that the runner, the step's sums, the monitor and evaluation take as they are, with no branch for it."""

import numpy as np
import paddle
from support.runs import ROOT, SMALL

from ernie_moe.batch import IGNORE_INDEX
from ernie_moe.config import load_config
from ernie_moe.objectives import Objective
from ernie_moe.training import assembly
from ernie_moe.training.trainer import Trainer


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


def _two_steps(tmp_path, name):
    cfg = load_config(ROOT / "configs" / "vl_moe.yaml", [
        *SMALL, f"training.output_dir={tmp_path / name}", "training.max_steps=2", "training.eval_steps=0",
        "training.max_eval_batches=2"])
    trainer = Trainer(cfg)
    metrics = []
    for step in (1, 2):
        trainer.step = step
        metrics.append(trainer.monitor.end_window(step, [trainer.train_step().read()], trainer.data_stats))
    result = trainer.evaluate()
    trainer.feed.close()
    return trainer, metrics, result


def test_a_new_objective_trains_logs_and_evaluates_through_the_same_runner(tmp_path, monkeypatch):
    """The same loss as language modelling, written as a new objective: the same two steps (the loss per label
    token within float tolerance, so the same gradients), its figures summed over the step's rows into its own
    metric (``rows/token_loss``, equal to the step's ``lm_loss``), and held-out data evaluated by its figures
    (``eval_token_loss``, equal to language modelling's ``eval_loss``)."""
    _, lm_windows, lm_eval = _two_steps(tmp_path, "lm")
    monkeypatch.setattr(assembly, "build_objective", lambda t, env: RowLosses())
    trainer, windows, evaluated = _two_steps(tmp_path, "rows")
    assert isinstance(trainer.model.objective, RowLosses)
    for ours, lm in zip(windows, lm_windows):
        np.testing.assert_allclose(ours["lm_loss"], lm["lm_loss"], rtol=1e-5)
        np.testing.assert_allclose(ours["rows/token_loss"], ours["lm_loss"], rtol=1e-5)
        assert ours["rows/rows"] == trainer.state.micro_batch_size * trainer.cfg.training.gradient_accumulation_steps
        assert not any(k.startswith("rows/") for k in lm)
    assert "eval_loss" not in evaluated and "eval_token_loss" not in lm_eval
    np.testing.assert_allclose(evaluated["eval_token_loss"], lm_eval["eval_loss"], rtol=1e-5)
