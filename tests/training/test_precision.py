"""Mixed-precision plumbing on the CPU: loss scaling, skipped non-finite steps, float32 routers and norms.

Paddle has no low-precision matmul kernels on the CPU (autocast and the O2 cast leave float32 there), so
these tests check the arithmetic around them; the numerics of bf16 / fp16 need a GPU.
"""

import json

import numpy as np
import paddle
import pytest
from support.runs import ROOT, poison_gradients

from ernie_moe.config import load_config
from ernie_moe.moe.router import Router
from ernie_moe.nn.layers import RMSNorm
from ernie_moe.training import Trainer
from ernie_moe.training.precision import FLOAT32_LAYERS, NonFiniteGradients, Precision

SMALL = ["data.image_size=56", "data.max_seq_len=48", "training.per_device_train_batch_size=2",
         "logging.visualdl=false", "logging.logging_steps=1", "training.eval_steps=0", "data.num_eval_samples=4"]


def trainer(tmp_path, *overrides):
    return Trainer(load_config(ROOT / "configs" / "vl_moe.yaml", [*SMALL, f"training.output_dir={tmp_path}",
                                                                   *overrides]))


def weights(tr) -> dict:
    return {name: p.numpy().copy() for name, p in tr.parts.model.stable_named_parameters()}


def test_fp16_loss_scaling_gives_the_float32_updates(tmp_path):
    """The loss is multiplied by the scale and the gradients divided by it before clipping: same steps."""
    plain = trainer(tmp_path / "fp32", "training.max_steps=3")
    scaled = trainer(tmp_path / "fp16", "training.max_steps=3", "training.fp16=true", "training.scale_loss=1024",
                     "training.fp16_opt_level=O1")
    for tr in (plain, scaled):
        tr.train()
    a, b = weights(plain), weights(scaled)
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=1e-5, atol=1e-6, err_msg=name)
    logged = {run: [r for r in map(json.loads, (tmp_path / run / "metrics.jsonl").read_text().splitlines())
                    if "loss" in r] for run in ("fp32", "fp16")}
    assert [r["loss_scale"] for r in logged["fp16"]] == [1024.0] * 3
    # the clipped and logged norm is that of the unscaled gradients
    np.testing.assert_allclose([r["grad_norm"] for r in logged["fp16"]], [r["grad_norm"] for r in logged["fp32"]],
                               rtol=1e-5)


def test_a_step_with_inf_gradients_is_skipped_counted_and_halves_the_scale(tmp_path, capsys):
    """The skipped step is said in one line naming the parts of the model whose gradients held inf (the poisoned
    weight's decoder layer), counted in the step's ``nonfinite`` figures (``nonfinite/<part>`` in the metrics)."""
    tr = trainer(tmp_path, "training.max_steps=4", "training.fp16=true", "training.scale_loss=1024")
    poison_gradients(tr, {2})
    tr.step = 1
    tr.train_step()
    before, lr_before = weights(tr), tr.parts.scheduler.last_epoch
    adam = tr.parts.optimizer._accumulators["moment1"]
    moments_before = {k: v.numpy().copy() for k, v in adam.items()}
    tr.step = 2
    capsys.readouterr()
    result = tr.train_step()
    assert result.skipped and result.grad_norm is None
    said = capsys.readouterr().out
    assert "step 2 skipped: inf or nan gradients in 1 tensor(s), layers.0 1 " in said, said
    assert "(first: model.layers.0.self_attn.o_proj.weight); loss scale now 512" in said, said
    assert result.nonfinite == {"layers.0": 1}
    metrics = tr.monitor.end_window(2, [result.read()], tr.parts.data_stats)
    assert metrics["nonfinite/layers.0"] == 1 and metrics["skipped_steps"] == 1
    after = weights(tr)
    for name in before:  # no update at all
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    for k, v in adam.items():
        np.testing.assert_array_equal(v.numpy(), moments_before[k])
    assert tr.parts.scheduler.last_epoch == lr_before
    assert tr.parts.precision.loss_scale == 512.0 and tr.parts.precision.skipped == 1
    tr.step = 3
    result = tr.train_step()  # the next finite step goes ahead
    assert not result.skipped and np.isfinite(result.grad_norm)
    assert any(not np.array_equal(after[n], v) for n, v in weights(tr).items())


def test_non_finite_steps_in_a_row_stop_training_before_saving(tmp_path):
    tr = trainer(tmp_path, "training.max_steps=8", "training.max_skipped_steps=3", "training.bf16=true")
    poison_gradients(tr, {2, 3, 4, 5})
    with pytest.raises(NonFiniteGradients, match=r"step 4: the gradients held inf or nan in 3 steps in a row"):
        tr.train()
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in logged if "loss" in r] == [0, 1, 1]
    assert not (tmp_path / "final_model").exists() and not list(tmp_path.glob("checkpoint-*"))


def test_routers_and_norms_compute_in_float32(monkeypatch):
    paddle.seed(0)
    router = Router(16, [4], k=2, gate_act="softmax", renormalize=True)
    x = paddle.randn([6, 16]).astype("bfloat16")
    with paddle.amp.auto_cast(enable=True, dtype="bfloat16", level="O2"):
        routing = router(x, paddle.arange(6), 0, None)
    assert routing.logits.dtype == paddle.float32 and routing.weights.dtype == paddle.float32
    expected = x.astype("float32").numpy() @ router.weight.numpy()
    np.testing.assert_allclose(routing.logits.numpy(), expected, rtol=1e-5, atol=1e-6)
    norm = RMSNorm(16, 1e-6)
    out = norm(x)
    h = x.astype("float32").numpy()
    reference = h / np.sqrt((h ** 2).mean(-1, keepdims=True) + 1e-6)
    assert out.dtype == paddle.bfloat16
    np.testing.assert_allclose(out.astype("float32").numpy(), reference, rtol=1e-2, atol=1e-2)
    # O2 leaves the float32 layers out of the cast
    seen = {}
    monkeypatch.setattr(paddle.amp, "decorate", lambda **kw: seen.update(kw))
    cfg = load_config(None, ["training.bf16=true"]).training
    Precision(cfg).cast_model("model")
    assert seen["level"] == "O2" and seen["dtype"] == "bfloat16" and seen["master_grad"] is True
    assert set(seen["excluded_layers"]) == set(FLOAT32_LAYERS) >= {Router, RMSNorm}
