"""Rewards a program can check (``objectives/rewards.py``): each built-in on answers written out by hand, the
user's own function, their weighted sum in the evaluation by generation, and every config that cannot work."""

import math

import numpy as np
import pytest
from support.runs import ROOT

from ernie_moe.config import ConfigError, load_config
from ernie_moe.evaluation.generated import SUMS, answer_sums, generation_metrics
from ernie_moe.objectives.rewards import (
    build_rewards,
    containment,
    exact_match,
    last_number,
    numeric,
    think_format,
    word_accuracy,
)

CONFIG = ROOT / "configs" / "vl_moe.yaml"


def rewards_of(*overrides):
    return build_rewards(load_config(CONFIG, ["training.eval_generate=true", *overrides]).training)


def test_each_built_in_reward_on_answers_written_by_hand():
    assert exact_match(" a  red\nsquare ", "a red square") == 1 and exact_match("a red squares", "a red square") == 0
    assert containment("it is a red square, clearly", "a red square") == 1
    assert containment("a red", "a red square") == 0
    assert [last_number(t) for t in ("x = 3, so 42.5", "1,234 apples", "-7e-3", ".5", "none", "- , .")] == [
        42.5, 1234.0, -0.007, 0.5, None, None]
    assert numeric("so the answer is 1,234.0", "#### 1234") == 1 and numeric("1234.1", "1234") == 0
    assert numeric("no number", "3") == 0 and numeric("3", "no number") == 0
    assert think_format("<think>\nadd them\n</think>\n\n7", "7") == 1
    assert think_format("<think>add them</think>", "7") == 0  # no answer after the thoughts
    assert think_format("7 <think>late</think> 7", "7") == 0
    assert word_accuracy("a red  square at the top", "a blue square at the top left") == pytest.approx(5 / 7)
    assert word_accuracy("red a square", "a red square") == pytest.approx(1 / 3)  # at the same place only
    assert word_accuracy("", "") == 1 and word_accuracy("words", "") == 0 and word_accuracy("", "a b") == 0


