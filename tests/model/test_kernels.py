"""Paddle's GPU-only kernels (RMSNorm, rotary embedding, MoE combine, grouped GEMM), run here through stand-ins
that compute what Paddle documents and ERNIE relies on: the tables, position ids and slots this package builds
for them, the model's use of them on a GPU, the guard that keeps a kernel which fails or disagrees out of
training, and the doctor's check of each. Last, the math library's code path on a CPU."""

import os
import types
import warnings

import numpy as np
import paddle
import pytest
from paddle.base import core
from support.models import first_batch

import ernie_moe.doctor.kernels as doctor
from ernie_moe.model.ernie_vl import ErnieMoEForConditionalGeneration
from ernie_moe.model.recompute import apply_recompute
from ernie_moe.moe.expert_matmul import expert_loop, grouped_gemm_swiglu, grouped_swiglu, padded_swiglu
from ernie_moe.moe.experts import use_expert_matmul
from ernie_moe.nn import kernels
from ernie_moe.nn.rope import apply_rotary, apply_rotary_half, rope_angles, vision_rope_angles
from ernie_moe.parallel import cpu_fallbacks


def documented_fused_rope(q, k=None, v=None, sin=None, cos=None, position_ids=None, use_neox_rotary_style=True,
                          time_major=False, rotary_emb_base=10000.0):
    """``paddle.incubate.nn.functional.fused_rotary_position_embedding`` on ``q``: ``q cos + rotate(q) sin`` with
    [seq, dim] tables read at ``position_ids [batch, seq]`` when given; the "neox" style pairs neighbours,
    the other halves. Written with Paddle's operations, so it has the kernel's gradient too."""
    dim = q.shape[-1]
    sin, cos = (t.astype(q.dtype).reshape([-1, dim]) for t in (sin, cos))
    if position_ids is not None:
        sin, cos = (paddle.gather(t, position_ids.flatten()) for t in (sin, cos))
    sin, cos = sin.reshape([-1, q.shape[1], 1, dim]), cos.reshape([-1, q.shape[1], 1, dim])
    if use_neox_rotary_style:
        turned = paddle.stack([-q[..., 1::2], q[..., 0::2]], axis=-1).reshape(q.shape)
    else:
        turned = paddle.concat([-q[..., dim // 2:], q[..., : dim // 2]], axis=-1)
    return q * cos + turned * sin, None, None


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


def documented_batched_gemm(lhs, rhs, batch_sizes, trans_lhs=False, trans_rhs=False):
    """``paddle.incubate.nn.functional.batched_gemm``: group j owns ``batch_sizes[j]`` consecutive rows of ``lhs``,
    whose output rows are ``lhs_j @ rhs[j]`` (``rhs[j]^T`` with ``trans_rhs``); with ``trans_lhs``, ``rhs`` is
    ``[rows, n]`` too and ``out[j] = lhs_j^T @ rhs_j``."""
    a, b = lhs.astype("float32").numpy(), rhs.astype("float32").numpy()
    ends = np.cumsum(batch_sizes)
    spans = list(zip(ends - np.asarray(batch_sizes), ends))
    if trans_lhs:
        out = np.stack([a[start:end].T @ b[start:end] for start, end in spans])
    else:
        out = np.concatenate([a[start:end] @ (b[j].T if trans_rhs else b[j]) for j, (start, end) in enumerate(spans)])
    return paddle.to_tensor(out).astype(lhs.dtype)


class GroupedGemm:
    """The grouped GEMM stand-in, counting its calls; ``stale`` leaves NaN in the weight-gradient slot of a group
    without rows (a kernel that skips empty groups), ``wrong_weight_gradient`` scales that form by 1.5."""

    def __init__(self, stale=False, wrong_weight_gradient=False):
        self.calls, self.stale, self.wrong_weight_gradient = 0, stale, wrong_weight_gradient

    def __call__(self, lhs, rhs, batch_sizes, trans_lhs=False, trans_rhs=False):
        self.calls += 1
        out = documented_batched_gemm(lhs, rhs, batch_sizes, trans_lhs, trans_rhs)
        if trans_lhs and self.stale:
            out = paddle.where(paddle.to_tensor(batch_sizes).reshape([-1, 1, 1]) == 0, paddle.full_like(out, np.nan),
                               out)
        if trans_lhs and self.wrong_weight_gradient:
            out = out * 1.5
        return out


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
    monkeypatch.setattr(kernels, "batched_gemm", GroupedGemm())

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
        vit_angles = vision_rope_angles(np.random.default_rng(0).integers(0, 30, [7, 2]), 16, 10000.0)
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
    use_expert_matmul(model, "grouped")
    moe_layers = [layer.mlp for layer in model.model.layers if layer.is_moe]
    widths_with_rows = []  # per MoE layer, the expert widths that got rows: each is one grouped GEMM per projection

    def record_widths(experts, inputs):
        _, counts = inputs
        widths_with_rows.append({e.intermediate_size for e, n in zip(experts, counts) if n})
    for moe in moe_layers:
        moe.experts.register_forward_pre_hook(record_widths)
    kernel = on_a_gpu(Kernel())
    fused_logits = model(batch, return_logits=True).logits.numpy()
    layers = tiny_cfg.model.num_hidden_layers + tiny_cfg.model.vision_config.depth
    # each kernel's first call runs it once more, forward and backward, against the plain formula
    assert kernel.calls == 2 * layers + 2  # q and k in every decoder and ViT layer; the checks of both rotations
    assert kernels.moe_combine.calls == len(moe_layers) + 1
    assert len(widths_with_rows) == len(moe_layers) and {64, 32} in widths_with_rows  # text and vision widths
    assert kernels.batched_gemm.calls == 2 * sum(len(widths) for widths in widths_with_rows) + 2 + 2 * 2
    assert "rotary fused, vision_rotary fused, moe_combine fused, grouped_gemm fused" in kernels.chosen_on(
        paddle.CPUPlace())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "_is_gpu", lambda place: False)
        plain_logits = model(batch, return_logits=True).logits.numpy()
    np.testing.assert_allclose(fused_logits, plain_logits, atol=1e-4)


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "hooks"])
def test_the_first_calls_inside_a_recompute_give_the_plain_gradients(tiny_cfg, on_a_gpu, use_reentrant):
    """Under full recompute every kernel's first call runs in the recompute's first pass: reentrant, the check runs
    there; not reentrant, where fleet's saved-tensor hooks take what autograd saves, the plain path runs and the
    check waits for a call outside."""
    batch = first_batch(tiny_cfg)
    on_a_gpu(Kernel())
    grads, chosen = [], []
    for on_gpu in (True, False):
        paddle.seed(0)
        model = ErnieMoEForConditionalGeneration(tiny_cfg.model)
        use_expert_matmul(model, "grouped")
        apply_recompute(model, "full", use_reentrant=use_reentrant)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(kernels, "_is_gpu", lambda place, on=on_gpu: on)
            out = model(batch)
            (out.loss_sum / out.num_label_tokens + out.router_loss).backward()
            chosen.append(sorted(kernel for (kernel, _, _), works in kernels._FUSED_WORKS.items() if works))
            if on_gpu and not use_reentrant:  # the report says which kernels still wait for their check
                assert "rms_norm fused, rotary unchecked" in kernels.chosen_on(paddle.CPUPlace())
        grads.append({name: p.grad.numpy() for name, p in model.named_parameters() if p.grad is not None})
        kernels._FUSED_WORKS.clear()
    # not reentrant, only the final norm, outside the recomputed layers, is checked (and used from then on)
    checked = ["grouped_gemm", "moe_combine", "rms_norm", "rotary", "vision_rotary"] if use_reentrant else ["rms_norm"]
    assert chosen == [checked, []]
    assert set(grads[0]) == set(grads[1]) and len(grads[0]) > 20
    for name in grads[0]:
        np.testing.assert_allclose(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-6, err_msg=name)


