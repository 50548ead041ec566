"""Initial weights drawn by name.

Every random parameter's starting value depends only on the seed and its stable name (the name it has in the
exported model), never on the order layers are built in or on which rank holds it. So a tensor-parallel slice,
an expert on another rank, or a layer built on a pipeline stage (fleet's ``PipelineLayer`` reseeds per layer)
starts exactly as in the single-device model. Parameters are created with a constant and their record
(``param_spec``) names a rule; this module draws them afterwards.
"""

from __future__ import annotations

import zlib

import numpy as np

from .param_spec import describe, full_shape, spec_of
from .sharding import shard_of


def mark_normal(param, std: float):
    return describe(param, init=("normal", std))


def mark_xavier_uniform(param):
    return describe(param, init=("xavier_uniform",))


def mark_default_rules(layer) -> None:
    """Plain Paddle layers (the ViT, the adapter): 2-D weights ``[in, out]`` get Xavier-uniform; vectors keep
    their constant (LayerNorm 1, biases 0)."""
    for param in layer.parameters():
        if len(param.shape) == 2 and spec_of(param).init is None:
            mark_xavier_uniform(param)


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
    """Draw every parameter whose record has a rule; ``stable_parameters`` yields (stable name, parameter)."""
    for name, param in stable_parameters:
        rule = spec_of(param).init
        if rule is None:
            continue
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        value = draw(rule, full_shape(param), rng)
        param.set_value(shard_of(param, value))


def init_layer(layer, seed: int = 0):
    """Draw a stand-alone layer's weights under its own parameter names (tests, benchmarks)."""
    init_weights(layer.named_parameters(), seed)
    return layer
