"""Model FLOPs of a batch and the hardware peak they are compared with.

FLOPs count 6 per activated parameter per token (forward + backward) for the decoder, embedding excluded:
each token runs attention, the shared experts and ``moe_k`` routed experts of its own modality. The ViT counts
per patch, the adapter per merged token, and causal attention scores are added per layer. Multi-token prediction
depths that train count as dense layers, with their projection.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import paddle

from ..config.schema import ModelConfig
from ..model.mtp import MultiTokenPrediction
from .memory import on_gpu

# Dense peaks (FLOP/s) by device name: (bf16/fp16 tensor cores, fp32).
GPU_PEAKS = {
    "H200": (989e12, 67e12), "H100": (989e12, 67e12), "H800": (989e12, 67e12), "H20": (148e12, 44e12),
    "A100": (312e12, 19.5e12), "A800": (312e12, 19.5e12), "L40S": (362e12, 91.6e12), "V100": (125e12, 15.7e12),
}


def _count(layer) -> int:
    return sum(int(np.prod(p.shape)) for p in layer.parameters())


class FlopsCounter:
    """This rank's FLOPs: its pipeline stage's layers, its slices of tensor-parallel weights (counted from the
    local parameters), its share of the attention heads, and of the routed experts when those are spread over
    ranks that see the same tokens (``moe_group: mp``)."""

    def __init__(self, model, model_cfg: ModelConfig):
        self.cfg = model_cfg
        plan = model.plan
        tp_group = getattr(plan, "tp_group", None)
        self.head_share = 1.0 / tp_group.nranks if tp_group is not None else 1.0
        self.expert_share = 1.0 / plan.expert_group.nranks if getattr(plan, "experts_on_tp_ranks", False) else 1.0
        self.layers: list[dict[str, Any]] = []
        mtp = [b for b in model.blocks() if isinstance(b, MultiTokenPrediction) and b.active]
        for layer in model.decoder_layers() + [layer for b in mtp for layer in b.mtp_block]:  # this rank's layers
            entry = {"attn": _count(layer.self_attn), "moe": layer.mlp if layer.is_moe else None}
            if layer.is_moe:
                moe = layer.mlp
                entry["shared"] = _count(moe.shared_experts) if moe.shared_experts is not None else 0
                # a SwiGLU expert of width w holds 3 x hidden x w weights; experts may live on other ranks
                offsets = np.cumsum([0] + moe.router_counts[:-1])
                widths = np.array(moe.expert_widths, dtype=np.float64)
                entry["routed"] = [(moe.group_modality[g], 3 * model_cfg.hidden_size * widths[o: o + size].mean(), size)
                                   for g, (o, size) in enumerate(zip(offsets, moe.router_counts))]
            else:
                entry["dense"] = _count(layer.mlp)
            self.layers.append(entry)
        self.mtp_projections = sum(_count(proj) for b in mtp for proj in b.mtp_linear_proj)
        vision = model.vision_modules()  # on the first pipeline stage only
        self.vit, self.adapter = (_count(vision[0]), _count(vision[1])) if vision else (0, 0)

    def batch_flops(self, batch) -> float:
        """Forward + backward FLOPs of one micro-batch."""
        m = self.cfg
        counts = batch.host_counts()
        per_modality = {0: counts.text_tokens, 1: counts.vision_tokens}
        tokens = counts.tokens
        flops = 6 * self.mtp_projections * tokens
        for entry in self.layers:
            flops += 6 * entry["attn"] * tokens
            if entry["moe"] is None:
                flops += 6 * entry["dense"] * tokens
                continue
            flops += 6 * entry["shared"] * tokens
            for modality, expert_params, size in entry["routed"]:
                group_tokens = tokens if modality is None else per_modality[modality]
                flops += 6 * (m.moe_k * expert_params * self.expert_share + m.hidden_size * size) * group_tokens
        seq = batch.input_ids.shape[1]
        # scores and weighted sum: 2 matmuls x 2 FLOPs x (seq / 2 keys on average), times 3 for backward
        heads = m.num_attention_heads * self.head_share
        flops += 3 * 2 * 2 * len(self.layers) * (seq / 2) * heads * m.head_dim * tokens
        flops += 6 * self.vit * batch.pixel_patches.shape[0] + 6 * self.adapter * per_modality[1]
        return flops


def measured_matmul_peak(n: int = 1024, repeats: int = 10) -> float:
    """FLOP/s of a large float32 matmul on this device, the CPU's stand-in for a datasheet peak."""
    a = b = paddle.full([n, n], 0.5)  # no random draw: it runs on rank 0 only and must not shift its stream
    paddle.matmul(a, b).numpy()
    start = time.perf_counter()
    for _ in range(repeats):
        c = paddle.matmul(a, b)
    c.numpy()
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def hardware_peak(low_precision: bool = False) -> tuple[float, str]:
    """(peak FLOP/s, where it comes from)."""
    if on_gpu():
        name = paddle.device.cuda.get_device_name()
        for key, (half, single) in GPU_PEAKS.items():
            if key in name:
                return (half if low_precision else single), f"{name} datasheet"
    return measured_matmul_peak(), "measured float32 matmul"