def test_the_fused_combine_gives_the_plain_sums_and_gradients(on_a_gpu):
    """Tokens with no row, one, two and four (four slots: as many as the busiest token's rows)."""
    rng = np.random.default_rng(0)
    tokens = paddle.to_tensor([5, 0, 2, 2, 5, 5, 0, 5, 3])
    rows, weights = rng.standard_normal([9, 6]).astype("float32"), rng.random(9).astype("float32")
    probe = paddle.to_tensor(rng.standard_normal([7, 6]).astype("float32"))
    results = []
    for fused in (True, False):
        x, w = paddle.to_tensor(rows), paddle.to_tensor(weights)
        x.stop_gradient = w.stop_gradient = False
        out = (kernels.fused_weighted_combine(x, tokens, w, 7, slots=4) if fused else
               kernels.plain_weighted_combine(x, tokens, w, 7))
        (out * probe).sum().backward()
        results.append([out.numpy(), x.grad.numpy(), w.grad.numpy()])
    for fused, plain in zip(*results):
        np.testing.assert_allclose(fused, plain, atol=1e-6)
    assert kernels.moe_combine.calls == 1 and np.abs(results[0][0][[1, 4, 6]]).max() == 0  # tokens without rows


@pytest.mark.parametrize("stale", [False, True], ids=["zeros", "leaves-nan"])
def test_the_grouped_gemm_gives_the_loops_outputs_and_gradients(monkeypatch, on_a_gpu, stale):
    """Experts of 3, 0, 5 and 2 rows, with one frozen weight: the outputs and every gradient of the one-by-one loop,
    exactly zero for the expert without rows even when the kernel leaves NaN in its slot, none for the frozen one."""
    monkeypatch.setattr(kernels, "batched_gemm", GroupedGemm(stale=stale))
    rng = np.random.default_rng(0)
    counts, probe = [3, 0, 5, 2], paddle.to_tensor(rng.standard_normal([10, 8]).astype("float32"))
    arrays = [rng.standard_normal(shape).astype("float32") * 0.4
              for shape in [[10, 8]] + [[8, 12]] * 4 + [[6, 8]] * 4]
    results = []
    for run in (grouped_swiglu, expert_loop):
        x, *weights = (paddle.to_tensor(a) for a in arrays)
        for t in (x, *weights):
            t.stop_gradient = False
        weights[6].stop_gradient = True  # expert 2's down projection, frozen
        out = run(x, counts, weights[:4], weights[4:])
        (out * probe).sum().backward()
        results.append([out.numpy(), x.grad.numpy()] + [w.grad.numpy() for w in weights if w.grad is not None])
        assert weights[6].grad is None
    # each projection forward, then its rows' and weights' gradients; twice, as the first call's check runs them too
    assert kernels.batched_gemm.calls == 2 * (2 + 2 * 2)
    assert "grouped_gemm fused" in kernels.chosen_on(paddle.CPUPlace())
    assert len(results[0]) == len(results[1]) == 2 + 7
    for grouped, loop in zip(*results):
        np.testing.assert_allclose(grouped, loop, rtol=1e-5, atol=1e-6)
    assert np.all(results[0][3] == 0) and np.all(results[0][7] == 0)  # expert 1's up_gate and down gradients


