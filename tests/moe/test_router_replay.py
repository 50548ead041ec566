"""Router replay (``moe.replay``): a layer given another pass's record routes its tokens exactly as that pass did,
where its own capacity or a moved correction bias would route them differently."""

from __future__ import annotations

from collections import deque

import numpy as np
import paddle
from support.models import inputs, make_layer

from ernie_moe.moe.replay import DROPPED, NOT_RECORDED


def differ(a, b) -> bool:
    """Whether some output moved by more than a tenth of the outputs' scale."""
    return np.abs(a - b).max() > 0.1 * np.abs(b).max()


def impose(layer, *routes):
    """The routes of the layer's next forwards, in order (what ``moe.replay.replayed`` sets)."""
    layer.routes_in, layer.routes_recomputed = deque(routes), deque()


def forward(layer, x, types, routes_in=None, record=False):
    if routes_in is not None:
        impose(layer, routes_in)
    layer.routes_out = [] if record else None
    try:
        out, _ = layer(paddle.to_tensor(x), paddle.to_tensor(types))
        return out.numpy(), (layer.routes_out[0] if record else None)
    finally:
        layer.routes_in = layer.routes_recomputed = layer.routes_out = None


def test_replay_keeps_the_recorded_drops_where_capacity_would_keep_them():
    layer, _ = make_layer("model.moe_capacity=[0.6, 4.0, 4.0]")  # training drops choices, evaluation keeps all
    x, types = inputs(n=30)
    types[0, :2] = -1  # padding: no expert
    layer.train()
    sampled, record = forward(layer, x, types, record=True)
    kinds = record.numpy()
    assert (kinds == DROPPED).any() and (kinds >= 0).any()
    assert (kinds[:2] == NOT_RECORDED).all() and (kinds[2:] != NOT_RECORDED).all()
    vision = kinds[2:][types[0, 2:] >= 1]
    assert ((vision == DROPPED) | (vision >= 4)).all()  # vision tokens went to the vision experts (ids 4..6)

    layer.eval()
    free, _ = forward(layer, x, types)
    replayed, _ = forward(layer, x, types, routes_in=record)
    assert differ(free, sampled)  # the evaluation's capacity routes differently
    np.testing.assert_allclose(replayed, sampled, rtol=1e-5, atol=1e-9)


def test_replay_holds_the_routing_when_the_correction_bias_moves():
    layer, _ = make_layer("model.moe_use_aux_free=true")
    x, types = inputs(n=30)
    layer.train()
    sampled, record = forward(layer, x, types, record=True)
    layer.moe_statics.e_score_correction_bias.set_value(paddle.to_tensor(
        np.random.default_rng(3).normal(0, 1.0, layer.moe_statics.e_score_correction_bias.shape).astype("float32")))
    moved, _ = forward(layer, x, types)
    assert differ(moved, sampled)
    x_in = paddle.to_tensor(x, stop_gradient=False)
    impose(layer, record)
    try:
        out, loss = layer(x_in, paddle.to_tensor(types))
        (out.square().sum() + loss).backward()
    finally:
        layer.routes_in = layer.routes_recomputed = None
    np.testing.assert_allclose(out.numpy(), sampled, rtol=1e-5, atol=1e-9)
    assert float(layer.gate.weight.grad.abs().sum()) > 0  # the mixing weights still train the router


def test_tokens_not_recorded_are_routed_by_the_router():
    layer, _ = make_layer()
    x, types = inputs(n=12)
    layer.eval()
    free, record = forward(layer, x, types, record=True)
    partial = record.numpy().copy()
    partial[::2] = NOT_RECORDED
    replayed, _ = forward(layer, x, types, routes_in=paddle.to_tensor(partial))
    np.testing.assert_allclose(replayed, free, rtol=1e-5, atol=1e-9)
