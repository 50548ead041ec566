import numpy as np
import paddle
import paddle.nn.functional as F
import pytest
from support.models import inputs, make_layer

from ernie_moe.moe.expert_matmul import expert_loop, grouped_swiglu
from ernie_moe.moe.experts import use_expert_matmul
from ernie_moe.parallel import SingleDevicePlan


def np_swiglu(expert, x):
    w1 = expert.up_gate_proj.weight.numpy()
    gate, up = np.split(x @ w1, 2, axis=-1)
    return ((gate / (1 + np.exp(-gate))) * up) @ expert.down_proj.weight.numpy()


def reference(layer, x, types, capacity=None, bias=None, renormalize_after_drop=True):
    """Plain loop over tokens: route within the token's modality, keep first-come choices under capacity, then
    renormalise each token's kept weights (ERNIE's rule; ``renormalize_after_drop=False``: before the drop).
    Capacity as PaddleFormers gives it: with image tokens in the batch, all tokens over all experts for every
    expert; text alone, text tokens over text experts."""
    flat, t = x.reshape(-1, x.shape[-1]), types.reshape(-1)
    with_images = bool((t >= 1).any())
    out = np.zeros_like(flat)
    offsets = {0: 0, 1: layer.router_counts[0]}
    used = np.zeros(layer.num_experts, int)
    choices = []
    for g in (0, 1):
        rows = np.nonzero((t == 0) if g == 0 else (t >= 1))[0]
        w = layer.gate.weight_of(g).numpy()
        logits = flat[rows] @ w
        probs = np.exp(logits - logits.max(1, keepdims=True))
        probs /= probs.sum(1, keepdims=True)
        score = probs + (bias[g, : w.shape[1]] if bias is not None else 0)
        top = np.argsort(-score, axis=1, kind="stable")[:, :2]
        weights = np.take_along_axis(probs, top, 1)
        weights /= weights.sum(1, keepdims=True)
        if capacity is None:
            cap = None
        elif with_images:
            cap = int(capacity * int((t >= 0).sum()) // layer.num_experts)
        else:
            cap = int(capacity * len(rows) // w.shape[1])
        choices.append((rows, top + offsets[g], weights, cap))
    for rows, top, weights, cap in choices:
        kept = np.zeros(top.shape, bool)
        for k in range(2):  # k-major: first choices claim slots before second choices
            for i, e in enumerate(top[:, k]):
                if cap is None or used[e] < cap:
                    used[e] += 1
                    kept[i, k] = True
        if renormalize_after_drop:
            weights = weights * kept / np.maximum((weights * kept).sum(1, keepdims=True), 1e-12)
        for (i, k), r in zip(np.argwhere(kept), rows[np.argwhere(kept)[:, 0]]):
            out[r] += weights[i, k] * np_swiglu(layer.experts[top[i, k]], flat[r:r + 1])[0]
    out += np_swiglu(layer.shared_experts, flat)
    return out.reshape(x.shape), used


@pytest.mark.parametrize("expert_matmul", ["per_expert", "grouped"])
def test_dropless_output_matches_token_loop(expert_matmul):
    layer, _ = make_layer()
    use_expert_matmul(layer, expert_matmul)
    x, types = inputs()
    out, _ = layer(paddle.to_tensor(x), paddle.to_tensor(types))
    expected, _ = reference(layer, x, types)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-4, atol=1e-5)


def test_grouped_experts_match_the_loop_forward_and_backward():
    """Two widths (text 8, vision 6: two batched runs), uneven loads, a capacity that drops choices, and idle
    experts: the same output, input gradient and weight gradients, idle experts' zero gradients included."""
    results = {}
    for mode in ("per_expert", "grouped"):
        layer, _ = make_layer("model.moe_capacity=[1.0, 1.0, 1.0]")
        use_expert_matmul(layer, mode)
        x, types = inputs(n=30, vision_every=5)
        types[0, :2] = -1  # padding
        x = paddle.to_tensor(x, stop_gradient=False)
        out, loss = layer(x, paddle.to_tensor(types))
        (out.square().sum() + loss).backward()
        grads = {name: p.grad.numpy() for name, p in layer.named_parameters() if "experts." in name}
        results[mode] = out.numpy(), x.grad.numpy(), grads
    (out_a, dx_a, g_a), (out_b, dx_b, g_b) = results["per_expert"], results["grouped"]
    np.testing.assert_allclose(out_b, out_a, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx_b, dx_a, rtol=1e-5, atol=1e-6)
    assert set(g_a) == set(g_b) and len(g_a) == 2 * 7 + 2  # 7 routed experts and the shared one, two weights each
    for name in g_a:
        np.testing.assert_allclose(g_b[name], g_a[name], rtol=1e-5, atol=1e-6, err_msg=name)


def np_experts(rows, counts, w1, w2):
    out, start = [], 0
    for c, a, b in zip(counts, w1, w2):
        gate, up = np.split(rows[start:start + c] @ a, 2, axis=-1)
        out.append(((gate / (1 + np.exp(-gate))) * up) @ b)
        start += c
    return np.concatenate(out)


@pytest.mark.parametrize("run", [expert_loop, grouped_swiglu])
def test_expert_matmuls_against_numpy_with_an_expert_without_rows(run):
    """Forward against NumPy; backward against autograd through the plain per-expert expressions, a frozen
    weight included (no gradient for it)."""
    rng = np.random.default_rng(3)
    counts, hidden, width = [5, 0, 2, 7], 6, 4
    rows = rng.standard_normal((sum(counts), hidden)).astype(np.float32)
    w1 = [rng.standard_normal((hidden, 2 * width)).astype(np.float32) for _ in counts]
    w2 = [rng.standard_normal((width, hidden)).astype(np.float32) for _ in counts]
    probe = rng.standard_normal((sum(counts), hidden)).astype(np.float32)

    def leaves(frozen_index=2):
        made = [paddle.to_tensor(a, stop_gradient=False) for a in [rows, *w1, *w2]]
        made[1 + frozen_index].stop_gradient = True
        return made[0], made[1:5], made[5:]

    x, a, b = leaves()
    out = run(x, counts, a, b)
    np.testing.assert_allclose(out.numpy(), np_experts(rows, counts, w1, w2), rtol=1e-5, atol=1e-5)
    (out * paddle.to_tensor(probe)).sum().backward()
    rx, ra, rb = leaves()
    expected = paddle.concat([paddle.matmul(F.swiglu(paddle.matmul(part, u)), d)
                              for part, u, d in zip(paddle.split(rx, counts), ra, rb) if part.shape[0]])
    (expected * paddle.to_tensor(probe)).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), rx.grad.numpy(), rtol=1e-5, atol=1e-5)
    for j in (0, 3):
        np.testing.assert_allclose(a[j].grad.numpy(), ra[j].grad.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(b[j].grad.numpy(), rb[j].grad.numpy(), rtol=1e-5, atol=1e-5)
    assert a[2].grad is None  # frozen
    assert float(a[1].grad.abs().sum()) == 0.0 and float(b[1].grad.abs().sum()) == 0.0  # no rows: zero


def test_capacity_drops_the_same_tokens_as_the_reference():
    layer, _ = make_layer("model.moe_capacity=[1.0, 1.0, 1.0]")
    x, types = inputs(n=30)
    out, _ = layer(paddle.to_tensor(x), paddle.to_tensor(types))
    expected, used = reference(layer, x, types, capacity=1.0)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-4, atol=1e-5)
    window = layer.stats.pop_window()
    np.testing.assert_array_equal(window["kept"], used)
    assert window["routed"].sum() == 2 * 30 and window["kept"].sum() < window["routed"].sum()


