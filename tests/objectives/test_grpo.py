"""The GRPO stage (``training.stage: grpo``): rollouts of the policy, their rows and advantages, router replay at
the first update, the configuration's checks, and a data rank's share of a rollout."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from safetensors.numpy import load_file
from support.runs import EARLIER_DEFAULT, ROOT, SMALL, launch

from ernie_moe.batch import IGNORE_INDEX
from ernie_moe.config import ConfigError, load_config
from ernie_moe.data import DataError
from ernie_moe.generation.decoding import token_logp
from ernie_moe.training.rollouts import RolloutFeed
from ernie_moe.training.trainer import Trainer

GRPO = [*SMALL, "data.max_seq_len=40", "training.eval_steps=0", "training.stage=grpo",
        "training.rewards=[word_accuracy]", "training.rl_group_size=2", "training.per_device_train_batch_size=4",
        "training.max_steps=2"]


def grpo_cfg(tmp_path, name, *overrides):
    return load_config(ROOT / "configs" / "vl_moe.yaml", [*GRPO, f"training.output_dir={tmp_path / name}", *overrides])


def first_update(tmp_path, name, *overrides) -> dict:
    """The figures of a run's first update, and its largest sampler-trainer ratio (``mismatch_max_ratio``)."""
    trainer = Trainer(grpo_cfg(tmp_path, name, *overrides))
    trainer.step = 1
    result = trainer.train_step().read()
    trainer.parts.feed.close()
    objective = trainer.parts.model.objective
    largest = objective.window_maxima(trainer.env.all_reduce_max)[f"{objective.name}/mismatch_max_ratio"]
    return {**objective.metrics(result.figures, ""), "mismatch_max_ratio": largest, "lm_loss": result.lm_loss_sum}


def test_the_first_update_sees_ratio_one_only_with_router_replay(tmp_path):
    """A training capacity that drops choices the sampling (evaluation, dropless) kept: replaying the rollout's
    routing makes the first update's ratio 1 to float precision, through a recomputed backward too; so does the old
    policy's own forward (its routing, in evaluation mode, replayed in the training forward); routing afresh moves
    it by more than a percent."""
    flip = "model.moe_capacity=[0.3, 8.0, 8.0]"
    replayed = first_update(tmp_path, "replayed", flip, "training.recompute=true")
    old_policy = first_update(tmp_path, "old_policy", flip, "training.router_replay=old_policy")
    fresh = first_update(tmp_path, "fresh", flip, "training.router_replay=off")
    assert abs(replayed["ratio"] - 1.0) < 1e-5 and replayed["clip_fraction"] == 0.0
    assert abs(old_policy["ratio"] - 1.0) < 1e-6 and old_policy["clip_fraction"] == 0.0
    assert abs(fresh["ratio"] - 1.0) > 1e-2
    # the sampler-trainer mismatch as it is logged: near nothing with the routing replayed, plain without
    assert replayed["mismatch_k3"] < 1e-8 and old_policy["mismatch_k3"] < 1e-9
    assert fresh["mismatch_k3"] > 1e3 * max(replayed["mismatch_k3"], 1e-9)
    assert replayed["response_length"] == fresh["response_length"] == old_policy["response_length"]
    assert replayed["mismatch_max_ratio"] < 1.001 and fresh["mismatch_max_ratio"] > 2.0


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_the_importance_correction_caps_or_leaves_out_the_tokens_routing_flipped(tmp_path, level):
    """Routing afresh under a capacity the sampler did not have: the same mismatch whatever the correction (it is
    measured, not changed), the same tokens past the cap capped by TIS and left out by MIS, each moving the loss
    (their formulas are held against NumPy in test_policy_losses.py); nothing past the cap, nothing corrected,
    with the routing replayed."""
    flip = ["model.moe_capacity=[0.3, 8.0, 8.0]", f"training.rl_importance_level={level}",
            "training.rewards=[test_grpo:scattered]",  # answers that score apart: advantages, a loss
            "training.rl_importance_cap=1.1"]  # a cap that some tokens of those answers pass
    runs = {correction: first_update(tmp_path, f"{correction}_{level}", *flip, "training.router_replay=off",
                                     f"training.rl_importance_correction={correction}")
            for correction in ("off", "tis", "mis")}
    off, tis, mis = runs["off"], runs["tis"], runs["mis"]
    for key in ("mismatch_k3", "mismatch_past_bound", "mismatch_max_ratio", "response_length"):
        assert tis[key] == pytest.approx(off[key], rel=1e-6) and mis[key] == pytest.approx(off[key], rel=1e-6), key
    assert off["corrected"] == 0 and 0 < tis["corrected"] == mis["corrected"] < 1
    assert tis["corrected"] <= off["mismatch_past_bound"]  # capped above only; the bound counts both ways
    assert abs(tis["loss"] - off["loss"]) > 1e-4 and abs(mis["loss"] - off["loss"]) > 1e-4  # the weights act
    replayed = first_update(tmp_path, f"replayed_{level}", *flip, "training.rl_importance_correction=mis")
    assert replayed["corrected"] == 0 and replayed["mismatch_past_bound"] == 0