def test_under_autocast_the_grouped_gemm_runs_in_its_dtype(monkeypatch, on_a_gpu):
    """float32 rows (an O1 residual stream) meet the kernel in autocast's dtype; float64 stands in for bfloat16,
    which Paddle's CPU swiglu lacks."""
    monkeypatch.setattr(paddle.amp, "is_autocast_enabled", lambda: True)
    monkeypatch.setattr(paddle.amp, "get_autocast_dtype", lambda: "float64")
    seen = []
    monkeypatch.setattr(kernels, "batched_gemm", lambda lhs, rhs, *args, **kwargs: seen.append(
        (lhs.dtype, rhs.dtype)) or documented_batched_gemm(lhs, rhs, *args, **kwargs))
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(shape).astype("float32") for shape in [[6, 8], [8, 12], [8, 12], [6, 8], [6, 8]]]
    results = []
    for run in (grouped_swiglu, expert_loop):
        x, *weights = (paddle.to_tensor(a, stop_gradient=False) for a in arrays)
        out = run(x, [4, 2], weights[:2], weights[2:])
        out.sum().backward()
        assert all(w.grad.dtype == paddle.float32 for w in weights)  # the weights' own dtype
        results.append([out.numpy()] + [w.grad.numpy() for w in weights])
    assert results[0][0].dtype == np.float64 and set(seen) == {(paddle.float64, paddle.float64)}
    assert kernels._FUSED_WORKS == {("grouped_gemm", str(x.place), "paddle.float64"): True}
    for grouped, loop in zip(*results):
        np.testing.assert_allclose(grouped, loop, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("run", [padded_swiglu, grouped_gemm_swiglu], ids=["padded", "grouped gemm"])
def test_the_grouped_experts_keep_no_stacked_copy_of_the_weights_for_backward(on_a_gpu, run):
    """What the forward pass leaves allocated (the activations kept for backward) is the loop's and a little
    padding: not the experts' weights stacked for the kernel, here 14 times the loop's activations."""
    rng = np.random.default_rng(0)
    counts, hidden, width = [2] * 8, 32, 128
    x, *weights = (paddle.to_tensor(0.2 * rng.standard_normal(shape).astype("float32"), stop_gradient=False)
                   for shape in [[16, hidden]] + [[hidden, 2 * width]] * 8 + [[width, hidden]] * 8)

    def kept_by(run):
        before = core.host_memory_stat_current_value("Allocated", 0)
        out = run(x, counts, weights[:8], weights[8:])
        return core.host_memory_stat_current_value("Allocated", 0) - before, out

    loop, loop_out = kept_by(expert_loop)
    grouped, out = kept_by(run)
    stacked = 4 * sum(int(np.prod(w.shape)) for w in weights)
    assert stacked > 14 * loop > 0 and loop <= grouped < loop + stacked / 10, (loop, grouped, stacked)
    out.sum().backward()  # the backward stacks them again
    grads = [w.grad.numpy() for w in weights]
    for w in weights:
        w.clear_gradient()
    loop_out.sum().backward()
    for grad, w in zip(grads, weights):
        np.testing.assert_allclose(grad, w.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_a_paddle_build_without_the_grouped_gemm_runs_the_padded_matmuls(monkeypatch, on_a_gpu):
    monkeypatch.setattr(kernels, "batched_gemm", None)
    rng = np.random.default_rng(0)
    x, up_gate, down = (paddle.to_tensor(rng.standard_normal(shape).astype("float32")) for shape in
                        ([6, 8], [2, 8, 12], [2, 6, 8]))
    with pytest.warns(UserWarning, match="fused grouped_gemm failed .this Paddle build has no batched_gemm"):
        out = grouped_swiglu(x, [4, 2], list(up_gate), list(down))
    np.testing.assert_allclose(out.numpy(), expert_loop(x, [4, 2], list(up_gate), list(down)).numpy(), rtol=1e-5)
    assert "grouped_gemm plain" in kernels.chosen_on(paddle.CPUPlace())


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
    assert "rotary plain, vision_rotary unchecked" in kernels.chosen_on(paddle.CPUPlace())


def weight_gradient_not_summed(ctx, grad):
    """A broken backward: the weights' gradient takes each slot row's first entry instead of its sum."""
    x, weights, index = ctx.saved_tensor()
    grad_x, grad_weight_rows = documented_moe_combine_grad(x, weights, index, grad)
    return grad_x, grad_weight_rows[:, 0].reshape(weights.shape)


def backward_not_registered(ctx, grad):
    raise RuntimeError("(NotFound) The kernel `moe_combine_grad` is not registered.")


@pytest.mark.parametrize("backward, why", [
    (weight_gradient_not_summed, "differs from the plain formula by"),
    (backward_not_registered, r"failed \(RuntimeError: \(NotFound\) The kernel `moe_combine_grad` is not registered"),
], ids=["wrong gradient", "no gradient kernel"])
@pytest.mark.parametrize("grad_enabled", [True, False], ids=["training", "no_grad"])
def test_a_fused_kernel_whose_backward_fails_its_first_call_is_not_used(monkeypatch, on_a_gpu, backward, why,
                                                                        grad_enabled):
    """The first call checks the backward pass too, also where the call itself needs none (evaluation, or a
    recompute's first pass), so the training that follows never meets it."""
    monkeypatch.setattr(kernels._MoECombine, "backward", staticmethod(backward))
    rng = np.random.default_rng(0)
    tokens = paddle.to_tensor([5, 0, 2, 2, 5, 5, 0, 5, 3])
    x = paddle.to_tensor(rng.standard_normal([9, 6]).astype("float32"), stop_gradient=False)
    w = paddle.to_tensor(rng.random(9).astype("float32"), stop_gradient=False)
    with paddle.set_grad_enabled(grad_enabled), pytest.warns(UserWarning, match=f"fused moe_combine {why}"):
        out = kernels.weighted_combine(x, tokens, w, 7, 4)
    assert kernels.moe_combine.calls == 1 and "moe_combine plain" in kernels.chosen_on(paddle.CPUPlace())
    out = kernels.weighted_combine(x, tokens, w, 7, 4)
    out.sum().backward()
    rx, rw = x.detach(), w.detach()
    rx.stop_gradient = rw.stop_gradient = False
    kernels.plain_weighted_combine(rx, tokens, rw, 7).sum().backward()
    for ours, reference in ((x.grad, rx.grad), (w.grad, rw.grad)):
        np.testing.assert_array_equal(ours.numpy(), reference.numpy())


def test_a_grouped_gemm_whose_weight_gradient_is_wrong_is_not_used(monkeypatch, on_a_gpu):
    monkeypatch.setattr(kernels, "batched_gemm", GroupedGemm(wrong_weight_gradient=True))
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(shape).astype("float32") for shape in [[6, 8], [8, 12], [8, 12], [6, 8], [6, 8]]]
    results = []
    for run in (grouped_swiglu, expert_loop):
        x, *weights = (paddle.to_tensor(a, stop_gradient=False) for a in arrays)
        if run is grouped_swiglu:
            with pytest.warns(UserWarning, match="fused grouped_gemm differs from the plain formula by 5.00e-01"):
                out = run(x, [4, 2], weights[:2], weights[2:])
        else:
            out = run(x, [4, 2], weights[:2], weights[2:])
        out.sum().backward()
        results.append([out.numpy(), x.grad.numpy()] + [w.grad.numpy() for w in weights])
    assert "grouped_gemm plain" in kernels.chosen_on(paddle.CPUPlace())
    for grouped, loop in zip(*results):
        np.testing.assert_allclose(grouped, loop, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("error, failed", [
    (0.0, []), (0.05, ["rotary embedding, fused kernel", "vision rotary embedding, fused kernel"]),
    ("combine", ["moe combine with gradients, fused kernel"]),
    # the grouped path the model runs falls back to the padded matmuls at its first call: only the kernel fails
    ("grouped gemm", ["routed experts grouped, with gradients, fused kernel"]),
])
def test_the_doctor_checks_each_fused_kernel_on_a_gpu(monkeypatch, on_a_gpu, error, failed):
    on_a_gpu(Kernel(error=error if isinstance(error, float) else 0.0))
    if error == "combine":
        monkeypatch.setattr(kernels._MoECombine, "backward", staticmethod(weight_gradient_not_summed))
    if error == "grouped gemm":
        monkeypatch.setattr(kernels, "batched_gemm", GroupedGemm(wrong_weight_gradient=True))
    checks = {check.name: check for check in doctor.run_checks(["float32"])}
    assert {f"{name}, fused kernel" for name in ("rms_norm", "rotary embedding", "vision rotary embedding",
                                                 "moe combine with gradients", "routed experts grouped, with gradients"
                                                 )} <= set(checks)
    assert sorted(name for name, check in checks.items() if not check.passed) == failed


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
    # set first, so that the variable goes back to what it was (unset on an Intel CPU) whatever the call sets: the
    # processes later tests start take it
    monkeypatch.setenv("MKL_DEBUG_CPU_TYPE", preset or "")
    if preset is None:
        monkeypatch.delenv("MKL_DEBUG_CPU_TYPE")
    assert cpu_fallbacks.use_avx2_math_on_amd(str(cpuinfo)) is asks
    assert os.environ.get("MKL_DEBUG_CPU_TYPE") == ("5" if asks else preset)


def test_a_build_without_mkl_is_left_alone(tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("vendor_id\t: AuthenticAMD\nflags\t\t: avx2\n")
    monkeypatch.setattr(paddle.version, "with_mkl", "OFF")
    monkeypatch.setenv("MKL_DEBUG_CPU_TYPE", "")  # restored afterwards, as above
    monkeypatch.delenv("MKL_DEBUG_CPU_TYPE")
    assert not cpu_fallbacks.use_avx2_math_on_amd(str(cpuinfo))
    assert "MKL_DEBUG_CPU_TYPE" not in os.environ
