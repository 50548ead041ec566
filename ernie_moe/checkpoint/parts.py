"""What a checkpoint saves and restores, as the parts a training run assembles present it (``training.assembly``):
small protocols for the pieces built above this folder, so that the checkpoint reads them without importing
them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import Field
from typing import Any, ClassVar, Protocol

import numpy as np
import paddle

from ..data.feeding.feed import Feed
from ..model.ernie_vl import ErnieMoEForConditionalGeneration
from ..parallel.pipeline import ErniePipeline


class Optimizer(Protocol):
    """AdamW, or the sharded and offloaded optimizers wrapping it (``training.optimizer``); a checkpoint reads
    the plain AdamW parts behind it (``checkpoint.adam_parts``)."""

    def step(self) -> None: ...

    def clear_grad(self, set_to_zero: bool = True) -> None: ...

    def get_lr(self) -> float: ...


class Schedule(Protocol):
    """The learning-rate schedule (``training.schedule``)."""

    def step(self, epoch: int | None = None) -> None: ...

    def plan(self) -> dict: ...

    def state_dict(self) -> dict: ...

    def set_state_dict(self, state_dict: dict) -> None: ...

    def resume(self, saved: dict | None, step: int, warm_restart: bool) -> str | None: ...


class LossScaling(Protocol):
    """Loss scaling and the skipped-step counts (``training.precision.Precision``)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class Position(Protocol):
    """The run's position (``training.state.TrainingState``): a dataclass of JSON values with ``step``."""

    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]
    step: int


class Averages(Protocol):
    """The moving average of the weights (``training.ema.WeightAverage``)."""

    updates: int

    @property
    def started(self) -> bool: ...

    def saved_states(self) -> list[tuple[str, paddle.Tensor, paddle.Tensor]]: ...

    def load(self, read: Callable[[str, paddle.Tensor], np.ndarray | None], updates: int) -> None: ...


class TrainingParts(Protocol):
    """What a checkpoint saves and restores: the run's assembled parts, handed whole."""

    @property
    def model(self) -> ErnieMoEForConditionalGeneration | ErniePipeline: ...  # or this rank's pipeline stages

    @property
    def optimizer(self) -> Optimizer: ...

    @property
    def scheduler(self) -> Schedule: ...

    @property
    def precision(self) -> LossScaling: ...

    @property
    def state(self) -> Position: ...

    @property
    def feed(self) -> Feed: ...  # the data feed: its position (``state_dict()``) is saved with the step

    @property
    def base(self) -> dict | None: ...  # a LoRA run's base model (``finetune.adapter_files.base_reference``)

    @property
    def ema(self) -> Averages | None: ...