@pytest.mark.parametrize("frozen", [True, False])
def test_a_grpo_run_trains_its_mtp_depth_or_leaves_it_and_evaluates_its_drafts(tmp_path, frozen):
    """The multi-token prediction depth trains on the sampled answers beside the policy (rl_train_mtp, the
    default) unless it is frozen; either way an evaluation decodes with its drafts and logs their acceptance."""
    name = "frozen" if frozen else "trained"
    trainer = Trainer(grpo_cfg(tmp_path, name, "model.num_nextn_predict_layers=1", "training.eval_generate=true",
                               "training.eval_generate_samples=4", "data.num_eval_samples=4",
                               *(["training.freeze=[mtp]"] if frozen else [])))
    depth = trainer.parts.model.model.mtp_linear_proj[0].weight
    before = depth.numpy()
    result = trainer.train_step().read()
    assert (result.mtp is None) == frozen and trainer.parts.model.objective.mtp_depths(trainer.cfg.model) == 1 - frozen
    assert np.array_equal(depth.numpy(), before) == frozen
    assert 0 <= trainer.evaluate()["eval_draft_acceptance"] <= 1
    trainer.parts.feed.close()


class OneOfTwo:
    """A data rank's view of a two-rank data group whose other rank misses nothing."""

    def __init__(self, env, rank):
        self.env, self.data_rank, self.data_world = env, rank, 2
        self.data_group = None

    def all_reduce_sum(self, tensor, group):
        return tensor

    def __getattr__(self, name):
        return getattr(self.env, name)