def test_the_weighted_sum_of_the_rewards_is_logged_beside_each_one(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text("def short(answer, reference):\n    return 1.0 / (1 + len(answer))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rewards = rewards_of("training.rewards=[exact_match,numeric,regex,my_rewards:short]",
                         "training.reward_weights=[1.0,0.5,0.25,2.0]", "training.reward_pattern=^\\d+$")
    assert [r.name for r in rewards] == ["exact_match", "numeric", "regex", "short"]

    def decode(ids):
        return " ".join(str(i) for i in ids)

    reference, scored = np.array([7, 8, 2]), np.zeros(3, dtype=np.int64)  # "7 8", then the end token 2
    right = answer_sums([7, 8], reference, scored, decode, 2, rewards)
    wrong = answer_sums([9], reference, scored, decode, 2, rewards)
    assert right[SUMS:].tolist() == [1.0, 1.0, 0.0, 1 / 4] and wrong[SUMS:].tolist() == [0.0, 0.0, 1.0, 1 / 2]
    figures = generation_metrics(right + wrong, rewards)
    means = {"exact_match": 0.5, "numeric": 0.5, "regex": 0.5, "short": 0.375}
    for name, mean in means.items():
        assert figures[f"eval_generate_reward_{name}"] == pytest.approx(mean)
    assert figures["eval_generate_reward"] == pytest.approx(0.5 + 0.5 * 0.5 + 0.25 * 0.5 + 2.0 * 0.375)
    assert figures["eval_generate_exact_match"] == 0.5  # the same answers, the same measure
    assert "eval_generate_reward" not in generation_metrics(right[:SUMS])  # no rewards, no figure


def test_rewards_that_cannot_work_are_config_errors(tmp_path, monkeypatch):
    (tmp_path / "broken_rewards.py").write_text(
        "import numpy\nLIMIT = 3\ndef fails(a, r):\n    raise KeyError('x')\ndef nan(a, r):\n    return float('nan')\n"
        "def half(a, r):\n    return numpy.float32(0.5)\ndef yes(a, r):\n    return True\n")
    (tmp_path / "unparsable_rewards.py").write_text("def f(a, r)\n    return 1\n")
    (tmp_path / "raising_rewards.py").write_text("raise RuntimeError('no config here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cases = [(["training.rewards=[typo]"], "'typo' is neither a built-in"),
             (["training.rewards=[no_such_module:f]"], "cannot load no_such_module:f: .* from PYTHONPATH"),
             (["training.rewards=[unparsable_rewards:f]"], "unparsable_rewards raised SyntaxError: .* line 1"),
             (["training.rewards=[raising_rewards:f]"], "raised RuntimeError: no config here"),
             (["training.rewards=[broken_rewards:nothing]"], "module broken_rewards has no nothing"),
             (["training.rewards=[broken_rewards:LIMIT]"], "broken_rewards:LIMIT is not a function"),
             (["training.rewards=[exact_match,exact_match]"], "names a reward twice")]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            rewards_of(*overrides)
    for overrides, message in [
            (["training.rewards=[exact_match]", "training.reward_weights=[1.0,2.0]"], "2 weight\\(s\\) for 1"),
            (["training.rewards=[regex]"], "set training.reward_pattern"),
            (["training.rewards=[regex]", "training.reward_pattern=(["], "is not a regular expression")]:
        with pytest.raises(ConfigError, match=message):
            load_config(CONFIG, ["training.eval_generate=true", *overrides])
    with pytest.raises(ConfigError, match="set training.eval_generate=true"):
        load_config(CONFIG, ["training.rewards=[exact_match]"])
    failing, nan, half, yes = rewards_of("training.rewards=[broken_rewards:fails,broken_rewards:nan,"
                                         "broken_rewards:half,broken_rewards:yes]")
    assert half("a", "b") == 0.5  # a NumPy number is a number
    with pytest.raises(ConfigError, match=r"returned True \(bool\)"):
        yes("a", "b")
    with pytest.raises(ConfigError, match="the reward broken_rewards:fails failed on an answer: KeyError"):
        failing("a", "b")
    with pytest.raises(ConfigError, match="returned nan"):
        nan("a", "b")
    assert math.isfinite(rewards_of("training.rewards=[containment]")[0]("a b", "b"))


def test_a_run_logs_its_rewards_at_every_evaluation_by_generation(tmp_path, monkeypatch):
    """The user's function is imported when the run starts and scores every answer beside the built-ins; the
    figures reach summary.json and metrics.jsonl's evaluation record."""
    import json

    from ernie_moe.training import Trainer

    (tmp_path / "run_rewards.py").write_text("def words(answer, reference):\n"
                                             "    return 0.25 + len(answer.split()) / 10\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(CONFIG, [f"training.output_dir={tmp_path / 'run'}", "data.image_size=56", "data.max_seq_len=48",
                               "training.per_device_train_batch_size=2", "data.num_eval_samples=4",
                               "training.max_steps=1", "training.eval_generate=true", "logging.progress_bar=false",
                               "logging.visualdl=false", "training.rewards=[exact_match,run_rewards:words]",
                               "training.reward_weights=[2.0,0.5]", "training.eval_generate_max_new_tokens=8"])
    summary = Trainer(cfg).train()
    assert summary["eval_generate_reward_exact_match"] == summary["eval_generate_exact_match"]
    assert 0.25 <= summary["eval_generate_reward_words"] <= 1.05  # at most 8 new tokens, each at most a word
    assert summary["eval_generate_reward"] == pytest.approx(2 * summary["eval_generate_reward_exact_match"]
                                                            + 0.5 * summary["eval_generate_reward_words"])
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["eval_generate_reward"] for r in records if "eval_generate_reward" in r] == [
        pytest.approx(summary["eval_generate_reward"])]
