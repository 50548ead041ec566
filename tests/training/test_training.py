import math

import numpy as np
import paddle
import pytest
from support.runs import ROOT

from ernie_moe.config import load_config
from ernie_moe.model.ernie_vl import ErnieMoEForConditionalGeneration
from ernie_moe.training.optimizer import build_optimizer, clip_gradients, gradient_norms
from ernie_moe.training.schedule import WarmupDecay, lr_at


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant", "wsd"])
def test_schedules(kind):
    peak, low, warm, total = 1e-3, 1e-4, 10, 110
    lrs = [lr_at(s, peak, low, warm, total, kind, 0.2) for s in range(total)]
    np.testing.assert_allclose(lrs[:warm], peak * np.arange(1, warm + 1) / warm)
    after = np.arange(warm, total)
    progress = np.minimum(1.0, (after - warm) / (total - warm))
    expected = {
        "cosine": low + (peak - low) * 0.5 * (1 + np.cos(np.pi * progress)),
        "linear": low + (peak - low) * (1 - progress),
        "constant": np.full(len(after), peak),
        "wsd": np.where(after < 88, peak, low + (peak - low) * (1 - (after - 88) / 22)),
    }[kind]
    np.testing.assert_allclose(lrs[warm:], expected, rtol=1e-9)


def test_scheduler_follows_lr_at():
    cfg = load_config(None, ["training.max_steps=50", "training.warmup_steps=5"]).training
    scheduler = WarmupDecay(cfg)
    seen = []
    for _ in range(50):
        seen.append(scheduler.get_lr())
        scheduler.step()
    expected = [lr_at(s, cfg.learning_rate, cfg.min_lr, 5, 50, "cosine", cfg.wsd_decay_ratio) for s in range(50)]
    np.testing.assert_allclose(seen, expected)


def test_parameter_groups():
    cfg = load_config(None, ["training.moe_gate_lr_ratio=0.01", "model.moe_use_aux_free=true"])
    model = ErnieMoEForConditionalGeneration(cfg.model)
    optimizer, _ = build_optimizer(model, cfg.training)
    params = dict(model.named_parameters())
    managed = {p.name for p in optimizer._parameter_list}
    assert params["model.layers.1.mlp.moe_statics.e_score_correction_bias"].name not in managed
    decay = optimizer._apply_decay_param_fun
    assert decay(params["model.layers.0.self_attn.qkv_proj.weight"].name)
    assert not decay(params["model.layers.0.input_layernorm.weight"].name)
    assert not decay(params["vision_model.blocks.0.attn.qkv.bias"].name)
    assert params["model.layers.1.mlp.gate.weight_1"].optimize_attr["learning_rate"] == 0.01
    assert params["model.layers.1.mlp.experts.0.down_proj.weight"].optimize_attr["learning_rate"] == 1.0


def test_gradient_norms_and_clipping_match_numpy():
    a = paddle.create_parameter([3, 4], "float32")
    b = paddle.create_parameter([5], "float32")
    ga, gb = np.random.default_rng(0).standard_normal((3, 4)), np.random.default_rng(1).standard_normal(5)
    loss = paddle.sum(a * paddle.to_tensor(ga, dtype="float32")) + paddle.sum(b * paddle.to_tensor(gb, dtype="float32"))
    loss.backward()
    groups = {"expert": [a], "non_expert": [b]}
    norms = {name: float(norm) for name, norm in gradient_norms(groups).items()}
    expected = math.sqrt((ga ** 2).sum() + (gb ** 2).sum())
    assert norms["grad_norm"] == pytest.approx(expected, rel=1e-5)
    assert norms["grad_norm_expert"] == pytest.approx(math.sqrt((ga ** 2).sum()), rel=1e-5)
    assert norms["grad_norm_non_expert"] == pytest.approx(math.sqrt((gb ** 2).sum()), rel=1e-5)
    clip_gradients(groups, max_norm=2 * expected, grad_norm=expected)  # within the limit: left as they are
    np.testing.assert_array_equal(a.grad.numpy(), ga.astype("float32"))
    clip_gradients(groups, max_norm=1.0, grad_norm=norms["grad_norm"])
    clipped = math.sqrt(float((a.grad ** 2).sum()) + float((b.grad ** 2).sum()))
    assert clipped == pytest.approx(1.0, rel=1e-4)


def test_config_reference_page_is_current():
    from ernie_moe.config.reference import reference

    page = (ROOT / "docs" / "config.md").read_text()
    assert page == reference(), "docs/config.md is stale: python -m ernie_moe.config.reference > docs/config.md"


def test_readme_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci in (ROOT / "README.md").read_text()


def test_a_step_is_three_frames_from_the_loop_to_the_runner(tmp_path):
    """What a reader follows: the loop calls train_step, which calls forward_backward, which calls the runner."""
    import inspect

    from support.runs import SMALL

    from ernie_moe.training import Trainer

    trainer = Trainer(load_config(ROOT / "configs" / "vl_moe.yaml", [
        *SMALL, "training.max_steps=1", "training.eval_steps=0", "training.save_steps=0", "logging.visualdl=false",
        f"training.output_dir={tmp_path}"]))
    real, seen = trainer.parts.runner.forward_backward, []

    def forward_backward(*args, **kwargs):
        names = [frame.function for frame in inspect.stack()[1:]]
        seen.append(names[: names.index("_train") + 1])
        return real(*args, **kwargs)

    trainer.parts.runner.forward_backward = forward_backward
    trainer.train()
    assert seen == [["forward_backward", "train_step", "_train"]]