def test_rollout_rows_advantages_and_a_data_ranks_share(tmp_path):
    """A rollout's rows: the prompt, then the answer as labels (its end-of-sentence token where it stopped there),
    the sampling policy's log-probability at each label and nowhere else, each group's advantages summing to 0.
    The same seed samples the same rows again, and the second of two data ranks samples exactly the second half of
    one process's rollout (the same prompts, answers and advantages), so a layout does not change the data."""
    trainer = Trainer(grpo_cfg(tmp_path, "rows"))
    feed: RolloutFeed = trainer.parts.feed
    rows = feed._rollout(8)
    assert len(rows) == 8 and feed.order.prompts_read == 4
    for row in rows:
        labelled = np.flatnonzero(row.labels != IGNORE_INDEX)
        assert len(labelled) and (np.diff(labelled) == 1).all()
        np.testing.assert_array_equal(row.labels[labelled], row.input_ids[labelled + 1])
        old = row.inputs["old_logps"]
        assert (old[labelled] < 0).all() and (np.delete(old, labelled) == 0).all()
        assert row.routes.shape == (1, 40, 2)  # one MoE layer, k = 2
    advantages = np.array([float(r.inputs["advantages"]) for r in rows]).reshape(4, 2)
    np.testing.assert_allclose(advantages.sum(axis=1), 0, atol=1e-9)
    figures = feed.window_metrics(elapsed=10.0)
    answer_tokens = sum(int((r.labels != IGNORE_INDEX).sum()) for r in rows)
    assert figures["rollout/response_length"] == answer_tokens / 8
    assert 0 < figures["rollout/entropy"] <= np.log(trainer.cfg.model.vocab_size)
    assert 0 <= figures["rollout/reward"] <= 1 and 0 < figures["rollout/time_share"] < 1
    shown = feed.window_answers()  # the window's first groups, to show: each answer with its reward and advantage
    assert len(shown) == 2 and feed.window_answers() == []
    for group, mine in zip(shown, (rows[:2], rows[2:4])):
        assert [a["advantage"] for a in group["answers"]] == [float(r.inputs["advantages"]) for r in mine]
        assert group["prompt"].startswith("<s><image 1 x ") and group["reference"]
        assert all(set(a["scores"]) == {"word_accuracy"} and 0 <= a["reward"] <= 1 for a in group["answers"])

    again = RolloutFeed(feed.dataset, trainer.parts.runner, trainer.tokenizer, trainer.cfg, trainer.env,
                        trainer.parts.precision, trainer.parts.rewards, Counter())._rollout(8)
    second = RolloutFeed(feed.dataset, trainer.parts.runner, trainer.tokenizer, trainer.cfg, OneOfTwo(trainer.env, 1),
                         trainer.parts.precision, trainer.parts.rewards, Counter())._rollout(4)
    for mine, theirs in [*zip(rows, again), *zip(rows[4:], second)]:
        np.testing.assert_array_equal(mine.input_ids, theirs.input_ids)
        assert mine.inputs["advantages"] == theirs.inputs["advantages"]
        np.testing.assert_allclose(mine.inputs["old_logps"], theirs.inputs["old_logps"], rtol=1e-4, atol=1e-5)
    trainer.parts.feed.close()


def test_a_rollout_position_is_saved_and_a_bad_one_refused(tmp_path):
    trainer = Trainer(grpo_cfg(tmp_path, "position"))
    feed = trainer.parts.feed
    feed.next_step(4, 1)
    assert feed.state_dict() == {"prompts_read": 2}
    feed.load_state_dict({"prompts_read": 6})
    assert feed.order.prompts_read == 6 and not feed.pending
    for bad in ({"rows_read": 3}, {"prompts_read": -1}, {"prompts_read": True}, []):
        with pytest.raises(DataError, match="prompts_read"):
            feed.load_state_dict(bad)


def test_token_logp_and_entropy_are_numpys():
    logits = np.random.default_rng(0).normal(0, 3, 50).astype(np.float32)
    for temperature in (1.0, 0.7):
        scaled = logits.astype(np.float64) / temperature
        probs = np.exp(scaled) / np.exp(scaled).sum()
        for token in (0, 17, 49):
            logp, entropy = token_logp(logits, token, temperature)
            assert logp == pytest.approx(np.log(probs[token]), rel=1e-12)
            assert entropy == pytest.approx(-(probs * np.log(probs)).sum(), rel=1e-12)


@pytest.mark.parametrize("overrides, message", [
    (["training.rewards=[]"], "name at least one"),
    (["training.rl_group_size=1"], "at least 2"),
    (["training.rl_group_size=3"], "whole groups"),
    (["training.rl_temperature=0"], r"rl\.temperature"),
    (["training.rl_max_new_tokens=40"], "leave room"),
    (["parallel.tensor_parallel_degree=2", "parallel.sequence_parallel=true", "parallel.moe_group=mp"],
     "sequence parallelism"),
    (["training.token_balance_loss=true"], "token_balance_loss"),
    (["training.rl_importance_cap=1"], r"rl\.importance_cap"),
    (["training.rl.importance_cap=.inf"], r"rl\.importance_cap"),
    (["training.rl_importance_correction=tis", "training.rl_updates_per_rollout=2"], "router_replay=old_policy"),
    (["model.num_nextn_predict_layers=1", "training.rl_train_mtp=false"], r"training\.rl\.train_mtp=true"),
])
def test_grpo_settings_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(ROOT / "configs" / "vl_moe.yaml", [*GRPO, *overrides])


def test_router_replay_off_reads_as_written_in_yaml(tmp_path):
    path = tmp_path / "rl.yaml"
    path.write_text("training:\n  stage: grpo\n  rewards: [exact_match]\n  router_replay: off\n")
    assert load_config(path, []).training.router_replay == "off"


