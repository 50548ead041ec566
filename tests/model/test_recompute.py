"""Activation recompute: the same gradients and statistics as without it, and less memory held for backward."""

import numpy as np
import paddle
import pytest
from support.runs import ROOT, launch, load_model, records

import ernie_moe.nn.recompute as recompute_module
from ernie_moe.config import ConfigError, load_config
from ernie_moe.model.recompute import selected_layers
from ernie_moe.training import Trainer

SMALL = ["data.image_size=56", "data.max_seq_len=48", "training.per_device_train_batch_size=2",
         "logging.visualdl=false", "model.moe_use_aux_free=true"]


def trainer(tmp_path, *overrides):
    cfg = load_config(ROOT / "configs" / "vl_moe.yaml", [*SMALL, f"training.output_dir={tmp_path}", *overrides])
    return Trainer(cfg)


def gradients_and_usage(tmp_path, *overrides):
    """One step's gradients (two micro-batches) and the expert usage counted by the MoE layers."""
    tr = trainer(tmp_path, "training.gradient_accumulation_steps=2", *overrides)
    tr.forward_backward(tr.next_micro_batches())
    grads = {name: p.grad.numpy().copy() for name, p in tr.parts.model.stable_named_parameters() if p.grad is not None}
    usage = [moe.stats.pop_usage().numpy() for moe in tr.parts.model.moe_layers()]
    return grads, usage


@pytest.fixture(scope="module")
def without(tmp_path_factory):
    return gradients_and_usage(tmp_path_factory.mktemp("plain"))


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("granularity", ["full", "full_attn", "core_attn", "moe"])
def test_recompute_gives_the_gradients_and_counts_of_the_plain_run(tmp_path, without, monkeypatch, granularity,
                                                                   reentrant):
    calls = []
    real = recompute_module.recompute
    monkeypatch.setattr(recompute_module, "recompute", lambda *a, **k: calls.append(k) or real(*a, **k))
    grads, usage = gradients_and_usage(tmp_path, "training.recompute=true",
                                       f"training.recompute_granularity={granularity}",
                                       f"training.recompute_use_reentrant={str(reentrant).lower()}")
    # the default config's layer 1 is its only MoE layer; full and full_attn recompute the 2 ViT blocks too
    blocks = {"moe": 1, "core_attn": 2, "full_attn": 2 + 2, "full": 2 + 2}[granularity]
    assert len(calls) == blocks * 2 and all(k["use_reentrant"] == reentrant for k in calls)  # 2 micro-batches
    base, _ = without
    assert set(grads) == set(base)
    for name, g in grads.items():
        assert np.linalg.norm(g - base[name]) <= 1e-6 * np.linalg.norm(base[name]) + 1e-12, name
    # routing statistics count the forward pass once, not again when the backward pass recomputes it
    for a, b in zip(usage, without[1]):
        np.testing.assert_array_equal(a, b)


def test_recompute_layers_picks_the_layers(tmp_path):
    assert selected_layers(0, 4) == {0, 1, 2, 3} and selected_layers(2, 4) == {0, 1} and selected_layers([3], 4) == {3}
    tr = trainer(tmp_path, "training.recompute=true", "training.recompute_granularity=core_attn",
                 "training.recompute_layers=[1]")
    assert [layer.recompute for layer in tr.parts.model.decoder_layers()] == [None, "core_attn"]
    assert [layer.self_attn.recompute_core for layer in tr.parts.model.decoder_layers()] == [False, True]
    with pytest.raises(ConfigError, match="recompute_layers"):
        load_config(None, ["training.recompute_layers=[5]"])


def test_peak_memory_falls_in_the_expected_order(tmp_path):
    """Allocator peak of one forward + backward (8 layers, 8 rows of 256 tokens): what each granularity keeps
    for the backward pass decides the peak."""
    core = paddle.base.core

    def peak(*overrides):
        tr = trainer(tmp_path, "data.max_seq_len=256", "training.per_device_train_batch_size=8",
                     "model.num_hidden_layers=8", *overrides)
        batch = tr.next_micro_batches()[0]
        base = core.host_memory_stat_current_value("Allocated", 0)
        core.host_memory_stat_reset_peak_value("Allocated", 0)
        out = tr.parts.model(batch)
        (out.loss_sum + out.router_loss).backward()
        return core.host_memory_stat_peak_value("Allocated", 0) - base

    plain = peak()
    peaks = [peak("training.recompute=true", f"training.recompute_granularity={g}")
             for g in ("moe", "core_attn", "full_attn", "full")]
    assert plain > peaks[0] > peaks[1] > peaks[2] > peaks[3], (plain, peaks)
    assert peaks[3] < 0.5 * plain


@pytest.mark.parametrize("layout, granularity", [("tp2", "full"), ("pp2", "full_attn")])
@pytest.mark.slow
def test_recompute_under_tensor_and_pipeline_parallelism_changes_nothing(tmp_path, layout, granularity):
    """The same layout with and without recompute, launched on 2 processes: same gradients, losses, weights."""
    overrides = {"tp2": ["parallel.tensor_parallel_degree=2"],
                 "pp2": ["parallel.pipeline_parallel_degree=2", "training.gradient_accumulation_steps=2"]}[layout]
    # adam_epsilon 1e-6: AdamW turns float noise in near-zero gradients into full-size updates otherwise
    common = ["training.max_steps=3", "logging.logging_steps=1", "training.eval_steps=0", "data.num_eval_samples=0",
              "training.adam_epsilon=1e-6", *overrides]
    plain, _ = launch(tmp_path, 2, *common, name="plain")
    recomputed, _ = launch(tmp_path, 2, *common, "training.recompute=true",
                           f"training.recompute_granularity={granularity}", name="recomputed")
    a, b = ([r for r in records(out) if "loss" in r] for out in (plain, recomputed))
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in b], [r[key] for r in a], rtol=1e-6, err_msg=key)
    wa, wb = load_model(plain / "final_model"), load_model(recomputed / "final_model")
    for name in wa:
        np.testing.assert_allclose(wb[name], wa[name], rtol=1e-5, atol=1e-6, err_msg=name)
