"""Evaluation by generation, the best model kept, and early stopping."""

import json

import numpy as np
import pytest
from support.runs import ROOT, launch, load_model, records

from ernie_moe import export
from ernie_moe.config import ConfigError, load_config
from ernie_moe.data.encoding.packing import Encoded, split_answer
from ernie_moe.evaluation.generated import answer_sums, generation_metrics, token_f1
from ernie_moe.evaluation.token_scores import CATEGORIES
from ernie_moe.training.best_model import BestModel

SHORT = ["logging.progress_bar=false", "data.num_eval_samples=16", "data.image_size=56", "data.max_seq_len=48"]


def run(out, *overrides):
    from ernie_moe.training import Trainer

    cfg = load_config(ROOT / "configs" / "vl_moe.yaml", [f"training.output_dir={out}", *SHORT, *overrides])
    return Trainer(cfg).train()


def test_token_f1_against_squads_definition():
    assert token_f1("a red bar", "a red bar") == 1.0
    assert token_f1("", "") == 1.0 and token_f1("a", "") == 0.0 and token_f1("x y", "a b") == 0.0
    # 2 common words, 3 answered, 4 expected: precision 2/3, recall 1/2
    assert token_f1("a red disk", "a red bar left") == pytest.approx(2 * (2 / 3) * 0.5 / (2 / 3 + 0.5))
    assert token_f1("a a a", "a b") == pytest.approx(2 * (1 / 3) * 0.5 / (1 / 3 + 0.5))  # counted with multiplicity


def encoded(ids, target, scored, types):
    n = len(ids)
    return Encoded(np.array(ids), np.array(target, bool), np.array(scored), np.array(types),
                   np.zeros([n, 3], np.int64), [], [])


def test_the_answer_is_the_last_trained_span_and_its_words_are_scored_in_place():
    # bos, image token, then a turn trained, an untrained prompt, and the answer 7 8 9 + eos (2)
    e = encoded([1, 4, 5, 6, 3, 7, 8, 9, 2], [0, 0, 1, 1, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1, 2, 0],
                [0, 1, 0, 0, 0, 0, 0, 0, 0])
    prompt, reference, scored = split_answer(e)
    assert prompt.input_ids.tolist() == [1, 4, 5, 6, 3] and reference.tolist() == [7, 8, 9, 2]
    assert split_answer(encoded([1, 5, 4], [0, 1, 0], [0, 0, 0], [0, 0, 1])) is None  # an image after the answer

    def decode(ids):
        return " ".join(str(i) for i in ids)

    right = answer_sums([7, 8, 9], reference, scored, decode, eos_id=2)
    assert right[:3].tolist() == [1, 1, 1.0]
    assert right[3:3 + CATEGORIES].tolist()[:3] == [1, 1, 1] and right[3 + CATEGORIES:].tolist()[:3] == [1, 1, 1]
    wrong = answer_sums([7, 5], reference, scored, decode, eos_id=2)  # word 2 wrong, word 3 missing
    assert wrong[1] == 0 and wrong[2] == pytest.approx(token_f1("7 5", "7 8 9"))
    assert wrong[3 + CATEGORIES:].tolist()[:3] == [1, 0, 0]
    figures = generation_metrics(right + wrong)
    assert figures["eval_generate_exact_match"] == 0.5 and figures["eval_generate_caption_accuracy"] == 0.5


def test_the_best_follows_the_metrics_direction_and_patience():
    cfg = load_config(None, ["training.save_best_metric=eval_loss", "training.early_stopping_patience=2"]).training
    best = BestModel(cfg, resumed=False)
    losses = [0.9, 0.7, 0.8, float("nan"), 0.6, 0.65, 0.6]
    improved = [best.update(step, {"eval_loss": v}) for step, v in enumerate(losses, start=1)]
    assert improved == [True, True, False, False, True, False, False]  # NaN and ties are never better
    assert (best.value, best.step, best.since, best.patience_spent) == (0.6, 5, 2, True)
    higher = BestModel(load_config(None, ["training.save_best_metric=eval_caption_accuracy"]).training, False)
    assert [higher.update(s, {"eval_caption_accuracy": v}) for s, v in enumerate([0.2, 0.5, 0.4])] == [True, True,
                                                                                                        False]
    assert not higher.patience_spent  # no patience: never stops
    with pytest.raises(ConfigError, match="not among this run's evaluation figures"):
        higher.update(9, {"eval_loss": 1.0})