def test_the_memory_planner_counts_the_rollout(tmp_path):
    """The decoding's key/value cache (keys and values of every layer for a rollout's rows at full length), the rows
    kept for the rollout's updates (log-probabilities, and the routes under replay), and a KL reference copy."""
    from ernie_moe.memory.estimate import estimate, sample_workload
    from ernie_moe.moe.replay import moe_layer_ids

    def stage(*overrides):
        cfg = grpo_cfg(tmp_path, "plan", *overrides)
        return estimate(cfg, sample_workload(cfg, 1), 1)[0], cfg

    sft, _ = stage("training.stage=sft", "training.rewards=[]")
    one, cfg = stage()
    m = cfg.model
    assert sft.rollout == 0 and one.rollout == 2 * 4 * 4 * 40 * m.num_hidden_layers * m.num_key_value_heads * m.head_dim
    assert one.total >= sft.total - sft.inputs + one.inputs
    two, _ = stage("training.rl_updates_per_rollout=2")
    unreplayed, _ = stage("training.router_replay=off")
    old_policy, _ = stage("training.router_replay=old_policy")
    assert two.inputs == pytest.approx(2 * one.inputs) and two.rollout == 2 * one.rollout
    # int32 routes per row and position, kept by either replay
    assert one.inputs - unreplayed.inputs == 4 * 40 * 4 * len(moe_layer_ids(m)) * m.moe_k
    assert old_policy.inputs == one.inputs
    tied, _ = stage("training.rl_kl_beta=0.05")
    assert one.reference == 0 and tied.reference > 0


def scattered(answer: str, reference: str) -> float:
    """A reward under which two different answers almost never tie."""
    return sum(ord(c) * (i + 1) for i, c in enumerate(answer)) % 997 / 997


def blind_to_rings(answer: str, reference: str) -> float:
    """A reward every answer to a ring's picture gets alike (its groups carry no advantage)."""
    return 0.5 if "ring" in reference else float(len(answer) % 5)


def every_answer_alike(answer: str, reference: str) -> float:
    """A reward no answer can move: every group scores alike."""
    return 0.25


def test_a_run_whose_groups_all_score_alike_says_so_and_where_its_answers_are(tmp_path, capsys):
    """The equal-reward warning fires in a real run (the monitor hands the alerts the rollouts' figures), the
    progress bar's loss is the policy's, and the summary points to rollouts.jsonl."""
    from ernie_moe.monitor.monitor import progress_figures

    trainer = Trainer(grpo_cfg(tmp_path, "alike", "training.rewards=[test_grpo:every_answer_alike]",
                               "logging.logging_steps=1"))
    summary = trainer.train()
    out = capsys.readouterr().out
    assert "WARNING step 1: 100% of the rollout groups scored every answer alike (mean reward 0.250)" in out
    assert "the task is too hard" in out and out.count("scored every answer alike") == 1  # said once
    assert summary["rollouts"] == str(tmp_path / "alike" / "rollouts.jsonl")
    import runpy

    format_summary = runpy.run_path(str(ROOT / "run_trainer.py"))["format_summary"]
    line = format_summary({**summary, "eval_bench/where": 0.5, "eval_bench/where/category/ring": 1.0})
    assert line.endswith(f"eval_bench/where 0.5000 | model saved to {tmp_path / 'alike' / 'final_model'} | "
                         f"sampled answers in {tmp_path / 'alike' / 'rollouts.jsonl'}")
    records = [json.loads(line) for line in (tmp_path / "alike" / "metrics.jsonl").read_text().splitlines()]
    window = [r for r in records if "loss" in r][-1]
    shown = progress_figures(window)["loss"]
    assert float(shown) == pytest.approx(window["rl/loss"] + window["router_loss"], abs=1e-4)


