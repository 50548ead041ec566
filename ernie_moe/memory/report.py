"""Predict the memory a layout needs before launching it.

    python -m ernie_moe.memory --config FILE [section.key=value ...] [--world-size N] [--device-memory-gb 80]
                             [--search] [--smallest] [--image-fraction 0.5]

The device's size is ``--device-memory-gb``, else the config's ``training.device_memory_gb``, else this machine's
(its GPU's memory, or its RAM on a CPU): the size the trainer checks a run against at start-up.

Prints, for one rank of each pipeline stage, the bytes of parameters (and a full fine-tune's preference reference
copy of them), gradients, optimizer states, input batches, activations and the backward-pass transient, and whether
the busiest stage fits the device; with ``training.async_save``, the host memory a save's copy of the state takes.
With ``--search`` it lists the layouts (tensor, pipeline, virtual stages,
sharding, expert degree or the experts over the tensor ranks with sequence parallelism, recompute, micro-batch,
optimizer offload, the loss over chunks) that fit, the fastest first by a rough estimate; with ``--smallest``
the fewest GPUs (1, 2, 4 or a multiple of 8) on which one fits, and that layout. The micro-batch's make-up comes
from the configured data when it is there (synthetic data, or the JSONL files), otherwise images of
``data.max_image_side`` are assumed to fill ``--image-fraction`` of the tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path

from ..cli import MAX_GB, at_least_one, bounded
from ..config import ConfigError, load_config
from ..config.schema import Config
from ..monitor.memory import MemoryMonitor
from ..parallel.global_batch import for_world
from ..parallel.layout import Layout
from .estimate import Workload, estimate, sample_workload
from .search import FIT_FRACTION, describe, fits, overrides, search, smallest_world

GIB = 2 ** 30


def size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2 ** 20:.1f} MiB"


MAX_SAMPLED_ROWS = 4096
MAX_SAMPLED_TOKENS = 1 << 20  # past this the samples to pack would take minutes: judged from the config instead


def workload_source(cfg: Config, data_world: int, image_fraction: float):
    """``micro_batch -> Workload``: sampled from the data when it is available, else assumed."""
    d = cfg.data
    files = d.train_files
    available = d.dataset == "synthetic" or bool(files) and all(Path(f).is_file() for f in files)

    def sampled(micro_batch: int) -> bool:
        # a micro-batch of more rows than a sample should hold is judged from the config, not built
        rows = micro_batch * data_world
        return available and rows <= MAX_SAMPLED_ROWS and rows * d.max_seq_len <= MAX_SAMPLED_TOKENS

    @functools.cache  # the layout search asks again for each candidate: sample each size once
    def for_micro_batch(micro_batch: int) -> Workload:
        sized = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training,
                                                                      per_device_train_batch_size=micro_batch))
        return sample_workload(sized, data_world) if sampled(micro_batch) else Workload.assumed(sized, image_fraction)

    return for_micro_batch, "sampled from the data" if sampled(cfg.training.per_device_train_batch_size) else (
        f"assumed: images of {d.max_image_side} px filling {image_fraction:.0%} of the tokens")


def table(stages, device_bytes: float) -> str:
    columns = ("parameters", *(("reference",) if any(s.reference for s in stages) else ()), "gradients", "optimizer",
               "inputs", "activations", "transient", *(("rollout",) if any(s.rollout for s in stages) else ()),
               "total")
    lines = ["stage " + " ".join(f"{c:>12}" for c in columns)]
    for s in stages:
        lines.append(f"{s.stage:>5} " + " ".join(f"{size(getattr(s, c)):>12}" for c in columns))
    busiest = max(stages, key=lambda s: s.total)
    verdict = "fits" if fits(stages, device_bytes) else "does NOT fit"
    lines.append(f"busiest: stage {busiest.stage}, {size(busiest.total)} of {size(device_bytes)} "
                 f"({busiest.total / device_bytes:.0%}): {verdict} (limit {FIT_FRACTION:.0%} of the device)")
    start = max(stages, key=lambda s: s.startup)
    if start.startup > FIT_FRACTION * device_bytes or start.startup > busiest.total:
        lines.append(f"start-up: stage {start.stage} builds its part of the model in float32 before the cast (and "
                     f"at sharding stage 3 before sharing it out): {size(start.startup)}"
                     + ("" if start.startup <= FIT_FRACTION * device_bytes else ", more than the device holds"))
    return "\n".join(lines)


def planned(cfg: Config, world: int, image_fraction: float = 0.5):
    """(per-stage estimates, the micro-batch's workload, where it comes from, its workload function) of the
    configured layout on ``world`` ranks (its accumulation steps those ``training.global_batch_size`` gives)."""
    cfg = for_world(cfg, world)
    data_world = Layout.of(cfg.parallel, world).data_world
    workload_for, source = workload_source(cfg, data_world, image_fraction)
    workload = workload_for(cfg.training.per_device_train_batch_size)
    return estimate(cfg, workload, data_world), workload, source, workload_for


def default_world(cfg: Config) -> int:
    """The fewest ranks the configured degrees take."""
    p = cfg.parallel
    return p.tensor_parallel_degree * p.pipeline_parallel_degree * max(p.sharding_parallel_degree, 1)


def report(cfg: Config, world: int, device_gb: float, run_search: bool,
           image_fraction: float = 0.5) -> tuple[str, bool]:
    """The printed plan and whether the configured layout fits."""
    cfg = for_world(cfg, world)
    data_world = Layout.of(cfg.parallel, world).data_world
    stages, workload, source, workload_for = planned(cfg, world, image_fraction)
    device = device_gb * GIB
    lines = [f"layout: {world} ranks, {describe(cfg)}",
             f"micro-batch: {workload.rows} x {workload.seq} tokens, {workload.image_tokens} image tokens, "
             f"{workload.patches} patches ({source})",
             table(stages, device)]
    ok = fits(stages, device)
    copy = max(s.save_copy for s in stages)
    if copy:
        lines.append(f"async save (training.async_save): up to {size(copy)} of host memory on a writing rank for the "
                     "copy of the state its files are written from")
    rung = cfg.training.memory_guard_capacity
    if rung:
        tighter = max(s.total for s in estimate(cfg, workload, data_world, capacity=rung))
        busiest = max(s.total for s in stages)
        lines.append(f"the memory guard's capacity rung (factor {rung:g}): busiest stage {size(tighter)}, "
                     f"{size(max(busiest - tighter, 0.0))} less")
    if run_search or not ok:
        found = search(cfg, workload_for, world, device, limit=10 if run_search else 5)
        lines.append(f"layouts that fit {world} ranks of {size(device)}, fastest first (relative estimate):"
                     if found else f"no layout of {world} ranks fits {size(device)} per rank.")
        for speed, candidate, peak in found:
            lines.append(f"  {speed:4.2f}  {size(peak):>10}  {describe(candidate)}\n"
                         f"        {overrides(candidate, cfg) or '(the configured layout)'}")
    return "\n".join(lines), ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ernie_moe.memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    parser.add_argument("--world-size", type=at_least_one, help="ranks (default: the product of the degrees)")
    parser.add_argument("--device-memory-gb", type=bounded(float, 0, MAX_GB, low_included=False),
                        help="GB per device (default: training.device_memory_gb, else this machine's GPU, or its RAM "
                             "on a CPU)")
    parser.add_argument("--search", action="store_true", help="list the layouts that fit")
    parser.add_argument("--smallest", action="store_true", help="the fewest GPUs (1, 2, 4 or a multiple of 8) that fit")
    parser.add_argument("--image-fraction", type=bounded(float, 0, 1), default=0.5)
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides, check_paths=False)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    device_gb = args.device_memory_gb or cfg.training.device_memory_gb or MemoryMonitor().device_total_gb()
    world = args.world_size or default_world(cfg)
    if args.smallest:
        workload_for, source = workload_source(cfg, 1, args.image_fraction)
        found = smallest_world(cfg, workload_for, device_gb * GIB)
        if found is None:
            print(f"no layout of up to 1024 GPUs of {device_gb:g} GB fits")
            return 1
        world, _, candidate, peak = found
        print(f"fewest GPUs of {device_gb:g} GB: {world}, busiest GPU {size(peak)}, {describe(candidate)} "
              f"({source})\n  {overrides(candidate, cfg) or '(the configured layout)'}")
        return 0
    text, ok = report(cfg, world, device_gb, args.search, args.image_fraction)
    print(text)
    return 0 if ok else 1
