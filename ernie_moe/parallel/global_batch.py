"""The global batch a run keeps at any world size: ``training.global_batch_size`` (or, for a restart of an
elastic job without it, the global batch of the job's first attempt) sets the gradient accumulation steps for the
processes there are, as Megatron's ``--global-batch-size`` does."""

from __future__ import annotations

import dataclasses

from ..config import Config, ConfigError
from .layout import Layout


def global_batch(cfg: Config, world: int) -> int:
    """Rows per optimizer step over every data rank of ``cfg`` on ``world`` processes."""
    t = cfg.training
    return t.per_device_train_batch_size * t.gradient_accumulation_steps * Layout.of(cfg.parallel, world).data_world


def for_world(cfg: Config, world: int, kept: int = 0) -> Config:
    """``cfg`` with the accumulation steps that give ``training.global_batch_size`` (else ``kept``; neither: ``cfg``
    as it is) on ``world`` processes; ConfigError when the per-device batch and data ranks cannot make it."""
    t = cfg.training
    target = t.global_batch_size or kept
    if not target:
        return cfg
    layout = Layout.of(cfg.parallel, world).check()
    per_pass = t.per_device_train_batch_size * layout.data_world
    if target % per_pass:
        source = ("training.global_batch_size" if t.global_batch_size else
                  "the job's first attempt, kept across its restarts")
        raise ConfigError(f"the global batch of {target} rows ({source}) cannot be made by {layout.data_world} data "
                          f"rank(s) of training.per_device_train_batch_size={t.per_device_train_batch_size}: it must "
                          f"be a multiple of {per_pass}. Choose a per-device batch that divides it over this world "
                          f"size ({world} processes).")
    return dataclasses.replace(cfg, training=dataclasses.replace(t, gradient_accumulation_steps=target // per_pass))
