"""Small models, inputs and references the unit tests share."""

from collections import Counter

import numpy as np
import paddle

from ernie_moe.checkpoint.pretrained import load_pretrained
from ernie_moe.config import load_config
from ernie_moe.data import RowStream, build_datasets, build_tokenizer, collate, rank_batches
from ernie_moe.data.formats.sample import Chunk, Sample
from ernie_moe.data.formats.synthetic import SyntheticShapes
from ernie_moe.generation.prompts import prompt_encoder
from ernie_moe.moe.layer import MoELayer
from ernie_moe.nn.init import init_layer
from ernie_moe.parallel import SingleDevicePlan
from ernie_moe.parallel.env import DistEnv
from ernie_moe.training.runner import build_model


def first_rows(cfg, rows=2):
    tok = build_tokenizer(cfg)
    train, _ = build_datasets(cfg)
    return next(rank_batches(RowStream(train, tok, cfg, Counter(), True), rows, 0, 1))


def first_batch(cfg, rows=2):
    return collate(first_rows(cfg, rows))


def numpy_rope(x, pos, theta, t_slots):
    """Reference: slot i rotates pair (2i, 2i+1) by pos[axis(i)] * theta^(-2i/D)."""
    dim = x.shape[-1]
    half = dim // 2
    inv = theta ** (-(2.0 * np.arange(half)) / dim)
    axis = [0 if i >= half - t_slots else 1 + i % 2 for i in range(half)]
    ang = pos[..., axis].astype(np.float64) * inv  # [B, S, half]
    cos, sin = np.cos(ang)[:, :, None], np.sin(ang)[:, :, None]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    return out


def make_layer(*overrides, seed=0):
    cfg = load_config(None, ["model.hidden_size=16", "model.moe_num_experts=[4, 3]",
                             "model.moe_intermediate_size=[8, 6]", "model.moe_k=2", *overrides]).model
    paddle.seed(seed)
    layer = init_layer(MoELayer(SingleDevicePlan(), cfg, [0, 1], layer_idx=1), seed)
    return layer, cfg


def inputs(n=24, seed=1, vision_every=3):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, n, 16)).astype(np.float32)
    types = np.array([[1 if i % vision_every == 0 else 0 for i in range(n)]])
    return x, types


def side_by_side_prompts(cfg):
    """Prompts of different lengths: an image and text, text alone, more text, two images and text."""
    tokenizer = build_tokenizer(cfg)
    encoder = prompt_encoder(tokenizer, cfg.model, cfg.data)
    shapes = SyntheticShapes(0, "eval", 4, cfg.data.image_size)
    samples = [Sample(shapes[0].images, [Chunk(image=0), *shapes[0].chunks[1:3]]),
               Sample([], shapes[1].chunks[1:2]),
               Sample([], shapes[2].chunks[1:4]),
               Sample(shapes[3].images + shapes[0].images, [Chunk(image=0), Chunk(image=1), *shapes[3].chunks[1:2]])]
    return [encoder.prompt(sample) for sample in samples]


def imported(directory, *overrides):
    """(config, model, load report) of the model folder ``directory`` read into a model built for it."""
    cfg = load_config(None, [f"training.model_name_or_path={directory}", *overrides])
    paddle.seed(0)
    model = build_model(cfg.model, DistEnv())
    return cfg, model, load_pretrained(model, directory)