def test_dynamic_sampling_drops_groups_whose_answers_all_score_the_same(tmp_path):
    """DAPO's dynamic sampling: groups with equal rewards are counted and replaced by groups of further prompts,
    so every group trained on has an advantage; without it they are kept."""
    reward = "training.rewards=[test_grpo:blind_to_rings]"
    for dynamic in (True, False):
        trainer = Trainer(grpo_cfg(tmp_path, f"dynamic_{dynamic}", reward,
                                   f"training.rl_dynamic_sampling={str(dynamic).lower()}"))
        rows = trainer.parts.feed._rollout(16)
        equal = [np.all(np.array([float(r.inputs["advantages"]) for r in rows[i:i + 2]]) == 0) for i in range(0, 16, 2)]
        window = trainer.parts.feed.figures.window
        assert window["equal_groups"] > 0
        if dynamic:
            assert not any(equal) and window["groups"] > 8 and trainer.parts.feed.order.prompts_read > 8
        else:
            assert any(equal) and window["groups"] == 8 and trainer.parts.feed.order.prompts_read == 8


@pytest.mark.slow
def test_grpo_raises_the_reward_of_a_weak_captioner(tmp_path):
    """A 300-step supervised run captions about half of the caption words right; 400 GRPO steps from it (8 answers
    to each of 8 prompts a step, the words-right reward) raise the held-out reward of its greedy captions from
    about 0.70 to about 0.78 (the README's table), and its held-out caption accuracy with it."""
    common = ["logging.progress_bar=false", "data.num_eval_samples=64", *EARLIER_DEFAULT]
    Trainer(load_config(ROOT / "configs" / "vl_moe.yaml", [
        *common, "training.max_steps=300", "training.eval_steps=0", f"training.output_dir={tmp_path / 'sft'}"])).train()
    Trainer(load_config(ROOT / "configs" / "vl_moe.yaml", [
        *common, "training.stage=grpo", f"training.model_name_or_path={tmp_path / 'sft' / 'final_model'}",
        "training.rewards=[word_accuracy]", "training.rl_group_size=8", "training.per_device_train_batch_size=64",
        "training.max_steps=400", "training.learning_rate=1e-3", "training.min_lr=1e-4", "training.warmup_steps=10",
        "training.eval_steps=25", "training.eval_generate=true", "training.eval_generate_samples=64",
        f"training.output_dir={tmp_path / 'grpo'}"])).train()
    curve = [json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    reward = [r["eval_generate_reward"] for r in curve if "eval_generate_reward" in r]
    accuracy = [r["eval_caption_accuracy"] for r in curve if "eval_caption_accuracy" in r]
    print("held-out reward every 25 steps:", [round(r, 3) for r in reward])
    assert np.mean(reward[-3:]) > reward[0] + 0.03 and np.mean(accuracy[-3:]) > accuracy[0] + 0.03
    sampled = [r["rollout/reward"] for r in curve if "rollout/reward" in r]
    assert np.mean(sampled[-5:]) > np.mean(sampled[:5])


# one process and the layouts' launches: 4 steps, 2 optimizer steps per rollout of 8 global rows, KL to the
# reference, replayed routing, the host reads counted
LAUNCHED = ["data.max_seq_len=40", "training.max_steps=4", "logging.logging_steps=1", "training.eval_steps=4",
            "data.num_eval_samples=4", "training.stage=grpo", "training.rewards=[word_accuracy]",
            "training.rl_group_size=2", "training.rl_updates_per_rollout=2",
            "training.rl_kl_beta=0.05", "training.rl_loss=gspo", "training.rl_clip_low=0.05",
            "training.rl_clip_high=0.05", "logging.count_host_reads=true", "model.global_aux_loss=true"]
# name: (processes, data ranks, overrides, overrides shared with one process); a pipeline accumulates micro-batches
# and is compared with one process accumulating the same ones (the router losses' statistics are per micro-batch)
ACCUMULATE = ("training.gradient_accumulation_steps=2",)
LAUNCH_LAYOUTS = {"dp2": (2, 2, [], ()),
                  "dp2_lora": (2, 2, [], ("training.fine_tuning=lora", "training.lora_rank=4")),
                  "dp2_lora_wint8": (2, 2, [], ("training.fine_tuning=lora", "training.lora_rank=4",
                                                "training.quantize_base=wint8")),
                  "sharding2": (2, 2, ["parallel.sharding_parallel_degree=2", "parallel.sharding=stage1"], ()),
                  # the rollouts sampled with each decoder layer gathered as it runs
                  "sharding2_stage3": (2, 2, ["parallel.sharding_parallel_degree=2", "parallel.sharding=stage3"],
                                       ()),
                  "tp2": (2, 1, ["parallel.tensor_parallel_degree=2"], ()),
                  "tp2_moe_mp": (2, 1, ["parallel.tensor_parallel_degree=2", "parallel.moe_group=mp"], ()),
                  "ep2": (2, 2, ["parallel.expert_parallel_degree=2"], ()),
                  "pp2": (2, 1, ["parallel.pipeline_parallel_degree=2"], ACCUMULATE),
                  "pp2_recompute": (2, 1, ["parallel.pipeline_parallel_degree=2", "training.recompute=true"],
                                    ACCUMULATE),
                  "tp2_pp2": (4, 1, ["parallel.tensor_parallel_degree=2", "parallel.pipeline_parallel_degree=2"],
                              ACCUMULATE),
                  # the multi-token prediction depth trained on the rollouts' answers beside the policy
                  "ep2_mtp": (2, 2, ["parallel.expert_parallel_degree=2"], ("model.num_nextn_predict_layers=1",)),
                  # the sampler's log-probabilities carried beside the old policy's to the last stage's correction
                  "pp2_old_policy_tis": (2, 1, ["parallel.pipeline_parallel_degree=2"],
                                         (*ACCUMULATE, "training.router_replay=old_policy",
                                          "training.rl_importance_correction=tis"))}


def tensors(folder) -> dict:
    return {name: value for path in sorted(folder.glob("*.safetensors")) for name, value in load_file(path).items()}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A short supervised run's model: the start of the launched runs (LoRA adapts it)."""
    out = tmp_path_factory.mktemp("base")
    Trainer(load_config(ROOT / "configs" / "vl_moe.yaml", [
        *SMALL, "data.max_seq_len=40", "training.max_steps=20", "training.eval_steps=0",
        f"training.output_dir={out}"])).train()
    return out / "final_model"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, base):
    """The single-process runs, one per set of shared overrides (LoRA, accumulation), each made once."""
    runs = {}

    def get(shared: tuple[str, ...]):
        if shared not in runs:
            rows = 4 // (2 if ACCUMULATE[0] in shared else 1)
            runs[shared], _ = launch(tmp_path_factory.mktemp("one"), 1, *LAUNCHED,
                                     f"training.model_name_or_path={base}", *shared,
                                     f"training.per_device_train_batch_size={rows}", name="one")
        return runs[shared]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAUNCH_LAYOUTS))