def paddleformers_capacity(factors, training, token_types, experts):
    """PaddleFormers' ERNIE-4.5-VL capacity, written from its gate: a batch with image tokens takes the
    multimodal layer (all tokens, every expert of both modalities), a text-only one the text layer."""
    tokens = len(token_types)
    count = sum(experts) if any(t >= 1 for t in token_types) else experts[0]
    factor = factors[0] if training else (factors[2] if tokens < count else factors[1])
    return int(factor * tokens // count)


@pytest.mark.parametrize("training", [True, False])
def test_capacity_of_a_batch_with_images_is_paddleformers(training):
    """Text only, a few image tokens, mostly image tokens, fewer tokens than experts: each expert's capacity."""
    layer, _ = make_layer("model.moe_capacity=[1.0, 1.5, 4.0]")
    layer.train(training)
    for types in ([0] * 24, [0] * 20 + [1] * 4, [1] * 20 + [2] * 2 + [0] * 2, [0, 1, 1], [0] * 3):
        t = paddle.to_tensor([types])
        tokens = [layer._tokens_of(t.flatten(), m) for m in layer.group_modality]
        got = np.array(layer._capacities(tokens))
        want = paddleformers_capacity([1.0, 1.5, 4.0], training, types, [4, 3])
        if any(v >= 1 for v in types):
            np.testing.assert_array_equal(got, [want] * 7, err_msg=str(types))
        else:  # the vision experts get no token; their capacity is their own group's
            np.testing.assert_array_equal(got[:4], [want] * 4, err_msg=str(types))


def test_a_capacity_that_cannot_drop_a_choice_is_not_applied():
    """An expert gets at most one row per token of its group: capacities that large (3 for 3 text tokens; 9 for a
    batch of 8) are not applied, and applying them would give the same output; smaller ones apply."""
    layer, _ = make_layer("model.moe_capacity=[1.0, 1.5, 4.0]")
    layer.eval()
    for types, applied in (([0] * 3, False), ([0, 1, 1], True), ([0] * 8, True)):
        t = paddle.to_tensor([types])
        tokens = [layer._tokens_of(t.flatten(), m) for m in layer.group_modality]
        assert (layer._limits(tokens) is not None) == applied, types
    layer.capacity_factors = [8.0, 8.0, 8.0]
    x, types = (paddle.to_tensor(a) for a in inputs(n=8))
    assert layer._limits([layer._tokens_of(types.flatten(), m) for m in layer.group_modality]) is None
    skipped, _ = layer(x, types)
    layer._limits = lambda tokens: paddle.to_tensor(layer._capacities(tokens), dtype="int64")  # applied anyway
    np.testing.assert_allclose(layer(x, types)[0].numpy(), skipped.numpy(), rtol=0, atol=1e-6)


def test_a_dropped_choice_leaves_the_kept_ones_renormalised():
    """ERNIE's rule: with capacity, a token whose second choice is dropped mixes its first choice at weight 1."""
    layer, _ = make_layer("model.moe_capacity=[1.0, 1.0, 1.0]")
    x, types = inputs(n=30)
    out, _ = layer(paddle.to_tensor(x), paddle.to_tensor(types))
    kept_rule, _ = reference(layer, x, types, capacity=1.0)
    before_drop, _ = reference(layer, x, types, capacity=1.0, renormalize_after_drop=False)
    scale = np.abs(kept_rule).max()
    np.testing.assert_allclose(out.numpy(), kept_rule, rtol=0, atol=1e-5 * scale)
    assert np.abs(out.numpy() - before_drop).max() > 0.05 * scale  # some token lost a choice: the rules differ


def test_routing_is_isolated_by_modality():
    layer, _ = make_layer()
    x, _ = inputs()
    layer(paddle.to_tensor(x), paddle.zeros([1, 24], dtype="int64"))  # text only
    routed = layer.stats.pop_window()["routed"]
    assert routed[:4].sum() == 48 and routed[4:].sum() == 0
    layer(paddle.to_tensor(x), paddle.ones([1, 24], dtype="int64") * 2)  # video routes as image
    routed = layer.stats.pop_window()["routed"]
    assert routed[:4].sum() == 0 and routed[4:].sum() == 48


def test_padding_tokens_are_not_routed():
    layer, _ = make_layer()
    x, types = inputs()
    types[0, -5:] = -1
    layer(paddle.to_tensor(x), paddle.to_tensor(types))
    assert layer.stats.pop_window()["routed"].sum() == 2 * 19


def test_idle_experts_still_receive_a_gradient():
    layer, _ = make_layer()
    x, _ = inputs()
    out, loss = layer(paddle.to_tensor(x), paddle.zeros([1, 24], dtype="int64"))  # vision experts idle
    (out.sum() + loss).backward()
    for j in range(7):
        grad = layer.experts[j].up_gate_proj.weight.grad
        assert grad is not None, f"expert {j} has no gradient"
    assert float(layer.experts[5].up_gate_proj.weight.grad.abs().sum()) == 0.0
    assert float(layer.experts[0].up_gate_proj.weight.grad.abs().sum()) > 0.0


def test_router_loss_weights_are_per_modality():
    layer, _ = make_layer("model.moe_aux_loss_lambda=[0.5, 0.0]", "model.moe_z_loss_lambda=0.0",
                          "model.moe_orthogonal_loss_lambda=0.0")
    x, types = inputs()
    _, loss = layer(paddle.to_tensor(x), paddle.to_tensor(types))
    window = layer.stats.pop_window()
    np.testing.assert_allclose(float(loss), 0.5 * window["loss_sums"][0, 0], rtol=1e-5)


def test_aux_free_bias_changes_choice_not_weights():
    layer, _ = make_layer("model.moe_use_aux_free=true")
    x, types = inputs()
    bias = np.zeros((2, 4), np.float32)
    bias[0, 3] = 10.0  # every text token now picks text expert 3
    layer.moe_statics.e_score_correction_bias.set_value(bias)
    out, _ = layer(paddle.to_tensor(x), paddle.to_tensor(types))
    expected, used = reference(layer, x, types, bias=bias)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-4, atol=1e-5)
    assert used[3] == (types == 0).sum()


