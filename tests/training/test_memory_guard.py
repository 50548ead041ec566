"""The memory guard: more recompute, then smaller micro-batches, when memory runs short; nothing is lost."""

import re

import numpy as np
import paddle
import pytest
from support.models import make_layer
from support.runs import ROOT, SAME_LOSS, launch, records, same_loss_trainer

from ernie_moe.config import load_config
from ernie_moe.memory.estimate import estimate, kept_copies, sample_workload
from ernie_moe.memory.report import report


@pytest.mark.slow
def test_a_low_limit_steps_down_the_ladder_and_the_losses_stay(tmp_path):
    """An artificially low limit (half of 16 MiB): recompute moe, core_attn, full_attn, full, then 4 x 2."""
    plain, _ = launch(tmp_path, 1, *SAME_LOSS, "training.memory_guard_fraction=0", name="plain")
    guarded, log = launch(tmp_path, 1, *SAME_LOSS, "training.device_memory_gb=0.016",
                          "training.memory_guard_fraction=0.5", name="guarded")
    # the launcher's output and the worker log both hold each line
    changes = dict.fromkeys(re.findall(r"memory guard: step (\d) passed 50% of the device's memory: (.*)", log))
    assert [c for _, c in changes] == ["recompute moe", "recompute core_attn", "recompute full_attn", "recompute full",
                                       "micro-batch 4 x 2 accumulated"]
    a, b = ([r for r in records(out) if "loss" in r] for out in (plain, guarded))
    assert [r["memory_guard_rungs"] for r in b] == [1, 1, 1, 1, 1, 0, 0, 0]
    np.testing.assert_allclose([r["loss"] for r in b], [r["loss"] for r in a], rtol=1e-5)
    peaks = [r["memory/max_rank_max_allocated_gb"] for r in b]
    assert peaks[-1] < 0.8 * max(peaks[1:5])


def out_of_memory_on(tr, calls: set):
    real, seen = tr.forward_backward, []

    def forward_backward(micro_batches):
        seen.append(len(micro_batches))
        if len(seen) in calls:
            raise MemoryError("out of memory (injected)")
        return real(micro_batches)

    tr.forward_backward = forward_backward
    return seen


def test_an_out_of_memory_step_runs_again_on_the_next_rungs(tmp_path):
    expected = same_loss_trainer(tmp_path / "plain")
    expected.train_step()
    tr = same_loss_trainer(tmp_path / "oom", "training.recompute=true", "training.recompute_granularity=full")
    seen = out_of_memory_on(tr, {1})  # the ladder's last recompute rung is on: the micro-batch halves
    result = tr.train_step()
    assert result.memory_guard_rungs == 1 and seen == [1, 2]  # one micro-batch, then two halves
    assert (tr.parts.state.micro_batch_size, tr.parts.state.accumulation_steps) == (2, 2)
    assert (tr.cfg.training.per_device_train_batch_size, tr.cfg.training.gradient_accumulation_steps) == (4, 1)
    assert tr.parts.guard.taken == ["out of memory in step 0: micro-batch 2 x 2 accumulated"]
    pairs = zip(expected.parts.model.stable_named_parameters(), tr.parts.model.stable_named_parameters())
    for (name, a), (_, b) in pairs:
        # summation order differs between one micro-batch and two; a lost or doubled one moves weights by ~1e-4
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


def test_out_of_memory_with_no_rung_left_is_raised(tmp_path):
    tr = same_loss_trainer(tmp_path, "training.recompute=true", "training.recompute_granularity=full",
                 "training.per_device_train_batch_size=1")
    out_of_memory_on(tr, {1, 2, 3})
    with pytest.raises(MemoryError, match="injected"):
        tr.train_step()


@pytest.mark.slow
def test_the_capacity_rung_comes_first_drops_tokens_for_a_while_then_recompute(tmp_path):
    """The same low limit with training.memory_guard_capacity: the experts' capacity tightens for two steps,
    dropping routed tokens (counted), before recompute rises; then the configured (dropless) capacity returns."""
    out, log = launch(tmp_path, 1, *SAME_LOSS, "training.device_memory_gb=0.016", "training.memory_guard_fraction=0.5",
                      "training.memory_guard_capacity=0.5", "training.memory_guard_capacity_steps=2", name="capacity")
    changes = list(dict.fromkeys(re.findall(r"memory guard: (.*)", log)))
    assert changes[:4] == ["step 1 passed 50% of the device's memory: expert capacity 0.5 until step 3",
                           "step 2 passed 50% of the device's memory: recompute moe",
                           "step 3 passed 50% of the device's memory: recompute core_attn",
                           "the configured expert capacity is back"]
    dropped = [r["moe/layer1_text/dropped_frac"] + r["moe/layer1_vision/dropped_frac"]
               for r in records(out) if "loss" in r]
    assert dropped[0] == 0 and dropped[1] > 0 and dropped[2] > 0  # steps 2 and 3 run under the rung
    assert dropped[3] == 0 or "step 4" in changes[4]  # dropless again unless step 4 takes the rung anew


def test_the_planner_keeps_the_copies_the_layers_capacity_allows():
    """Under a capacity factor the planner's kept copies per expert group are the layer's own capacities (text
    only, and mixed with image tokens), capped by what is routed; the layer keeps no more than that."""
    layer, cfg = make_layer("model.moe_capacity=[0.6, 0.6, 0.6]")
    layer.train()
    n, k = 40, cfg.moe_k
    kept = []
    layer.stats.record_routing = lambda routed_counts, kept_counts: kept.append(int(kept_counts.sum()))
    for types in (np.zeros([1, n], dtype="int64"), (np.arange(n) % 3 == 0).astype("int64")[None]):
        x = paddle.to_tensor(np.random.default_rng(0).standard_normal((1, n, 16)).astype("float32"))
        groups = [paddle.nonzero(paddle.to_tensor(types.reshape(-1) == m)).flatten() for m in (0, 1)]
        capacity = np.array(layer._capacities(groups))
        image = int(types.sum())
        routed = [(n - image, cfg.moe_num_experts[0], 8), (image, cfg.moe_num_experts[1], 6)]
        text_experts = cfg.moe_num_experts[0]
        want = [min((n - image) * k, capacity[:text_experts].sum()), min(image * k, capacity[text_experts:].sum())]
        assert kept_copies(cfg, routed, 0.6, n) == want
        assert sum(want) < sum(kept_copies(cfg, routed, None, n))  # the factor drops copies here
        kept.clear()
        layer(x, paddle.to_tensor(types))
        assert kept[0] <= sum(want)


def test_the_planner_reports_what_the_capacity_rung_saves():
    cfg = load_config(ROOT / "configs" / "vl_moe.yaml", ["training.memory_guard_capacity=0.5"])
    text, _ = report(cfg, 1, 80.0, run_search=False)
    found = re.search(r"capacity rung \(factor 0.5\): busiest stage ([\d.]+) MiB, ([\d.]+) MiB less", text)
    assert found, text
    workload = sample_workload(cfg, 1)
    dropless, tighter = (max(s.total for s in estimate(cfg, workload, 1, c)) for c in (None, 0.5))
    assert float(found[2]) == pytest.approx((dropless - tighter) / 2 ** 20, abs=0.05) and tighter < dropless