def test_a_grpo_layout_equals_one_process(tmp_path, base, one_process, layout):
    """Data ranks each sampling their share of every rollout, tensor-parallel ranks sampling in step from the
    gathered vocabulary, expert-parallel ranks decoding in step while any of them still decodes, pipeline stages
    decoding stage by stage and replaying the routes in the schedule's order (through recomputes too): the same
    rollouts (rewards, answer lengths), losses, KL, ratios, clip fractions, gradient norms and trained weights as
    one process over the whole batch; every host read a step makes is a declared one."""
    from support.runs import records

    from ernie_moe.host_reads import DECLARED

    nproc, data_ranks, overrides, shared = LAUNCH_LAYOUTS[layout]
    one = one_process(shared)
    rows = 4 // data_ranks // (2 if ACCUMULATE[0] in shared else 1)
    two, _ = launch(tmp_path, nproc, *LAUNCHED, f"training.model_name_or_path={base}", *shared, *overrides,
                    f"training.per_device_train_batch_size={rows}", name="two")
    runs = [[r for r in records(out) if "loss" in r] for out in (one, two)]
    assert len(runs[1]) == 4
    for key in ("loss", "rl/loss", "rl/kl", "rl/clip_fraction", "rl/ratio", "rl/response_length", "rollout/reward",
                "grad_norm", "rl/mismatch_k3", "rl/mismatch_max_ratio", "rl/corrected"):
        ours, theirs = ([r.get(key, np.nan) for r in run] for run in runs)  # rollout/: the steps that sampled
        np.testing.assert_allclose(theirs, ours, rtol=1e-4, atol=1e-7, err_msg=key)
    assert [("rollout/reward" in r) for r in runs[0]] == [True, False, True, False]
    assert all(r["rl/mismatch_max_ratio"] >= 1.0 for run in runs for r in run)  # every step: a window of one
    if "model.num_nextn_predict_layers=1" in shared:
        depth = [[r["mtp/depth1_loss"] for r in run] for run in runs]
        np.testing.assert_allclose(depth[1], depth[0], rtol=1e-4)
        assert depth[0][-1] < depth[0][0]  # it learns the answers
    assert runs[0][1]["rl/kl"] > 0 and runs[0][1]["rl/ratio"] != 1.0  # the second update of a rollout moved
    a, b = (tensors(out / "final_model") for out in (one, two))  # the model, or LoRA's adapter
    assert a and set(a) == set(b)
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=1e-4, atol=1e-5, err_msg=name)
    for out in (one, two):
        for counted in json.loads((out / "summary.json").read_text())["host_reads"]["per_rank"]:
            assert counted["undeclared"] == {} and set(counted["declared"]) <= set(DECLARED)
            assert counted["declared"]["decoding"] > 0  # the steps that sampled a rollout