def test_correction_bias_update_rule():
    layer, _ = make_layer("model.moe_use_aux_free=true", "model.moe_aux_free_update_coef=0.1")
    usage = np.array([10, 2, 6, 6, 1, 4, 7])
    layer.update_correction_bias(paddle.to_tensor(usage))
    bias = layer.moe_statics.e_score_correction_bias.numpy()
    np.testing.assert_allclose(bias[0], 0.1 * np.sign(usage[:4].mean() - usage[:4]))
    np.testing.assert_allclose(bias[1, :3], 0.1 * np.sign(usage[4:].mean() - usage[4:]))
    assert bias[1, 3] == 0.0  # padding slot of the smaller vision group stays untouched


def test_outside_training_the_layer_routes_alike_without_router_losses():
    """Evaluation and decoding mix the experts as training does (dropless here) but skip the router losses, which
    only train the routers, and record no statistics."""
    layer, _ = make_layer("model.moe_use_aux_free=true")
    x, types = (paddle.to_tensor(a) for a in inputs())
    trained, loss = layer(x, types)
    layer.stats.pop_window()
    layer.eval()
    evaluated, no_loss = layer(x, types)
    np.testing.assert_array_equal(evaluated.numpy(), trained.numpy())
    assert float(loss) > 0 and float(no_loss) == 0
    assert not any(np.any(v) for v in layer.stats.pop_window().values())


