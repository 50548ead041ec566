"""The objectives by name (``training.stage``): each registers how it is built from the training settings, and a
program may register its own beside the package's, which a config then names like any other."""

from __future__ import annotations

from collections.abc import Callable

import paddle

from ..config import ConfigError
from ..config.schema import STAGES, TrainingConfig
from .base import Objective

# a sum over the data ranks (None where the objective is read for its rules, as the memory planner does, not run)
ReduceSum = Callable[[paddle.Tensor], paddle.Tensor] | None
Builder = Callable[[TrainingConfig, ReduceSum], Objective]

_BUILDERS: dict[str, Builder] = {}


def register(stage: str, build: Builder) -> None:
    """``training.stage: <stage>`` trains ``build(training settings, sum over the data ranks)``."""
    _BUILDERS[stage] = build
    if stage not in STAGES:
        STAGES.append(stage)


def build_objective(training_cfg: TrainingConfig, env=None) -> Objective:
    """``training.stage``'s objective. ``env``: None where the objective is read for its rules, not run."""
    build = _BUILDERS.get(training_cfg.stage)
    if build is None:
        raise ConfigError(f"training.stage {training_cfg.stage!r} names no registered objective (registered: "
                          f"{', '.join(sorted(_BUILDERS))})")
    return build(training_cfg, None if env is None else (lambda x: env.all_reduce_sum(x, env.data_group)))
