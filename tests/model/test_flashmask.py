"""FlashMask-form attention (``nn.flashmask``) against attention under the dense mask it describes."""

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from ernie_moe.data.encoding.packing import document_ends, document_starts
from ernie_moe.model.attention import core_attention
from ernie_moe.nn.flashmask import RowBounds, block_attention

DOCS = np.stack([np.repeat(np.arange(4), [9, 1, 14, 6]), np.repeat([0, 1], [29, 1])])  # mixed lengths, 30 tokens


def _inputs(seed: int, seq: int = DOCS.shape[1], heads: int = 4, kv_heads: int = 2, dim: int = 8):
    rng = np.random.default_rng(seed)
    tensors = [paddle.to_tensor(rng.standard_normal([2, seq, n, dim]).astype("float32"))
               for n in (heads, kv_heads, kv_heads)]
    for t in tensors:
        t.stop_gradient = False
    return tensors, paddle.to_tensor(rng.standard_normal([2, seq, heads, dim]).astype("float32"))


def _bounds(causal: bool) -> RowBounds:
    ends = paddle.to_tensor(np.stack([document_ends(d) for d in DOCS]))
    starts = None if causal else paddle.to_tensor(np.stack([document_starts(d) for d in DOCS]))
    return RowBounds(ends, starts)


def _output_and_gradients(run, inputs, probe):
    out = run(*inputs)
    return [out.numpy()] + [g.numpy() for g in paddle.grad([(out * probe).sum()], inputs)]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("block_rows", [4, 7, 512])
def test_block_attention_equals_attention_under_the_dense_mask(causal, block_rows):
    inputs, probe = _inputs(0)
    bounds = _bounds(causal)
    dense = bounds.dense(DOCS.shape[1])
    same = DOCS[:, :, None] == DOCS[:, None, :]  # the mask written out: a document's tokens see each other
    expected_mask = same & np.tril(np.ones_like(same[0])) if causal else same
    np.testing.assert_array_equal(dense.numpy()[:, 0], expected_mask)
    ours = _output_and_gradients(lambda q, k, v: block_attention(q, k, v, bounds, block_rows), inputs, probe)
    reference = _output_and_gradients(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense),
                                      inputs, probe)
    for name, a, b in zip(["output", "q", "k", "v"], ours, reference):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6, err_msg=name)


def test_a_document_sees_nothing_of_its_neighbours():
    """Changing the second document's values leaves the other documents' outputs as they were."""
    (q, k, v), _ = _inputs(1)
    bounds = _bounds(causal=True)
    before = block_attention(q, k, v, bounds, 4).numpy()
    changed = v.numpy().copy()
    changed[0, 9:10] += 100.0  # the one-token document
    after = block_attention(q, k, paddle.to_tensor(changed), bounds, 4).numpy()
    np.testing.assert_array_equal(np.abs(after - before).max(axis=(2, 3))[0] > 0, DOCS[0] == 1)


def test_the_last_rows_alone_give_what_the_whole_sequence_gives_them():
    """Generation's step: queries that are the last rows, every earlier key cached."""
    (q, k, v), _ = _inputs(2)
    full = RowBounds(paddle.full([2, 30], 30, dtype="int64"))
    whole = core_attention(q, k, v, full).numpy()
    last = core_attention(q[:, 26:], k, v, RowBounds(full.ends, first_row=26)).numpy()
    np.testing.assert_allclose(last, whole[:, 26:], rtol=1e-5, atol=1e-6)