def test_capacity_formula():
    layer, _ = make_layer("model.moe_capacity=[1.5, 2.0, 8.0]")
    assert layer._capacity(100, 4) == int(1.5 * 100 // 4)
    layer.eval()
    assert layer._capacity(100, 4) == int(2.0 * 100 // 4)
    assert layer._capacity(3, 4) == int(8.0 * 3 // 4)


@pytest.mark.parametrize("hard_gate", [False])
def test_without_hard_gate_one_router_serves_every_expert(hard_gate):
    layer, _ = make_layer(f"model.moe_use_hard_gate={str(hard_gate).lower()}")
    assert layer.router_counts == [7] and len(layer.experts) == 7
    x, types = inputs()
    layer(paddle.to_tensor(x), paddle.to_tensor(types))
    assert layer.stats.pop_window()["routed"].sum() == 48


def test_expert_ownership_splits_each_modality_evenly():
    from ernie_moe.parallel.expert_parallel import local_expert_ids, rank_major_order

    assert local_expert_ids([4, 2], rank=0, size=2) == [0, 1, 4]
    assert local_expert_ids([4, 2], rank=1, size=2) == [2, 3, 5]
    # listed owner by owner: 0 1 4 | 2 3 5
    assert rank_major_order([4, 2], 2).tolist() == [0, 1, 3, 4, 2, 5]


def test_experts_start_the_same_wherever_they_live(tiny_cfg):
    """Rank 1 of an expert group builds exactly the weights one device has for the experts it holds, and
    every other parameter too: weights are drawn by name."""
    from ernie_moe.model.ernie_vl import ErnieMoEForConditionalGeneration
    from ernie_moe.parallel.expert_parallel import local_expert_ids

    class Half(SingleDevicePlan):
        def local_expert_ids(self, counts):
            return local_expert_ids(counts, rank=1, size=2)

    paddle.seed(3)
    full = dict(ErnieMoEForConditionalGeneration(tiny_cfg.model).stable_named_parameters())
    paddle.seed(3)
    plan = Half(tiny_cfg.model.initializer_range)
    half = dict(ErnieMoEForConditionalGeneration(tiny_cfg.model, plan).stable_named_parameters())
    assert "model.layers.1.mlp.experts.2.up_gate_proj.weight" in half
    assert "model.layers.1.mlp.experts.0.up_gate_proj.weight" not in half
    for name, param in half.items():
        np.testing.assert_array_equal(param.numpy(), full[name].numpy(), err_msg=name)
    assert float(full["model.layers.1.mlp.experts.2.up_gate_proj.weight"].std()) > 0
