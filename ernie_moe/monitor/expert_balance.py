"""Summaries of the routing counters each MoE layer gathered over a logging window."""

from __future__ import annotations

import numpy as np

from ..moe.stats import LOSS_NAMES

GROUP_NAMES = {0: "text", 1: "vision", None: "all"}


def summarize(layers) -> dict:
    """Window averages of the router losses and per-layer load figures; resets each layer's counters.

    ``layers`` are the model's MoE layers, already holding counters summed over every rank.
    """
    out: dict = {}
    loss_totals = np.zeros(len(LOSS_NAMES))
    loss_terms = 0
    for moe in layers:
        window = moe.stats.pop_window()
        counts = window["loss_counts"]
        seen = counts > 0
        loss_totals += (window["loss_sums"][seen] / counts[seen, None]).sum(axis=0)
        loss_terms += int(seen.sum())
        offset = 0
        for g, size in enumerate(moe.router_counts):
            routed = window["routed"][offset: offset + size].astype(np.float64)
            kept = window["kept"][offset: offset + size]
            offset += size
            if routed.sum() == 0:
                continue
            tag = f"moe/layer{moe.layer_idx}_{GROUP_NAMES[moe.group_modality[g]]}"
            out[f"{tag}/max_mean_load"] = float(routed.max() / routed.mean())
            out[f"{tag}/dropped_frac"] = float(1.0 - kept.sum() / routed.sum())
    for name, total in zip(LOSS_NAMES, loss_totals):
        out[name] = float(total / loss_terms) if loss_terms else 0.0
    return out
