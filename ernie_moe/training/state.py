"""What a run carries from step to step, apart from the weights and the optimizer: its position, what the
memory guard changed, and the result of each step."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import paddle

from ..config.schema import TrainingConfig


@dataclass
class TrainingState:
    """Where the run is and how it steps now; saved in each checkpoint's ``trainer_state.json``. The config
    stays as the user wrote it: the memory guard changes these fields instead."""

    step: int = 0  # optimizer steps taken (the data position is the data feed's, saved beside this)
    micro_batch_size: int = 1  # rows per device and micro-batch
    accumulation_steps: int = 1  # micro-batches per optimizer step
    recompute: str | None = None  # the recompute granularity in force (None: nothing is recomputed)
    recompute_layers: int | list[int] = 0  # which decoder layers recompute (see ``model.recompute``)
    capacity_until: int | None = None  # the memory guard's capacity rung holds through this step (None: not taken)

    @classmethod
    def start(cls, training_cfg: TrainingConfig) -> TrainingState:
        t = training_cfg
        return cls(micro_batch_size=t.per_device_train_batch_size, accumulation_steps=t.gradient_accumulation_steps,
                   recompute=t.recompute_granularity if t.recompute else None, recompute_layers=t.recompute_layers)


@dataclass
class StepResult:
    """One optimizer step: sums over every rank, and what the step did. The figures marked *device* stay on the
    device as the step leaves them; :meth:`read` (for a window of steps: :func:`read_results`) makes them host
    numbers."""

    lm_loss_sum: float | paddle.Tensor  # *device* cross-entropy summed over the step's label tokens
    label_tokens: float | paddle.Tensor  # *device*
    router_loss: float | paddle.Tensor  # *device* weighted router losses, mean over micro-batches and data ranks
    tokens: float | paddle.Tensor  # *device* text and image tokens read
    rows: int = 0
    lr: float = 0.0
    # gradient norms before clipping (the global one read by the step's finite check, the others *device*); None
    # when the step was skipped for non-finite gradients
    grad_norm: float | None = None
    grad_norm_expert: float | paddle.Tensor | None = None
    grad_norm_non_expert: float | paddle.Tensor | None = None
    loss_scale: float = 1.0
    flops: float = 0.0
    time: float = 0.0  # seconds, from reading the data to the cleared gradients
    data_wait: float = 0.0  # seconds of it spent waiting for the step's rows
    times: dict[str, float] = field(default_factory=dict)  # seconds of each timed part (``ernie_moe.timing``)
    memory_guard_rungs: int = 0  # rungs the memory guard took in this step
    # *device* the objective's figures (objectives.Objective.figures), summed over the step's rows
    figures: list[float] | paddle.Tensor | None = None
    # *device* the multi-token prediction depths' loss sums, then their label counts (None: no MTP trains)
    mtp: list[float] | paddle.Tensor | None = None
    # a step skipped for inf/nan gradients: how many tensors held them, by part of the model (``precision.layer_of``)
    nonfinite: dict[str, int] = field(default_factory=dict)

    @property
    def skipped(self) -> bool:
        return self.grad_norm is None

    def read(self) -> StepResult:
        """This step's device figures as host numbers (one read); returns the result itself."""
        return read_results([self])[0]


def read_results(results: list[StepResult]) -> list[StepResult]:
    """Every device figure of the results as host numbers, read back in one copy (once per logging window)."""
    pending = [(result, name, getattr(result, name)) for result in results for name in _DEVICE_FIGURES
               if isinstance(getattr(result, name), paddle.Tensor)]
    if not pending:
        return results
    values = paddle.concat([value.reshape([-1]).astype("float64") for _, _, value in pending]).numpy()
    at = 0
    for result, name, value in pending:
        size = int(np.prod(value.shape))
        setattr(result, name, values[at: at + size].tolist() if name in _LISTS else float(values[at]))
        at += size
    return results


_DEVICE_FIGURES = ("lm_loss_sum", "label_tokens", "router_loss", "tokens", "grad_norm_expert", "grad_norm_non_expert",
                   "figures", "mtp")
_LISTS = ("figures", "mtp")  # the figures read back as lists
