"""Initial weights drawn by name.

Every random parameter's starting value depends only on the seed and its stable name (the name it has in the
exported model), never on the order layers are built in or on which rank holds it. So a tensor-parallel slice,
an expert on another rank, or a layer built on a pipeline stage (fleet's ``PipelineLayer`` reseeds per layer)
starts exactly as in the single-device model. Parameters are created with a constant and carry an
``init_rule``; this module draws them afterwards.
"""

from __future__ import annotations

import zlib

import numpy as np

from .sharding import shard_of


def mark_normal(param, std: float):
    param.init_rule = ("normal", std)
    return param


def mark_xavier_uniform(param):
    param.init_rule = ("xavier_uniform",)
    return param


def mark_default_rules(layer) -> None:
    """Plain Paddle layers (the ViT, the adapter): 2-D weights ``[in, out]`` get Xavier-uniform; vectors keep
    their constant (LayerNorm 1, biases 0)."""
    for param in layer.parameters():
        if len(param.shape) == 2 and not hasattr(param, "init_rule"):
            mark_xavier_uniform(param)


def full_shape(param) -> list[int]:
    """The shape of the whole tensor a tensor-parallel slice comes from."""
    return list(getattr(param, "full_shape", param.shape))


def draw(rule: tuple, shape: list[int], rng: np.random.Generator) -> np.ndarray:
    if rule[0] == "normal":
        return rng.normal(0.0, rule[1], shape).astype("float32")
    if rule[0] == "xavier_uniform":
        limit = float(np.sqrt(6.0 / (shape[0] + shape[1])))
        return rng.uniform(-limit, limit, shape).astype("float32")
    if rule[0] == "uniform":
        return rng.uniform(-rule[1], rule[1], shape).astype("float32")
    raise ValueError(f"unknown init rule {rule}")


def init_weights(stable_parameters, seed: int) -> None:
    """Draw every parameter that has an ``init_rule``; ``stable_parameters`` yields (stable name, parameter)."""
    for name, param in stable_parameters:
        rule = getattr(param, "init_rule", None)
        if rule is None:
            continue
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        value = draw(rule, full_shape(param), rng)
        param.set_value(shard_of(param, value))


def init_layer(layer, seed: int = 0):
    """Draw a stand-alone layer's weights under its own parameter names (tests, benchmarks)."""
    init_weights(layer.named_parameters(), seed)
    return layer
