"""Mixed precision: autocast, the O2 cast of the model, fp16 loss scaling, and skipping steps whose gradients
are not finite.

- ``bf16`` / ``fp16`` with ``fp16_opt_level`` O1 (weights stay float32, matmuls run in low precision under
  autocast) or O2 (weights cast to low precision, float32 master weights in the optimizer, float32 gradients
  with ``amp_master_grad``). Routers, RMSNorm, LayerNorm and the correction bias stay float32 (their layers
  are left out of the cast and the router computes under a float32 region).
- fp16 scales the loss (``scale_loss``): gradients are unscaled before clipping; a step with inf/nan gradients
  halves the scale, ``scale_incr_every`` finite steps in a row double it.
- Any precision: a step whose global gradient norm is not finite is skipped (no update) and counted;
  ``max_skipped_steps`` of them in a row stop training with :class:`NonFiniteGradients`.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from typing import Any

import paddle
from paddle import nn

from .. import host_reads
from ..config.schema import TrainingConfig
from ..moe.layer import MoEStatics
from ..moe.router import Router
from ..nn.layers import RMSNorm
from ..parallel.env import DistEnv
from ..parallel.pipeline import TrainedModel

# Layers whose weights stay float32 under O2
FLOAT32_LAYERS: list[nn.Layer | type[nn.Layer]] = [Router, RMSNorm, MoEStatics, nn.LayerNorm]


class NonFiniteGradients(RuntimeError):
    """Too many steps with inf/nan gradients (in a row, or in the whole run): training failed."""


def layer_of(name: str) -> str:
    """The part of the model a parameter's stable name belongs to: ``layers.<i>`` for a decoder layer (its MoE
    block, attention, norms), else its first component (``vision_model``, ``lm_head``, ``embed_tokens``, ...)."""
    parts = name.removeprefix("model.").split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" and len(parts) > 1 else parts[0]


@paddle.no_grad()
def nonfinite_gradients(named: list[tuple[str, paddle.Tensor]]) -> list[str]:
    """The names of the parameters of ``named`` whose gradient holds inf or nan (one read back for all)."""
    held = [(name, p.grad) for name, p in named if p.grad is not None]
    if not held:
        return []
    finite = host_reads.read(paddle.stack([paddle.isfinite(g).all() for _, g in held]), "nonfinite")
    return [name for (name, _), ok in zip(held, finite) if not ok]


class Precision:
    def __init__(self, training_cfg: TrainingConfig):
        t = training_cfg
        self.dtype = "bfloat16" if t.bf16 else "float16" if t.fp16 else None
        self.level = t.fp16_opt_level
        self.master_grad = t.amp_master_grad
        self.loss_scale = float(t.scale_loss) if t.fp16 else 1.0
        self.incr_every = t.scale_incr_every
        self.max_skipped = t.max_skipped_steps
        self.finite_in_a_row = 0
        self.skipped_in_a_row = 0
        self.skipped = 0

    def state_dict(self) -> dict:
        return {"dtype": self.dtype, "loss_scale": self.loss_scale, "finite_in_a_row": self.finite_in_a_row,
                "skipped_in_a_row": self.skipped_in_a_row, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        if self.dtype == state.get("dtype") == "float16":  # a scale saved by another precision does not apply
            self.loss_scale = state["loss_scale"]
        self.finite_in_a_row = state["finite_in_a_row"]
        self.skipped_in_a_row = 0  # a resume starts a fresh count: it does not inherit a streak
        self.skipped = state["skipped"]

    @property
    def enabled(self) -> bool:
        return self.dtype is not None

    @property
    def o2(self) -> bool:
        return self.enabled and self.level == "O2"

    def cast_model(self, model: TrainedModel) -> None:
        """O2: weights to low precision, except the float32 layers. Paddle leaves the model as it is on a CPU
        (no low-precision matmul kernels there), where mixed precision runs in float32."""
        if self.o2:
            dtype: Any = self.dtype  # bfloat16 or float16 under O2
            paddle.amp.decorate(models=model, level="O2", dtype=dtype, master_grad=self.master_grad,
                                excluded_layers=FLOAT32_LAYERS)

    def autocast(self):
        if not self.enabled:
            return contextlib.nullcontext()
        return paddle.amp.auto_cast(enable=True, dtype=self.dtype, level=self.level)

    def scale(self, loss: paddle.Tensor) -> paddle.Tensor:
        """The loss the backward pass starts from (fleet's pipeline schedule calls this too)."""
        return loss * self.loss_scale if self.loss_scale != 1.0 else loss

    @paddle.no_grad()
    def unscale(self, params) -> None:
        if self.loss_scale != 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.multiply_(paddle.to_tensor(1.0 / self.loss_scale, dtype=p.grad.dtype))

    def nonfinite_parts(self, model: TrainedModel, env: DistEnv, step: int) -> dict[str, int]:
        """On a skipped step (every rank together): the tensors whose gradients held inf or nan on any rank,
        counted by part of the model, and said in one line by rank 0."""
        names = nonfinite_gradients(model.stable_named_parameters())
        if env.world_size > 1:  # each rank holds its own slices, experts and stages
            names = [n for mine in env.all_gather_object(names) for n in mine]
        named = sorted(set(names))
        counts = dict(Counter(layer_of(n) for n in named))
        if env.is_main:
            parts = ", ".join(f"{part} {n}" for part, n in counts.items()) or "none named"
            print(f"step {step} skipped: inf or nan gradients in {len(named)} tensor(s), {parts} (first: "
                  f"{named[0] if named else '-'}); loss scale now {self.loss_scale:g}", flush=True)
        return counts

    def step_is_finite(self, grad_norm: float, step: int) -> bool:
        """Whether the optimizer may step, given the step's global gradient norm (the same on every rank)."""
        if math.isfinite(grad_norm):
            self.skipped_in_a_row = 0
            self.finite_in_a_row += 1
            if self.dtype == "float16" and self.finite_in_a_row % self.incr_every == 0:
                self.loss_scale *= 2.0
            return True
        self.skipped += 1
        self.skipped_in_a_row += 1
        self.finite_in_a_row = 0
        if self.dtype == "float16":
            self.loss_scale = max(self.loss_scale / 2.0, 1.0)
        if self.max_skipped and self.skipped_in_a_row >= self.max_skipped:
            raise NonFiniteGradients(
                f"step {step}: the gradients held inf or nan in {self.skipped_in_a_row} steps in a row "
                f"(training.max_skipped_steps = {self.max_skipped}); stopping before the model is saved. Lower "
                "the learning rate, use bf16 instead of fp16, or resume from the last checkpoint.")
        return False
