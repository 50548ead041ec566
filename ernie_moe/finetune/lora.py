"""LoRA: a trainable low-rank pair beside chosen linear layers of a built model (Hu et al., PaddleFormers' form).

``y = base(x) + dropout(x) A B * scaling`` with ``A [in, r]``, ``B [r, out]`` (Paddle's ``[in, out]`` order),
``scaling = alpha / r`` (``alpha / sqrt(r)`` with rsLoRA), B zero at the start so the model starts as the
base. The wrapped layer keeps the base weight under the base layer's own name, so stable names, checkpoints
and pretrained loading see the same model; the pair is named ``<layer>.lora_A`` / ``<layer>.lora_B``.

Under tensor parallelism the pair is split with its base weight: beside a column-parallel layer B's columns
are split (A whole on every rank), beside a row-parallel one A's rows (B whole). The low-rank activation
crosses the tensor-parallel region the way the base layer's activation does, so every rank's A (or B)
gradient is the whole one, and under sequence parallelism the replicated factor is summed like a norm's.
Expert pairs live inside their experts, so they move with them (expert parallelism, ``moe_group: mp``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import paddle
from paddle import nn

from ..config.schema import TrainingConfig
from ..model.parameter_kinds import LORA_TARGETS, expert_id
from ..nn.init import init_weights
from ..nn.param_spec import describe, full_shape, spec_of
from ..nn.sharding import sharded_parameter
from ..parallel import tensor_parallel as tp
from ..parallel.pipeline import TrainedModel

# ``training.lora_targets``: groups (``LORA_TARGETS``), or regular expressions matched in full against a layer's
# stable name (``model.layers.3.self_attn.qkv_proj``)
DEFAULT_TARGETS = ["attention", "mlp", "shared_experts", "text_experts", "vision_experts"]


@dataclass(frozen=True)
class LoRASettings:
    rank: int
    alpha: float
    targets: tuple[str, ...]  # groups (LORA_TARGETS) or regular expressions over stable layer names
    rslora: bool = False
    dropout: float = 0.0
    seed: int = 0  # A is drawn by name from it

    @classmethod
    def of(cls, training_cfg: TrainingConfig) -> LoRASettings:
        t = training_cfg
        return cls(t.lora_rank, t.lora_alpha, tuple(t.lora_targets), t.rslora, t.lora_dropout, t.seed)

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


class LoRALinear(nn.Layer):
    """A linear layer (plain, column- or row-parallel) with a LoRA pair beside it."""

    def __init__(self, base: nn.Layer, settings: LoRASettings):
        super().__init__()
        self._base = [base]  # called, not registered: its weight is registered here under the same name
        self.weight = base.weight
        if getattr(base, "bias", None) is not None:
            self.bias = base.bias
        rank = settings.rank
        self.scaling = settings.scaling
        self.switched_on = True  # off: the base layer alone (a preference run's reference model)
        self.dropout = nn.Dropout(settings.dropout) if settings.dropout > 0 else None
        self.split = ("column" if isinstance(base, tp.ColumnParallelLinear)
                      else "row" if isinstance(base, tp.RowParallelLinear) else None)
        in_features, out_features = full_shape(base.weight)
        a_shape, b_shape = [in_features, rank], [rank, out_features]
        self.lora_A = (self._split(a_shape, 0, [in_features]) if self.split == "row" else self._factor(a_shape))
        split = spec_of(base.weight).split  # a column-parallel weight's: its fused segments
        self.lora_B = (self._split(b_shape, 1, split.segments if split is not None else [out_features])
                       if self.split == "column" else self._factor(b_shape))
        # PaddleFormers' Kaiming-uniform (a = sqrt(5)) for A, drawn by name from the whole tensor; B stays zero
        describe(self.lora_A, init=("uniform", 1.0 / math.sqrt(in_features)))
        describe(self.lora_B, init=None)
        if self.split is not None and base.sequence_parallel:
            # the replicated factor sees a piece of the sequence on each rank: its gradient is partial
            describe(self.lora_A if self.split == "column" else self.lora_B, partial_over_tp=True)
        elif spec_of(base.weight).partial_over_tp:  # a whole layer over a share of the tokens (the ViT's frames)
            describe(self.lora_A, partial_over_tp=True)
            describe(self.lora_B, partial_over_tp=True)
        for factor in (self.lora_A, self.lora_B):  # an expert's pair is as local as its expert
            describe(factor, local_to_rank=spec_of(base.weight).local_to_rank)

    def _factor(self, shape: list[int]):
        return self.create_parameter(shape, dtype=self.weight.dtype,
                                     default_initializer=nn.initializer.Constant(0.0))

    def _split(self, shape: list[int], axis: int, segments: Sequence[int]):
        """This rank's slice of a factor split along ``axis`` as the base weight is (its fused segments)."""
        return sharded_parameter(self, shape, axis, list(segments), self.base.group, 0.0)

    @property
    def base(self) -> nn.Layer:
        return self._base[0]

    def forward(self, x):
        if not self.switched_on:
            return self.base(x)
        low = paddle.matmul(self.dropout(x) if self.dropout is not None else x, self.lora_A)
        if self.split == "column":
            low = tp.enter_region(low, self.base.group, self.base.sequence_parallel)
        elif self.split == "row":
            low = tp.leave_region(low, self.base.group, self.base.sequence_parallel)
        return self.base(x) + paddle.matmul(low, self.lora_B) * self.scaling