def test_a_grpo_run_resumes_at_its_next_prompts(tmp_path):
    """A checkpoint keeps the rollout position; a resumed run samples from the next prompts on and finishes."""
    first = Trainer(grpo_cfg(tmp_path, "resumed"))
    first.train()
    assert first.parts.feed.order.prompts_read == 4  # two steps of 2 prompts each
    again = Trainer(grpo_cfg(tmp_path, "resumed", "training.max_steps=3", "training.resume_from_checkpoint=auto"))
    assert again.step == 2 and again.parts.feed.order.prompts_read == 4
    summary = again.train()
    assert summary["status"] == "done" and again.parts.feed.order.prompts_read == 6
    # each logging window's first groups in rollouts.jsonl, the resumed run's after the first run's up to its step
    shown = [json.loads(line) for line in (tmp_path / "resumed" / "rollouts.jsonl").read_text().splitlines()]
    assert [g["step"] for g in shown] == [2, 2, 3, 3] and all(len(g["answers"]) == 2 for g in shown)


@pytest.mark.parametrize("thinking", [None, True, False])
def test_a_conversation_is_asked_without_its_answer_as_generation_opens_the_turn(tmp_path, thinking):
    """A conversation's prompt is its messages before the last answer with the assistant's turn opened as
    generation opens it: left open for the Thinking model where thinking is asked or not said, with the empty think
    block where it is turned off (a training encoding would put that block in every prompt); the answer's text is
    the reference. An answer holding an image is a counted skip."""
    from support.ernie import make_ernie_tokenizer

    from ernie_moe.data.encoding.packing import BadSample, Encoder
    from ernie_moe.data.feeding.loader import build_tokenizer
    from ernie_moe.data.formats.chat import Conversation
    from ernie_moe.data.formats.sample import Sample
    from ernie_moe.training.rollouts import asked

    make_ernie_tokenizer(tmp_path / "tok")
    cfg = load_config(None, [f"data.tokenizer_path={tmp_path / 'tok'}", "model.vocab_size=400"])
    tokenizer = build_tokenizer(cfg)
    encoder = Encoder(tokenizer, cfg.model, 1024, "skip", 448, Counter())
    messages = [{"role": "user", "content": [{"type": "text", "text": "Why?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "Because."}]}]
    prompt = asked(Sample(conversation=Conversation(messages, enable_thinking=thinking)), encoder, tokenizer, 7)
    opened = "Assistant: " + ("<think>\n\n</think>\n\n" if thinking is False else "")
    assert tokenizer.decode(prompt.encoded.input_ids) == f"<|begin_of_sentence|>User: Why?\n{opened}"
    assert prompt.reference == "Because." and prompt.slot == 7
    pictured = [messages[0], {"role": "assistant", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}]
    with pytest.raises(BadSample, match="image or a video"):
        asked(Sample(conversation=Conversation(pictured)), encoder, tokenizer, 0)
