"""Layouts that fit a device, ranked by a rough throughput estimate.

The estimate is relative (1.0 = the best layout found): step time ~ FLOPs per rank x the recompute re-run x
the pipeline bubble x a communication penalty for tensor (per doubling) and expert parallelism. It ranks
candidates; it is not a prediction of tokens per second.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from ..config.load import ConfigError
from ..config.schema import Config
from ..config.validate import validate
from ..parallel.layout import Layout
from .estimate import estimate

FIT_FRACTION = 0.9  # the rest of the device: CUDA context, allocator fragmentation, communication buffers
RECOMPUTE_ORDER = (None, "moe", "core_attn", "full_attn", "full")  # least memory saved and time spent first
RERUN = {None: 0.0, "moe": 0.2, "core_attn": 0.05, "full_attn": 0.15, "full": 0.33}  # extra forward share
OFFLOAD_COST = 0.1  # a step's share spent moving offloaded optimizer states
# a step's share spent on sharding's own traffic beyond stage 1's: stage 3 gathers every weight for the forward and
# again for the backward (ZeRO's 1.5x the gradient traffic)
SHARDING_COST = {"": 0.0, "stage1": 0.0, "stage2": 0.0, "stage3": 0.1}
CHUNKED_LOSS_COST = 0.02  # a step's share spent running the LM head again for the loss over chunks
LONG_LOSS_CHUNK = 8192  # the chunk the search tries for sequences longer than that


def fits(stages, device_bytes: float) -> bool:
    """Whether the busiest stage's step, and its start (the model built in float32), fit the device."""
    return max(max(s.total, s.startup) for s in stages) <= FIT_FRACTION * device_bytes


def with_layout(cfg: Config, tp, pp, vpp, sharding, ep, recompute, micro_batch, world, moe_group="ep", offload=None,
                loss_chunk=None, stage="stage1"):
    """``cfg`` with another layout, the global batch unchanged; None when the layout is invalid. ``offload``:
    whether the optimizer states live on the host, ``loss_chunk``: tokens per chunk of the head and loss (None:
    as configured), ``stage``: the sharding stage where ``sharding`` is above 1."""
    t = cfg.training
    data = Layout(world, tp, pp).data_world
    global_rows = t.per_device_train_batch_size * t.gradient_accumulation_steps * configured_data_world(cfg, world)
    if global_rows % (micro_batch * data):
        return None
    parallel = dataclasses.replace(
        cfg.parallel, tensor_parallel_degree=tp, pipeline_parallel_degree=pp, virtual_pp_degree=vpp,
        sharding_parallel_degree=sharding, sharding=stage if sharding > 1 else "",
        expert_parallel_degree=ep if moe_group == "ep" else tp, moe_group=moe_group,
        sequence_parallel=moe_group == "mp" and cfg.data.max_seq_len % tp == 0)
    chunked = t.loss_subbatch_seqlen if loss_chunk is None else loss_chunk
    training = dataclasses.replace(t, per_device_train_batch_size=micro_batch,
                                   gradient_accumulation_steps=global_rows // (micro_batch * data),
                                   recompute=recompute is not None, recompute_granularity=recompute or "full",
                                   recompute_layers=0, loss_subbatch_seqlen=chunked,
                                   offload_optim=t.offload_optim if offload is None else offload)
    candidate = dataclasses.replace(cfg, parallel=parallel, training=training)
    try:
        validate(candidate, check_paths=False)
    except ConfigError:
        return None
    return candidate


def configured_data_world(cfg: Config, world: int) -> int:
    """The data ranks of the config's own layout: over ``world`` where it divides them, otherwise over one
    replica's ranks (the global batch a search keeps is the one the config gives its layout)."""
    configured = Layout.of(cfg.parallel, world)
    return configured.data_world if world % configured.model_ranks == 0 else Layout.of(cfg.parallel).data_world


def relative_time(cfg: Config, world: int, largest_micro_batch: int) -> float:
    p, t = cfg.parallel, cfg.training
    small = 1 + 0.05 * math.log2(largest_micro_batch / t.per_device_train_batch_size)  # smaller kernels
    bubble = (p.pipeline_parallel_degree - 1) / (t.gradient_accumulation_steps * max(p.virtual_pp_degree, 1))
    rerun = RERUN[t.recompute_granularity if t.recompute else None]
    comm = 1 + 0.08 * math.log2(p.tensor_parallel_degree) + (0.05 if p.expert_parallel_degree > 1 else 0)
    host = 1 + OFFLOAD_COST if t.offload_optim else 1  # the states cross the host link at each update
    head = 1 + CHUNKED_LOSS_COST if t.loss_subbatch_seqlen else 1  # the head runs again in the backward pass
    sharding = 1 + SHARDING_COST[p.sharding]
    return (1 + rerun) * (1 + bubble) * comm * small * host * head * sharding / world


