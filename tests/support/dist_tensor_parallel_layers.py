"""Run on 2 ranks by tests/launches/test_tensor_parallel.py: each tensor-parallel piece next to its unsharded reference,
both expert dispatchers next to the single-device one, and the gradient sync against gradients averaged by hand.

Same input on both ranks (the all-to-all dispatcher: each rank its half of the tokens); outputs must equal the
single-device layer's, each rank's weight gradient must equal its slice of the full gradient, and input
gradients must be complete.
"""

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F

from ernie_moe.moe.dispatcher import LocalDispatcher
from ernie_moe.nn import sharding
from ernie_moe.parallel import cpu_fallbacks
from ernie_moe.parallel import tensor_parallel as tp
from ernie_moe.parallel.env import DistEnv
from ernie_moe.parallel.expert_parallel import ExpertParallelDispatcher, TensorParallelExpertDispatcher
from ernie_moe.parallel.grad_sync import GradSync

TOL = dict(rtol=1e-5, atol=1e-6)


def close(actual, expected, what):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), err_msg=what, **TOL)


def leaf(array):
    t = paddle.to_tensor(array)
    t.stop_gradient = False
    return t


def with_weight(layer, full):
    """The layer holding its slice of ``full``."""
    layer.weight.set_value(sharding.shard_of(layer.weight, full))
    return layer