_LINEARS = (nn.Linear, tp.ColumnParallelLinear, tp.RowParallelLinear, LoRALinear)


def linear_layers(model: TrainedModel) -> list[tuple[str, nn.Layer, str, nn.Layer]]:
    """(stable name, parent, attribute, layer) of every linear layer of ``model`` (this rank's part), a base layer
    held quantised (``finetune.quantize``) included."""
    stable = {id(p): n for n, p in model.stable_named_parameters()}
    found, seen = [], set()
    for parent in model.sublayers(include_self=True):
        if isinstance(parent, LoRALinear):  # its quantised base (finetune.quantize) is the LoRA layer's
            continue
        for attr, child in parent._sub_layers.items():
            name = _layer_name(child, stable)
            if name is not None and (id(parent), attr) not in seen:
                seen.add((id(parent), attr))
                found.append((name, parent, attr, child))
    return found


def _layer_name(layer: nn.Layer, stable: dict) -> str | None:
    """A linear layer's stable name (by its weight, or its pair's where the base weight is held quantised)."""
    if isinstance(layer, LoRALinear):
        name = stable.get(id(layer.lora_A))
        return name[: -len(".lora_A")] if name else None
    if isinstance(layer, _LINEARS):
        name = stable.get(id(layer.weight))
        return name[: -len(".weight")] if name else None
    return getattr(layer, "stable_name", None)


def target_matcher(targets: list[str], vision_expert_start: int | None):
    """``matches(stable layer name) -> the targets it matches``; vision experts are those numbered from
    ``vision_expert_start`` (None: the model has no vision experts)."""
    def matches(name: str) -> list[str]:
        hits = []
        for target in targets:
            if not re.fullmatch(LORA_TARGETS.get(target, target), name):
                continue
            if target in ("text_experts", "vision_experts"):
                expert = expert_id(name)
                vision = vision_expert_start is not None and expert is not None and expert >= vision_expert_start
                if vision != (target == "vision_experts"):
                    continue
            hits.append(target)
        return hits

    return matches


def apply_lora(model: TrainedModel, settings: LoRASettings, vision_expert_start: int | None) -> dict[str, list[str]]:
    """Put a LoRA pair beside every linear layer a target matches; draws A by name from ``settings.seed``.
    Returns the layers (stable names) each target matched on this rank."""
    matches = target_matcher(list(settings.targets), vision_expert_start)
    matched: dict[str, list[str]] = {target: [] for target in settings.targets}
    for name, parent, attr, layer in linear_layers(model):
        hits = [] if isinstance(layer, LoRALinear) else matches(name)
        for target in hits:
            matched[target].append(name)
        if hits:
            setattr(parent, attr, LoRALinear(layer, settings))
    init_weights([(n, p) for n, p in model.stable_named_parameters() if is_lora(n)], settings.seed)
    return matched


def is_lora(name: str) -> bool:
    return name.endswith((".lora_A", ".lora_B"))

