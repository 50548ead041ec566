import numpy as np
import paddle

from ernie_moe.moe import losses


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_load_balance_loss_matches_formula():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((12, 5)).astype(np.float32)
    probs = softmax(logits)
    topk = np.argsort(-probs, axis=1)[:, :2]
    me = probs.mean(0)
    ce = np.bincount(topk.reshape(-1), minlength=5) / 12
    expected = 5 * (me * ce).sum()
    got = losses.load_balance_loss(paddle.to_tensor(probs), paddle.to_tensor(topk))
    np.testing.assert_allclose(float(got), expected, rtol=1e-5)


def test_load_balance_gradient_flows_through_probabilities_only():
    probs = paddle.to_tensor(softmax(np.random.default_rng(1).standard_normal((6, 3))).astype(np.float32),
                             stop_gradient=False)
    topk = paddle.to_tensor(np.array([[0], [0], [1], [2], [0], [1]]))
    losses.load_balance_loss(probs, topk).backward()
    ce = np.bincount([0, 0, 1, 2, 0, 1], minlength=3) / 6
    # d/dprobs of E * sum(mean(probs) * ce) = E * ce / N for every row
    np.testing.assert_allclose(probs.grad.numpy(), np.tile(3 * ce / 6, (6, 1)), rtol=1e-5)


def test_z_loss_matches_formula():
    logits = np.random.default_rng(2).standard_normal((9, 4)).astype(np.float32) * 3
    lse = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(float(losses.z_loss(paddle.to_tensor(logits))), (lse ** 2).mean(), rtol=1e-5)


def test_orthogonal_loss_matches_formula_and_is_zero_for_orthogonal_experts():
    w = np.random.default_rng(3).standard_normal((8, 4)).astype(np.float32)
    n = w.T / np.linalg.norm(w.T, axis=1, keepdims=True)
    expected = ((n @ n.T - np.eye(4)) ** 2).sum() / 16
    np.testing.assert_allclose(float(losses.orthogonal_loss(paddle.to_tensor(w))), expected, rtol=1e-5)
    eye = np.eye(8, 4, dtype=np.float32) * 3.0
    assert float(losses.orthogonal_loss(paddle.to_tensor(eye))) < 1e-10


def test_global_statistics_give_the_loss_of_all_tokens():
    """With ``reduce`` summing each statistic over two halves of the tokens, each half computes the loss of all."""
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((10, 4)).astype(np.float32)
    probs = softmax(logits)
    topk = np.argsort(-probs, axis=1)[:, :2]
    whole_lb = float(losses.load_balance_loss(paddle.to_tensor(probs), paddle.to_tensor(topk)))
    whole_z = float(losses.z_loss(paddle.to_tensor(logits)))

    def other_half_added(rows):
        """A reduce that adds the statistics of the tokens outside ``rows``, in the order the losses ask."""
        rest = np.setdiff1d(np.arange(10), rows)
        lse = np.log(np.exp(logits[rest]).sum(-1))
        pending = [probs[rest].sum(0), np.bincount(topk[rest].reshape(-1), minlength=4).astype(np.float32),
                   np.array([len(rest)], np.float32), np.array([(lse ** 2).sum()], np.float32),
                   np.array([len(rest)], np.float32)]
        return lambda x: x + paddle.to_tensor(pending.pop(0).astype(np.float32))

    for rows in (np.arange(0, 6), np.arange(6, 10)):
        reduce = other_half_added(rows)
        lb = losses.load_balance_loss(paddle.to_tensor(probs[rows]), paddle.to_tensor(topk[rows]), reduce)
        z = losses.z_loss(paddle.to_tensor(logits[rows]), reduce)
        np.testing.assert_allclose(float(lb), whole_lb, rtol=1e-5)
        np.testing.assert_allclose(float(z), whole_z, rtol=1e-5)
