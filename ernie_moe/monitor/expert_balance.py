"""Expert-balance figures of a logging window, from the counters each MoE layer keeps on the device.

Per MoE layer and modality (``moe/layer{i}_{text|vision}/...``):
- ``routed_tokens``: (token, choice) pairs routed to the group's experts, = tokens x k;
- ``max_mean_load``: tokens of the busiest expert / mean tokens per expert (1 = perfect balance, E = one expert
  takes everything);
- ``load_cv``: coefficient of variation of tokens per expert (0 = balanced);
- ``routing_entropy``: entropy of the token share per expert / log(E) (1 = balanced, 0 = one expert);
- ``dropped_frac``: routed copies dropped by capacity; ``idle_expert_frac``: experts that got no token;
- ``bias_range``: max - min of the aux-loss-free correction bias (when enabled);
- ``router/layer{i}_{modality}/{aux_loss,z_loss,orthogonal_loss}``: unweighted router losses.
"""

from __future__ import annotations

import numpy as np

from ..moe.stats import LOSS_NAMES

GROUP_NAMES = {0: "text", 1: "vision", None: "all"}


def load_figures(routed: np.ndarray, kept: np.ndarray) -> dict[str, float]:
    """Balance figures of one expert group from its per-expert routed and kept counts."""
    routed = routed.astype(np.float64)
    mean = routed.mean()
    share = routed / routed.sum()
    nonzero = share[share > 0]
    entropy = float(-(nonzero * np.log(nonzero)).sum() / np.log(len(routed))) if len(routed) > 1 else 1.0
    return {
        "routed_tokens": float(routed.sum()),
        "max_mean_load": float(routed.max() / mean),
        "load_cv": float(routed.std() / mean),
        "routing_entropy": entropy,
        "dropped_frac": float(1.0 - kept.sum() / routed.sum()),
        "idle_expert_frac": float((routed == 0).mean()),
    }


def heat_map(rows: list[np.ndarray], cell: int = 16) -> np.ndarray:
    """Layers x experts image of load / mean load: blue below 1, white at 1, red at 2 and above."""
    width = max(len(r) for r in rows)
    grid = np.full((len(rows), width), np.nan)
    for i, r in enumerate(rows):
        grid[i, : len(r)] = r / max(r.mean(), 1e-9)
    t = np.clip(np.nan_to_num(grid, nan=1.0) - 1.0, -1.0, 1.0)
    image = np.empty(grid.shape + (3,), np.float64)
    image[..., 0] = np.where(t < 0, 1 + t, 1.0)
    image[..., 1] = 1 - np.abs(t)
    image[..., 2] = np.where(t > 0, 1 - t, 1.0)
    image[np.isnan(grid)] = 0.5
    image = (image * 255).astype(np.uint8)
    return image.repeat(cell, axis=0).repeat(cell, axis=1)


def layer_windows(layers) -> list[dict]:
    """Each MoE layer's window as plain data (resets its counters), so pipeline stages can send theirs."""
    return [{"layer_idx": moe.layer_idx, "router_counts": list(moe.router_counts),
             "group_modality": list(moe.group_modality), "window": moe.stats.pop_window(),
             "bias": None if moe.moe_statics is None else moe.moe_statics.e_score_correction_bias.numpy()}
            for moe in layers]


def summarize(layers):
    """(scalars, histograms, images) for the window; resets each layer's counters.

    ``layers``: the model's MoE layers, their counters already summed over the ranks that saw different
    tokens, or their :func:`layer_windows` (gathered from every pipeline stage).
    """
    windows = [w if isinstance(w, dict) else layer_windows([w])[0] for w in layers]
    scalars: dict[str, float] = {}
    histograms: dict[str, np.ndarray] = {}
    maps: dict[str, list[np.ndarray]] = {}
    loss_totals, loss_terms = np.zeros(len(LOSS_NAMES)), 0
    for layer in sorted(windows, key=lambda w: w["layer_idx"]):
        window = layer["window"]
        offset = 0
        for g, size in enumerate(layer["router_counts"]):
            name = GROUP_NAMES[layer["group_modality"][g]]
            routed = window["routed"][offset: offset + size]
            kept = window["kept"][offset: offset + size]
            offset += size
            if window["loss_counts"][g] > 0:
                means = window["loss_sums"][g] / window["loss_counts"][g]
                loss_totals += means
                loss_terms += 1
                for loss_name, value in zip(LOSS_NAMES, means):
                    scalars[f"router/layer{layer['layer_idx']}_{name}/{loss_name}"] = float(value)
            if routed.sum() == 0:
                continue
            tag = f"moe/layer{layer['layer_idx']}_{name}"
            scalars.update({f"{tag}/{key}": value for key, value in load_figures(routed, kept).items()})
            if layer["bias"] is not None:
                bias = layer["bias"][g, :size]
                scalars[f"{tag}/bias_range"] = float(bias.max() - bias.min())
            histograms[f"{tag}/tokens_per_expert"] = routed
            maps.setdefault(name, []).append(routed)
    worst = [v for k, v in scalars.items() if k.endswith("/max_mean_load")]
    if worst:
        scalars["moe/worst_max_mean_load"] = max(worst)
    if loss_terms:  # averages over MoE layers and modalities
        scalars.update({name: float(total / loss_terms) for name, total in zip(LOSS_NAMES, loss_totals)})
    images = {f"moe/load_heat_map_{name}": heat_map(rows) for name, rows in maps.items()}
    return scalars, histograms, images
