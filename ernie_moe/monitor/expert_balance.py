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

The ``balance`` group holds the headline numbers per modality, the layer detail stays under ``moe``:
``balance/{modality}_max_mean_load`` (the worst layer), ``balance/{modality}_dropped_frac`` (over all layers),
``balance/{modality}_routing_entropy`` (the lowest layer) and ``balance/worst_max_mean_load``; and two images per
modality, ``balance/load_heat_map_{modality}`` and ``balance/tokens_per_expert_{modality}``.
"""

from __future__ import annotations

import numpy as np

from ..moe.stats import LOSS_NAMES
from .charts import bar_chart, heat_map

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


def layer_windows(layers) -> list[dict]:
    """Each MoE layer's window as plain data (resets its counters), so pipeline stages can send theirs."""
    return [{"layer_idx": moe.layer_idx, "router_counts": list(moe.router_counts),
             "group_modality": list(moe.group_modality), "window": moe.stats.pop_window(),
             "bias": None if moe.moe_statics is None else moe.moe_statics.e_score_correction_bias.numpy()}
            for moe in layers]


def summarize(layers):
    """(scalars, images) for the window; resets each layer's counters.

    ``layers``: the model's MoE layers, their counters already summed over the ranks that saw different
    tokens, or their :func:`layer_windows` (gathered from every pipeline stage).
    """
    windows = [w if isinstance(w, dict) else layer_windows([w])[0] for w in layers]
    scalars: dict[str, float] = {}
    loads: dict[str, list[tuple[int, np.ndarray, np.ndarray, dict]]] = {}  # modality -> (layer, routed, kept, figures)
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
            figures = load_figures(routed, kept)
            scalars.update({f"{tag}/{key}": value for key, value in figures.items()})
            if layer["bias"] is not None:
                bias = layer["bias"][g, :size]
                scalars[f"{tag}/bias_range"] = float(bias.max() - bias.min())
            loads.setdefault(name, []).append((layer["layer_idx"], routed, kept, figures))
    if loss_terms:  # averages over MoE layers and modalities
        scalars.update({name: float(total / loss_terms) for name, total in zip(LOSS_NAMES, loss_totals)})
    images = {}
    for name, entries in loads.items():
        scalars.update(headline(name, entries))
        ids, rows = [entry[0] for entry in entries], [entry[1] for entry in entries]
        images[f"balance/load_heat_map_{name}"] = heat_map(rows, ids, f"{name} experts: load / mean load")
        images[f"balance/tokens_per_expert_{name}"] = bar_chart(rows, ids, f"{name} experts: tokens per expert")
    worst = [v for k, v in scalars.items() if k.startswith("balance/") and k.endswith("_max_mean_load")]
    if worst:
        scalars["balance/worst_max_mean_load"] = max(worst)
    return scalars, images


def headline(name: str, entries) -> dict[str, float]:
    """One modality's balance over its layers: the worst layer's load ratio and entropy, the drops of all."""
    figures = [f for _, _, _, f in entries]  # each layer's, as summarize computed them
    routed = sum(float(r.sum()) for _, r, _, _ in entries)
    kept = sum(float(k.sum()) for _, _, k, _ in entries)
    return {f"balance/{name}_max_mean_load": max(f["max_mean_load"] for f in figures),
            f"balance/{name}_dropped_frac": 1.0 - kept / routed,
            f"balance/{name}_routing_entropy": min(f["routing_entropy"] for f in figures)}