@pytest.mark.parametrize("overrides, message", [
    (["training.early_stopping_patience=2"], "set it too"),
    (["training.save_best_metric=loss"], "not an evaluation figure"),
    (["training.eval_generate=true", "parallel.tensor_parallel_degree=2"], "does not run with tensor"),
    (["training.eval_generate_max_new_tokens=0"], "at least 1"),
])
def test_bad_settings_say_what_is_wrong(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


@pytest.mark.slow
def test_a_run_that_dies_while_writing_the_best_leaves_the_old_best_whole(tmp_path):
    """The new best goes to best_model.tmp and is swapped in: an export that fails half-way leaves best_model as
    it was; a run that died between the swap's two renames finds its best again when it resumes."""
    from ernie_moe.parallel.env import DistEnv

    cfg = load_config(None, [f"training.output_dir={tmp_path}", "training.save_best_metric=eval_loss"]).training
    best, env = BestModel(cfg, resumed=False), DistEnv()

    def export(weights):
        def write(folder):
            folder.mkdir()
            (folder / "model.safetensors").write_text(weights)
            if weights == "torn":
                raise OSError("disk full")
        return write

    best.replace(export("first"), env)
    with pytest.raises(OSError, match="disk full"):
        best.replace(export("torn"), env)
    assert (tmp_path / "best_model" / "model.safetensors").read_text() == "first"
    best.replace(export("second"), env)
    assert (tmp_path / "best_model" / "model.safetensors").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best_model"]
    best.update(4, {"eval_loss": 0.5})
    best.write_record()
    (tmp_path / "best_model").rename(tmp_path / "best_model.old")  # as if killed between the renames
    resumed = BestModel(cfg, resumed=True)
    assert (resumed.step, resumed.value) == (4, 0.5) and (tmp_path / "best_model" / "best.json").is_file()


def test_the_best_evaluation_writes_best_model_from_that_steps_weights(tmp_path):
    out = tmp_path / "run"
    summary = run(out, "training.max_steps=12", "training.eval_steps=3", "training.save_steps=3",
                  "training.save_best_metric=eval_loss", "training.eval_generate=true")
    evals = [r for r in records(out) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [3, 6, 9, 12]
    assert all(r["eval_generate_answers"] == 16 and 0 <= r["eval_generate_token_f1"] <= 1 for r in evals)
    best = min(evals, key=lambda r: r["eval_loss"])
    assert summary["best_step"] == best["step"] and summary["best_value"] == pytest.approx(best["eval_loss"])
    record = json.loads((out / "best_model" / "best.json").read_text())
    assert (record["metric"], record["step"]) == ("eval_loss", best["step"])
    # best_model holds that step's weights: what export makes of that step's checkpoint
    assert export.main([str(out / f"checkpoint-{best['step']}"), str(tmp_path / "exported")]) == 0
    kept, exported = load_model(out / "best_model"), load_model(tmp_path / "exported")
    assert set(kept) == set(exported)
    for name in kept:
        np.testing.assert_array_equal(kept[name], exported[name], err_msg=name)


@pytest.mark.slow
def test_early_stopping_ends_the_run_after_patience_evaluations_without_improvement(tmp_path):
    """A learning rate of 1e-12 leaves the weights as they were (far below float32's resolution of them), so
    every evaluation equals the first: the best stays at step 2 and the run stops at the second evaluation
    after it, with a checkpoint and final_model as at the end."""
    out = tmp_path / "run"
    summary = run(out, "training.max_steps=20", "training.eval_steps=2", "training.learning_rate=1e-12",
                  "training.min_lr=0", "training.warmup_steps=0", "training.save_best_metric=eval_caption_accuracy",
                  "training.early_stopping_patience=2")
    assert [r["step"] for r in records(out) if "eval_loss" in r] == [2, 4, 6]
    assert (summary["steps"], summary["run_steps"], summary["best_step"]) == (6, 6, 2)
    assert "no improvement of eval_caption_accuracy in 2 evaluations" in summary["stopped_early"]
    assert (out / "checkpoint-6" / "COMPLETE").is_file() and (out / "final_model" / "config.json").is_file()
    assert json.loads((out / "summary.json").read_text())["status"] == "done"
    # patience that runs out at the last step ends the run as planned: nothing stopped early
    summary = run(tmp_path / "to_the_end", "training.max_steps=6", "training.eval_steps=2",
                  "training.learning_rate=1e-12", "training.min_lr=0", "training.warmup_steps=0",
                  "training.save_best_metric=eval_caption_accuracy", "training.early_stopping_patience=2")
    assert summary["steps"] == 6 and "stopped_early" not in summary


@pytest.mark.slow
def test_two_data_ranks_answer_half_the_samples_each_and_give_the_whole_sets_figures(tmp_path):
    """dp2 answers 8 samples on each rank; its figures equal those of one process answering all 16 with the
    same weights (the run's final model, read back)."""
    from collections import Counter

    from ernie_moe.data.feeding.loader import training_encoder
    from ernie_moe.data.formats.synthetic import SyntheticShapes
    from ernie_moe.evaluation.generated import evaluate_by_generation
    from ernie_moe.generation import load_model_folder
    from ernie_moe.parallel import DistEnv

    args = ["training.max_steps=6", "training.eval_steps=6", "training.eval_generate=true",
            "data.num_eval_samples=16", "training.per_device_train_batch_size=4"]
    out, _ = launch(tmp_path, 2, *args)
    two = json.loads((out / "summary.json").read_text())
    cfg = load_config(ROOT / "configs" / "vl_moe.yaml", [*SHORT, *args])
    loaded = load_model_folder(out / "final_model")
    held_out = SyntheticShapes(cfg.training.seed, "eval", 16, cfg.data.image_size)
    one = evaluate_by_generation(loaded.model, held_out, training_encoder(loaded.tokenizer, cfg, Counter()),
                                 loaded.tokenizer, DistEnv(), 0, cfg.training.eval_generate_max_new_tokens)
    assert "eval_generate_caption_accuracy" in one and one["eval_generate_answers"] == 16
    for key, value in one.items():
        assert two[key] == pytest.approx(value, abs=1e-7), key
