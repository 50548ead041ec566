"""Paddle's GPU-only kernels (RMSNorm, rotary embedding, MoE combine), run here through stand-ins that compute
what Paddle documents and ERNIE relies on: the tables, position ids and slots this package builds for them, the
model's use of them on a GPU, the guard that keeps a kernel which fails or disagrees out of training, and the
doctor's check of each. Last, the math library's code path on a CPU."""

import os
import types
import warnings

import numpy as np
import paddle
import pytest
from test_model import first_batch

import ernie_moe.doctor.kernels as doctor
from ernie_moe.model import kernels
from ernie_moe.model.ernie_vl import ErnieMoEForConditionalGeneration
from ernie_moe.model.rope import apply_rotary, apply_rotary_half, rope_angles, vision_rope_angles
from ernie_moe.parallel import cpu_fallbacks


def documented_fused_rope(q, k=None, v=None, sin=None, cos=None, position_ids=None, use_neox_rotary_style=True,
                          time_major=False, rotary_emb_base=10000.0):
    """``paddle.incubate.nn.functional.fused_rotary_position_embedding`` on ``q``: ``q cos + rotate(q) sin`` with
    [seq, dim] tables read at ``position_ids [batch, seq]`` when given; the "neox" style pairs neighbours,
    the other halves."""
    x = q.astype("float32").numpy()
    dim = x.shape[-1]
    sin, cos = (t.astype("float32").numpy().reshape([-1, dim]) for t in (sin, cos))
    if position_ids is not None:
        sin, cos = sin[position_ids.numpy()], cos[position_ids.numpy()]
    sin, cos = sin.reshape([-1, x.shape[1], 1, dim]), cos.reshape([-1, x.shape[1], 1, dim])
    if use_neox_rotary_style:
        turned = np.stack([-x[..., 1::2], x[..., 0::2]], axis=-1).reshape(x.shape)
    else:
        turned = np.concatenate([-x[..., dim // 2:], x[..., : dim // 2]], axis=-1)
    return paddle.to_tensor(x * cos + turned * sin).astype(q.dtype), None, None


def documented_moe_combine(x, combine_weights, scatter_index):
    """``paddle.incubate.nn.functional.moe_combine``: ``out[t] = sum_s weight[t, s] * x[index[t, s]]``."""
    rows, weights, index = x.numpy(), combine_weights.numpy(), scatter_index.numpy()
    return paddle.to_tensor((weights[..., None] * rows[index]).sum(1))


def documented_moe_combine_grad(x, combine_weights, scatter_index, grad_y):
    """``_C_ops.moe_combine_grad`` as ERNIE's GateCombine uses it: the rows' gradient, and each slot's
    ``grad_y[t] * x[index[t, s]]`` row, which the caller sums over the hidden axis."""
    rows, weights, index, grad = x.numpy(), combine_weights.numpy(), scatter_index.numpy(), grad_y.numpy()
    grad_rows = np.zeros_like(rows)
    np.add.at(grad_rows, index.ravel(), (weights[..., None] * grad[:, None, :]).reshape(-1, rows.shape[1]))
    return paddle.to_tensor(grad_rows), paddle.to_tensor((grad[:, None, :] * rows[index]).reshape(-1, rows.shape[1]))


class Combine:
    def __init__(self):
        self.calls = 0

    def __call__(self, *args):
        self.calls += 1
        return documented_moe_combine(*args)


class Kernel:
    """A stand-in for Paddle's kernel that counts its calls, optionally off by ``error`` or raising."""

    def __init__(self, error=0.0, raises=False):
        self.calls, self.error, self.raises = 0, error, raises

    def __call__(self, q, **kwargs):
        self.calls += 1
        if self.raises:
            raise RuntimeError("(NotFound) The kernel `fused_rotary_position_embedding` is not registered.")
        out, _, _ = documented_fused_rope(q, **kwargs)
        return out + self.error, None, None


@pytest.fixture
def on_a_gpu(monkeypatch):
    """Tensors count as on a GPU; RMSNorm's fused kernel is its plain formula (Paddle's own needs AVX-512 here)."""
    monkeypatch.setattr(kernels, "_FUSED_WORKS", {})
    monkeypatch.setattr(kernels, "_is_gpu", lambda place: True)
    monkeypatch.setattr(doctor, "_on_gpu", lambda: True)
    monkeypatch.setattr(kernels, "fused_rms_norm", kernels.plain_rms_norm)
    monkeypatch.setattr(kernels, "moe_combine", Combine())
    monkeypatch.setattr(kernels, "_C_ops", types.SimpleNamespace(moe_combine_grad=documented_moe_combine_grad))

    def install(kernel):
        monkeypatch.setattr(kernels, "fused_rotary_position_embedding", kernel)
        return kernel
    return install


def test_the_fused_tables_give_the_plain_rotations():
    """Every token of the batch at angles of its own (ERNIE's 3D positions), and the ViT's shared [patches] angles."""
    paddle.seed(0)
    x = paddle.randn([2, 5, 3, 16])
    angles = rope_angles(paddle.randint(0, 40, [2, 5, 3]), 16, 10000.0, t_slots=2)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "fused_rotary_position_embedding", documented_fused_rope)
        np.testing.assert_allclose(kernels.fused_rotary(x, angles, halves=False).numpy(),
                                   apply_rotary(x, angles).numpy(), atol=1e-5)
        patches = paddle.randn([7, 3, 16])
        vit_angles = vision_rope_angles(paddle.randint(0, 30, [7, 2]), 16, 10000.0)
        np.testing.assert_allclose(kernels.fused_rotary(patches.unsqueeze(0), vit_angles, halves=True)[0].numpy(),
                                   apply_rotary_half(patches, vit_angles).numpy(), atol=1e-5)
        # the two layouts differ, so a table built for the other one would not pass
        other_layout = kernels.fused_rotary(x, angles, halves=True).numpy()
        assert np.abs(other_layout - apply_rotary(x, angles).numpy()).max() > 0.1


def test_the_model_runs_the_fused_rotations_on_a_gpu(tiny_cfg, on_a_gpu):
    batch = first_batch(tiny_cfg)
    assert batch.grid_thw.shape[0] > 0  # the ViT runs too
    paddle.seed(0)
    model = ErnieMoEForConditionalGeneration(tiny_cfg.model)
    model.eval()
    kernel = on_a_gpu(Kernel())
    fused_logits = model(batch, return_logits=True).logits.numpy()
    layers = tiny_cfg.model.num_hidden_layers + tiny_cfg.model.vision_config.depth
    assert kernel.calls == 2 * layers  # q and k in every decoder and ViT layer
    assert kernels.moe_combine.calls == sum(layer.is_moe for layer in model.model.layers)
    assert "rotary fused, vision_rotary fused, moe_combine fused" in kernels.chosen_on(paddle.CPUPlace())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "_is_gpu", lambda place: False)
        plain_logits = model(batch, return_logits=True).logits.numpy()
    np.testing.assert_allclose(fused_logits, plain_logits, atol=1e-4)


def test_the_fused_combine_gives_the_plain_sums_and_gradients(on_a_gpu):
    """Tokens with no row, one, two and four (the slots are as many as the busiest token's rows)."""
    rng = np.random.default_rng(0)
    tokens = paddle.to_tensor([5, 0, 2, 2, 5, 5, 0, 5, 3])
    rows, weights = rng.standard_normal([9, 6]).astype("float32"), rng.random(9).astype("float32")
    probe = paddle.to_tensor(rng.standard_normal([7, 6]).astype("float32"))
    results = []
    for combine in (kernels.fused_weighted_combine, kernels.plain_weighted_combine):
        x, w = paddle.to_tensor(rows), paddle.to_tensor(weights)
        x.stop_gradient = w.stop_gradient = False
        out = combine(x, tokens, w, 7)
        (out * probe).sum().backward()
        results.append([out.numpy(), x.grad.numpy(), w.grad.numpy()])
    for fused, plain in zip(*results):
        np.testing.assert_allclose(fused, plain, atol=1e-6)
    assert kernels.moe_combine.calls == 1 and np.abs(results[0][0][[1, 4, 6]]).max() == 0  # tokens without rows


@pytest.mark.parametrize("kernel", [Kernel(error=0.01), Kernel(raises=True)], ids=["disagrees", "raises"])
def test_a_fused_kernel_that_fails_its_first_call_is_not_used_again(on_a_gpu, kernel):
    on_a_gpu(kernel)
    paddle.seed(0)
    x, angles = paddle.randn([1, 4, 2, 8]), paddle.rand([1, 4, 4])
    with pytest.warns(UserWarning, match="fused rotary .* using the plain formula"):
        out = kernels.rotary(x, angles)
    np.testing.assert_array_equal(out.numpy(), apply_rotary(x, angles).numpy())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(kernels.rotary(x, angles).numpy(), apply_rotary(x, angles).numpy())
    assert kernel.calls == 1
    assert "rotary plain, vision_rotary fused" in kernels.chosen_on(paddle.CPUPlace())


def weight_gradient_not_summed(ctx, grad):
    """A broken backward: the weights' gradient takes each slot row's first entry instead of its sum."""
    x, weights, index = ctx.saved_tensor()
    grad_x, grad_weight_rows = documented_moe_combine_grad(x, weights, index, grad)
    return grad_x, grad_weight_rows[:, 0].reshape(weights.shape)


@pytest.mark.parametrize("error, failed", [(0.0, []), (0.05, ["rotary embedding", "vision rotary embedding"]),
                                           ("combine", ["moe combine with gradients"])])
def test_the_doctor_checks_each_fused_kernel_on_a_gpu(monkeypatch, on_a_gpu, error, failed):
    on_a_gpu(Kernel(error=0.0 if error == "combine" else error))
    if error == "combine":
        monkeypatch.setattr(kernels._MoECombine, "backward", staticmethod(weight_gradient_not_summed))
    checks = {check.name: check for check in doctor.run_checks(["float32"])}
    assert {f"{name}, fused kernel" for name in ("rms_norm", "rotary embedding", "vision rotary embedding",
                                                 "moe combine with gradients")} <= set(checks)
    assert sorted(name for name, check in checks.items() if not check.passed) == [f"{n}, fused kernel" for n in failed]


@pytest.mark.parametrize("vendor, flags, preset, asks", [
    ("AuthenticAMD", "fpu sse2 avx avx2 fma", None, True),
    ("GenuineIntel", "fpu sse2 avx avx2 avx512f", None, False),  # MKL already picks AVX2/AVX-512 there
    ("AuthenticAMD", "fpu sse2 avx", None, False),  # no AVX2 to ask for
    ("AuthenticAMD", "fpu sse2 avx avx2", "2", False),  # the user's choice stays
])
def test_mkl_is_told_the_vector_units_of_an_amd_cpu(tmp_path, monkeypatch, vendor, flags, preset, asks):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\nflags\t\t: {flags}\n\n")
    monkeypatch.setattr(paddle.version, "with_mkl", "ON")
    if preset is None:
        monkeypatch.delenv("MKL_DEBUG_CPU_TYPE", raising=False)
    else:
        monkeypatch.setenv("MKL_DEBUG_CPU_TYPE", preset)
    assert cpu_fallbacks.use_avx2_math_on_amd(str(cpuinfo)) is asks
    assert os.environ.get("MKL_DEBUG_CPU_TYPE") == ("5" if asks else preset)


def test_a_build_without_mkl_is_left_alone(tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("vendor_id\t: AuthenticAMD\nflags\t\t: avx2\n")
    monkeypatch.setattr(paddle.version, "with_mkl", "OFF")
    monkeypatch.delenv("MKL_DEBUG_CPU_TYPE", raising=False)
    assert not cpu_fallbacks.use_avx2_math_on_amd(str(cpuinfo))
    assert "MKL_DEBUG_CPU_TYPE" not in os.environ