def check_linears(group, rng, sequence_parallel):
    """A fused column layer (q/k/v-style segments) and a row layer, each against a plain matmul."""
    rank, size = group.rank, group.nranks
    batch, seq, hidden, segments = 2, 6, 8, [8, 4, 4]
    piece = slice(rank * seq // size, (rank + 1) * seq // size) if sequence_parallel else slice(None)

    # column: input whole (or this rank's sequence piece), output this rank's columns of the whole sequence
    w = rng.normal(size=(hidden, sum(segments))).astype("float32")
    x = rng.normal(size=(batch, seq, hidden)).astype("float32")
    upstream = rng.normal(size=(batch, seq, sum(segments))).astype("float32")
    xr, wr = leaf(x), leaf(w)
    ref = paddle.matmul(xr, wr)
    (ref * paddle.to_tensor(upstream)).sum().backward()
    cols = sharding.shard_index(segments, rank, size)
    column = with_weight(tp.ColumnParallelLinear(hidden, sum(segments), group, sequence_parallel, 0.02, segments), w)
    xs = leaf(x[:, piece])
    out = column(xs)
    close(out.numpy(), ref.numpy()[..., cols], f"column output (sp={sequence_parallel})")
    (out * paddle.to_tensor(upstream[..., cols])).sum().backward()
    close(column.weight.grad.numpy(), wr.grad.numpy()[:, cols], "column weight grad slice")
    close(xs.grad.numpy(), xr.grad.numpy()[:, piece], "column input grad")
    close(sharding.full_tensor(column.weight, group).numpy(), w, "column weight reassembled")

    # row: input this rank's block of features, output the sum (this rank's sequence piece under SP)
    w = rng.normal(size=(sum(segments), hidden)).astype("float32")
    x = rng.normal(size=(batch, seq, sum(segments))).astype("float32")
    upstream = rng.normal(size=(batch, seq, hidden)).astype("float32")
    xr, wr = leaf(x), leaf(w)
    ref = paddle.matmul(xr, wr)
    (ref * paddle.to_tensor(upstream)).sum().backward()
    rows = sharding.shard_index([sum(segments)], rank, size)
    row = with_weight(tp.RowParallelLinear(sum(segments), hidden, group, sequence_parallel, 0.02), w)
    xs = leaf(x[..., rows])
    out = row(xs)
    close(out.numpy(), ref.numpy()[:, piece], f"row output (sp={sequence_parallel})")
    (out * paddle.to_tensor(upstream[:, piece])).sum().backward()
    close(row.weight.grad.numpy(), wr.grad.numpy()[rows], "row weight grad slice")
    close(xs.grad.numpy(), xr.grad.numpy()[..., rows], "row input grad")


def check_embedding_and_loss(group, rng):
    vocab, hidden = 10, 4
    weight = rng.normal(size=(vocab, hidden)).astype("float32")
    ids = paddle.to_tensor(rng.integers(0, vocab, size=(2, 5)))
    upstream = paddle.to_tensor(rng.normal(size=(2, 5, hidden)).astype("float32"))
    ref = leaf(weight)
    (F.embedding(ids, ref) * upstream).sum().backward()
    emb = with_weight(tp.VocabParallelEmbedding(vocab, hidden, group, 0.02), weight)
    out = emb(ids)
    close(out.numpy(), weight[ids.numpy()], "embedding output")
    (out * upstream).sum().backward()
    rows = sharding.shard_index([vocab], group.rank, group.nranks)
    close(emb.weight.grad.numpy(), ref.grad.numpy()[rows], "embedding grad slice")

    logits = rng.normal(size=(3, 4, vocab)).astype("float32") * 3
    labels = rng.integers(0, vocab, size=(3, 4))
    labels[0, :2] = -100
    labels_t = paddle.to_tensor(labels)
    full = leaf(logits)
    ref_loss = F.cross_entropy(full, labels_t.unsqueeze(-1), ignore_index=-100, reduction="sum")
    ref_loss.backward()
    local = leaf(logits[..., rows])
    loss = tp.vocab_parallel_cross_entropy_sum(local, labels_t, group)
    close(float(loss), float(ref_loss), "parallel cross-entropy")
    loss.backward()
    close(local.grad.numpy(), full.grad.numpy()[..., rows], "cross-entropy logits grad slice")
    logits[1, 1, :] = 0.5  # a tie across the two vocabulary blocks goes to the lowest id
    close(tp.vocab_parallel_argmax(paddle.to_tensor(logits[..., rows]), group).numpy(), logits.argmax(-1), "argmax")


def check_expert_dispatch(group, rng):
    """Experts spread over ranks that hold the same tokens, against all experts on one device."""
    tokens, hidden, counts, k = 12, 4, [4, 2], 2
    experts = [rng.normal(size=(hidden, hidden)).astype("float32") for _ in range(sum(counts))]
    x = rng.normal(size=(tokens, hidden)).astype("float32")
    ids = np.stack([rng.permutation(sum(counts))[:k] for _ in range(tokens)])
    weights = rng.random(size=(tokens, k)).astype("float32")
    upstream = paddle.to_tensor(rng.normal(size=(tokens, hidden)).astype("float32"))

    def run(dispatcher, expert_ids):
        xs, ws = leaf(x), leaf(weights)
        params = [leaf(experts[j]) for j in expert_ids]
        rows, per_expert, state = dispatcher.dispatch(xs, paddle.arange(tokens), paddle.to_tensor(ids), ws,
                                                      sum(counts), None)
        outputs = [paddle.matmul(i, p) for i, p in zip(paddle.split(rows, per_expert, axis=0), params)]
        out = dispatcher.combine(paddle.concat(outputs, axis=0), state, tokens)
        (out * upstream).sum().backward()
        return out.numpy(), xs.grad.numpy(), ws.grad.numpy(), [p.grad.numpy() for p in params]

    ref = run(LocalDispatcher(), list(range(sum(counts))))
    mine = [j for s, n in zip([0, 4], counts) for j in range(s + group.rank * n // 2, s + (group.rank + 1) * n // 2)]
    got = run(TensorParallelExpertDispatcher(counts, group), mine)
    close(got[0], ref[0], "combined output")
    close(got[1], ref[1], "token grad")
    close(got[2], ref[2], "routing weight grad")
    for j, grad in zip(mine, got[3]):
        close(grad, ref[3][j], f"expert {j} grad")


def check_all_to_all_dispatch(group, rng):
    """Experts spread over ranks that hold different tokens (all-to-all), against all tokens and all experts on one
    device: each rank's outputs and token and routing-weight gradients are the single device's for its tokens,
    and each expert's gradient, on the rank that holds it, is the single device's over every token."""
    tokens, hidden, counts, k = 12, 4, [4, 2], 2
    experts = [rng.normal(size=(hidden, hidden)).astype("float32") for _ in range(sum(counts))]
    x = rng.normal(size=(tokens, hidden)).astype("float32")
    ids = np.stack([rng.permutation(sum(counts))[:k] for _ in range(tokens)])
    ids[: tokens // 2, 0] = 0  # one rank's tokens crowd an expert of the other's, so rows cross unevenly
    weights = rng.random(size=(tokens, k)).astype("float32")
    upstream = rng.normal(size=(tokens, hidden)).astype("float32")

    def run(dispatcher, rows_of, expert_ids):
        n = len(rows_of)
        xs, ws = leaf(x[rows_of]), leaf(weights[rows_of])
        params = [leaf(experts[j]) for j in expert_ids]
        rows, per_expert, state = dispatcher.dispatch(xs, paddle.arange(n), paddle.to_tensor(ids[rows_of]), ws,
                                                      sum(counts), None)
        outputs = [paddle.matmul(i, p) for i, p in zip(paddle.split(rows, per_expert, axis=0), params)]
        out = dispatcher.combine(paddle.concat(outputs, axis=0), state, n)
        (out * paddle.to_tensor(upstream[rows_of])).sum().backward()
        return out.numpy(), xs.grad.numpy(), ws.grad.numpy(), [p.grad.numpy() for p in params]

    ref = run(LocalDispatcher(), np.arange(tokens), list(range(sum(counts))))
    mine = [j for s, n in zip([0, 4], counts) for j in range(s + group.rank * n // 2, s + (group.rank + 1) * n // 2)]
    rows = np.arange(group.rank * tokens // 2, (group.rank + 1) * tokens // 2)
    got = run(ExpertParallelDispatcher(counts, group), rows, mine)
    close(got[0], ref[0][rows], "all-to-all combined output")
    close(got[1], ref[1][rows], "all-to-all token grad")
    close(got[2], ref[2][rows], "all-to-all routing weight grad")
    for j, grad in zip(mine, got[3]):
        close(grad, ref[3][j], f"all-to-all expert {j} grad")


def check_grad_sync(group, rng):
    """Two data ranks, each its own inputs; a shared weight and an expert held by one rank only. Overlapped,
    the shared gradient is the two ranks' mean once the backward pass returns (before ``finish``), over two
    accumulated micro-batches of which only the second's backward syncs; a step that is not one pass, and the
    sync after the backward, give the same gradients after ``finish``. The expert's is its own over 2."""
    rank = group.rank
    env = DistEnv(rank=rank, world_size=2, data_world=2, data_group=group)
    shared_w = rng.normal(size=(4, 3)).astype("float32")
    expert_w = rng.normal(size=(3, 3)).astype("float32")
    inputs = [rng.normal(size=(2, 5, 4)).astype("float32") for _ in range(4)]  # [rank x micro-batch]
    mine = inputs[2 * rank: 2 * rank + 2]

    def grads(xs):  # the local gradients, no sync
        s, e = leaf(shared_w), leaf(expert_w)
        for x in xs:
            paddle.matmul(paddle.matmul(paddle.to_tensor(x), s), e).square().sum().backward()
        return s.grad.numpy(), e.grad.numpy()

    local = [grads(inputs[0:2]), grads(inputs[2:4])]
    want_shared, want_expert = (local[0][0] + local[1][0]) / 2, local[rank][1] / 2

    for overlap, one_pass in ((True, True), (True, False), (False, True)):
        s = paddle.create_parameter([4, 3], "float32", default_initializer=paddle.nn.initializer.Assign(shared_w))
        e = paddle.create_parameter([3, 3], "float32", default_initializer=paddle.nn.initializer.Assign(expert_w))
        sync = GradSync({"non_expert": [s], "expert": [e]}, env, overlap, one_pass=lambda one_pass=one_pass: one_pass)
        for i, x in enumerate(mine):
            loss = paddle.matmul(paddle.matmul(paddle.to_tensor(x), s), e).square().sum()
            if i == len(mine) - 1:
                sync.expect_backward([loss])
            loss.backward()
        what = f"overlap={overlap}, one pass={one_pass}"
        if overlap and one_pass:
            close(s.grad.numpy(), want_shared, f"shared gradient synced during the backward ({what})")
        sync.finish()
        close(s.grad.numpy(), want_shared, f"shared gradient ({what})")
        close(e.grad.numpy(), want_expert, f"expert gradient ({what})")


def check_vision_over_frame_shares(group, rng):
    """The ViT over each rank's share of the frames (sequence parallelism), gathered, equals the ViT over all
    of them; each weight's gradients summed over the ranks (as grad sync does) equal the whole batch's. Three
    images on two ranks, and one image on two ranks (one rank runs none)."""
    from ernie_moe.config import load_config
    from ernie_moe.model.vision import VisionTransformer
    from ernie_moe.parallel.plan import ParallelPlan

    cfg = load_config(None, ["model.vision_config.depth=2"]).model.vision_config
    plan = ParallelPlan(0.02, tp_group=group, sequence_parallel=True)
    for grids in (np.array([[1, 4, 4], [3, 2, 2], [1, 2, 4]]), np.array([[1, 2, 2]])):
        patches = rng.normal(size=(int(grids.prod(axis=1).sum()), cfg.in_channels * cfg.patch_size ** 2))
        upstream = paddle.to_tensor(rng.normal(size=(patches.shape[0], cfg.embed_dim)).astype("float32"))
        paddle.seed(0)
        whole = VisionTransformer(cfg)
        paddle.seed(0)
        split = plan.vision_encoder(VisionTransformer(cfg))
        x = paddle.to_tensor(patches.astype("float32"))
        want = whole(x, grids)
        (want * upstream).sum().backward()
        got = plan.vision_features(split, x, grids)
        close(got.numpy(), want.numpy(), f"ViT features over frame shares ({len(grids)} images)")
        (got * upstream).sum().backward()
        for (name, p_whole), p_split in zip(whole.named_parameters(), split.parameters()):
            summed = p_split.grad.clone()
            dist.all_reduce(summed, group=group)
            want_grad = p_whole.grad.numpy()  # sums over ~16 patches in another order: float32 rounding of its scale
            np.testing.assert_allclose(summed.numpy(), want_grad, rtol=1e-5, atol=1e-6 * np.abs(want_grad).max(),
                                       err_msg=f"ViT {name} gradient summed over the ranks")


if __name__ == "__main__":
    cpu_fallbacks.use_private_group_rendezvous()
    dist.init_parallel_env()
    group = dist.new_group([0, 1])
    rng = np.random.default_rng(0)  # the same draws on both ranks
    check_linears(group, rng, sequence_parallel=False)
    check_linears(group, rng, sequence_parallel=True)
    check_embedding_and_loss(group, rng)
    check_expert_dispatch(group, rng)
    check_all_to_all_dispatch(group, rng)
    check_grad_sync(group, rng)
    check_vision_over_frame_shares(group, rng)
    print(f"tensor-parallel layers OK on rank {dist.get_rank()}")