def search(cfg: Config, workload_for, world: int, device_bytes: float, limit: int = 10) -> list[tuple]:
    """(relative throughput, config, busiest-stage bytes) of the layouts that fit, best first.
    ``workload_for(micro_batch)`` gives the micro-batch's make-up."""
    m = cfg.model
    powers = [d for d in (1, 2, 4, 8, 16, 32, 64) if world % d == 0]
    # pipeline stages: any degree that divides the ranks and the layers (ERNIE's 54 layers go in 3, 6, 9 ...)
    stages = [d for d in range(1, min(world, m.num_hidden_layers) + 1) if world % d == 0]
    found = []
    micro = cfg.training.per_device_train_batch_size
    micro_batches = sorted({max(micro >> i, 1) for i in range(4)}, reverse=True)
    seq = cfg.data.max_seq_len
    chunks = sorted({cfg.training.loss_subbatch_seqlen, 0} | ({LONG_LOSS_CHUNK} if seq > LONG_LOSS_CHUNK else set()))
    for tp, pp in itertools.product([d for d in powers if d <= 8], stages):
        if world % (tp * pp):
            continue
        data = Layout(world, tp, pp).data_world
        # experts over data ranks (moe_group ep, any degree that divides the counts), or over the tensor ranks
        # (moe_group mp, with sequence parallelism)
        groups = [("ep", d) for d in powers if d <= data and all(n % d == 0 for n in m.moe_num_experts or [1])]
        groups += [("mp", tp)] if tp > 1 and m.moe_num_experts else []
        # sharding stages 2 and 3 run without pipeline stages (config.validate refuses them)
        stages_of_sharding = ("stage1", "stage2", "stage3") if data > 1 and pp == 1 else ("stage1",)
        for (moe_group, ep), vpp, recompute, mb, offload, chunk, sharding in itertools.product(
                groups, (1, 2) if pp >= 3 else (1,), RECOMPUTE_ORDER, micro_batches, (False, True), chunks,
                stages_of_sharding):
            candidate = with_layout(cfg, tp, pp, vpp, data, ep, recompute, mb, world, moe_group, offload, chunk,
                                    sharding)
            if candidate is None:
                continue
            per_stage = estimate(candidate, workload_for(mb), data)
            if fits(per_stage, device_bytes):
                peak = max(s.total for s in per_stage)
                found.append((relative_time(candidate, world, micro_batches[0]), candidate, peak))
    found.sort(key=lambda x: (x[0], x[2]))
    if not found:
        return []
    best = found[0][0]
    return [(best / time, candidate, peak) for time, candidate, peak in found[:limit]]


def smallest_world(cfg, workload_for, device_bytes: float, step: int = 8, most: int = 1024) -> tuple | None:
    """(ranks, relative throughput, config, busiest-stage bytes) of the fastest layout on the fewest ranks
    (1, 2, 4 or a multiple of ``step``, at most ``most``) on which one fits; None if none does."""
    for world in [w for w in (1, 2, 4) if w < step] + list(range(step, most + 1, step)):
        found = search(cfg, workload_for, world, device_bytes, limit=1)
        if found:
            return (world, *found[0])
    return None


def describe(cfg: Config) -> str:
    p, t = cfg.parallel, cfg.training
    parts = [f"tp{p.tensor_parallel_degree}", f"pp{p.pipeline_parallel_degree}"]
    if p.virtual_pp_degree > 1:
        parts.append(f"vpp{p.virtual_pp_degree}")
    if p.sharding:
        parts.append(f"sharding{p.sharding_parallel_degree}({p.sharding})")
    if p.moe_group == "mp" and p.tensor_parallel_degree > 1:
        parts.append("experts over tp (moe_group mp)" + (", sequence parallel" if p.sequence_parallel else ""))
    elif p.expert_parallel_degree > 1:
        parts.append(f"ep{p.expert_parallel_degree}")
    parts.append(f"recompute {t.recompute_granularity}" if t.recompute else "no recompute")
    if t.offload_optim:
        parts.append("optimizer offloaded")
    if t.loss_subbatch_seqlen:
        parts.append(f"loss over chunks of {t.loss_subbatch_seqlen}")
    parts.append(f"micro-batch {t.per_device_train_batch_size} x {t.gradient_accumulation_steps}")
    return ", ".join(parts)


def overrides(cfg: Config, current) -> str:
    """The command-line overrides that turn ``current``'s layout into ``cfg``'s."""
    now = set(overrides_of(current))
    items = [item for item in overrides_of(cfg) if item not in now]
    if not cfg.training.recompute:
        items = [item for item in items if not item.startswith("training.recompute_granularity")]
    return " ".join(items)


def overrides_of(cfg: Config) -> list[str]:
    p, t = cfg.parallel, cfg.training
    return [f"parallel.tensor_parallel_degree={p.tensor_parallel_degree}",
            f"parallel.pipeline_parallel_degree={p.pipeline_parallel_degree}",
            f"parallel.virtual_pp_degree={p.virtual_pp_degree}",
            f"parallel.sharding_parallel_degree={p.sharding_parallel_degree}",
            f"parallel.sharding={p.sharding or chr(39) * 2}",
            f"parallel.expert_parallel_degree={p.expert_parallel_degree}", f"parallel.moe_group={p.moe_group}",
            f"parallel.sequence_parallel={str(p.sequence_parallel).lower()}",
            f"training.per_device_train_batch_size={t.per_device_train_batch_size}",
            f"training.gradient_accumulation_steps={t.gradient_accumulation_steps}",
            f"training.recompute={str(t.recompute).lower()}",
            f"training.recompute_granularity={t.recompute_granularity}",
            f"training.loss_subbatch_seqlen={t.loss_subbatch_seqlen}",
            f"training.offload_optim={str(t.offload_optim).lower()}"]
