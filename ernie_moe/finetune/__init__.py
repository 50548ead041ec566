"""What trains in a run: full fine-tuning, LoRA (``finetune.lora``), frozen parts and per-part learning rates.

Applied once to the built model after its pretrained weights are in, before the optimizer is built: frozen
parameters take no gradient and the optimizer never sees them (no moments, no float32 master copy).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config.errors import ConfigError
from ..config.schema import ModelConfig, TrainingConfig
from ..model.parameter_kinds import LORA_TARGETS, PARTS, PATCH_EMBEDDING, VISION, is_router, vit_block
from ..parallel.env import DistEnv
from ..parallel.pipeline import TrainedModel
from .lora import LoRASettings, apply_lora, is_lora


@dataclass
class FineTuning:
    """What :func:`prepare_fine_tuning` did; parameter counts are this rank's (its slices and experts)."""

    mode: str
    trainable: int
    total: int
    lora_layers: dict[str, int]  # layers each target adapted in the whole model (a layer on several ranks once)
    adapted: int = 0  # layers with a LoRA pair in the whole model
    quantized: tuple[str, int] | None = None  # (wint8 | wint4, this rank's base linears held so)

    def describe(self) -> str:
        share = 100.0 * self.trainable / max(self.total, 1)
        what = f"LoRA on {self.adapted} linear layers" if self.mode == "lora" else "full fine-tuning"
        line = f"{what}: {self.trainable:,} of this rank's {self.total:,} parameters train ({share:.2f}%)"
        if self.quantized:
            line += f"; the base's {self.quantized[1]} language-model linears on this rank held in {self.quantized[0]}"
        return line


def frozen(name: str, training_cfg: TrainingConfig) -> bool:
    """Whether the parameter of this stable name is frozen by the run's settings."""
    if training_cfg.fine_tuning == "lora" and not is_lora(name):
        return True
    return any(PARTS[part](name) for part in training_cfg.freeze)


def prepare_fine_tuning(model: TrainedModel, training_cfg: TrainingConfig, model_cfg: ModelConfig,
                        env: DistEnv) -> FineTuning:
    """Add the LoRA pairs, freeze what does not train and stop the router-bias rule where routers are frozen.
    Every rank calls it (a target is checked against the layers of every pipeline stage)."""
    t = training_cfg
    counts: dict[str, int] = {}
    adapted = 0
    if t.fine_tuning == "lora":
        vision_start = model_cfg.moe_num_experts[0] if len(model_cfg.moe_num_experts) == 2 else None
        local = apply_lora(model, LoRASettings.of(t), vision_start)
        # a layer replicated over data or tensor ranks is one layer: count names, not ranks
        every = env.all_gather_object(local)
        names = {k: {n for rank in every for n in rank[k]} for k in local}
        counts = {k: len(v) for k, v in names.items()}
        adapted = len(set().union(*names.values()))
        # a group the model lacks (experts of a dense model) is no error; a pattern that matches nothing is
        missing = [k for k, n in counts.items() if n == 0 and (k not in LORA_TARGETS or not any(counts.values()))]
        if missing:
            raise ConfigError(f"training.lora_targets: {', '.join(map(repr, missing))} matched no linear layer of "
                              "this model (groups: " + ", ".join(LORA_TARGETS) + "; anything else is a regular "
                              "expression matched in full against a layer name such as "
                              "'model.layers.1.self_attn.qkv_proj')")
    named = model.stable_named_parameters(include_tied_copy=True)
    # LoRA pairs asked for in a frozen part would be made and never train: say so (every rank, as a stage may
    # hold the part alone)
    clashing = {part for name, _ in named if is_lora(name) for part in t.freeze if PARTS[part](name)}
    clashes = sorted(set().union(*env.all_gather_object(clashing))) if t.fine_tuning == "lora" else []
    if clashes:
        raise ConfigError(f"training.lora_targets puts LoRA pairs in {', '.join(clashes)}, which training.freeze "
                          f"{list(t.freeze)} freezes: take {', '.join(clashes)} out of training.freeze to train "
                          "them (configs/finetune_ernie45_vl.yaml freezes vision, as ERNIEKit's freeze_vision), or "
                          "drop those targets")
    for name, param in named:
        if frozen(name, t):
            param.stop_gradient = True
    for moe in model.moe_layers():  # the aux-loss-free bias follows its router's rule: frozen with it
        if moe.moe_statics is not None and all(p.stop_gradient for p in moe.gate.parameters()):
            moe.moe_statics.frozen = True
    own = {id(p): p for _, p in model.stable_named_parameters()}.values()  # a tied copy counts once
    trainable, total = sum(p.size for p in own if not p.stop_gradient), sum(p.size for p in own)
    if not any(env.all_gather_object(trainable > 0)):
        raise ConfigError(f"nothing trains: training.freeze {list(t.freeze)} covers every part of the model")
    return FineTuning(t.fine_tuning, int(trainable), int(total), counts, adapted)


def learning_rate_ratios(model: TrainedModel, training_cfg: TrainingConfig) -> dict[int, float]:
    """id(parameter) -> its learning rate as a multiple of the schedule's: routers ``moe_gate_lr_ratio``; the
    ViT ``vit_lr_ratio`` with layer-wise decay ``visual_ld`` (the patch embedding decays most, the final norm
    not at all)."""
    t = training_cfg
    named = model.stable_named_parameters(include_tied_copy=True)
    blocks = [b for n, _ in named if (b := vit_block(n)) is not None]
    depth = max(blocks) + 1 if blocks else 0

    def ratio(name: str) -> float:
        if is_router(name):
            return t.moe_gate_lr_ratio
        if not name.startswith(VISION):
            return 1.0
        block = vit_block(name)
        below_top = depth - block if block is not None else depth + 1 if name.startswith(PATCH_EMBEDDING) else 0
        return t.vit_lr_ratio * t.visual_ld ** below_top

    return {id(p): ratio(n) for n, p in named}

