"""What CPU runs lack, built from what they have. Used only on the CPU (gloo), never on the GPU path.

- ProcessGroupGloo has no reduce-scatter; it is an all-reduce followed by a slice.
- ProcessGroupGloo has no all-to-all; this one all-gathers every rank's padded send buffer and keeps the
  slices addressed to this rank: correct, world-size times the traffic.
- gloo groups share rendezvous keys in the global store; each group gets a store of its own.
- glibc hands large host blocks back to the kernel on free; the trainer keeps them for the next step.
- The MKL that Paddle's CPU build bundles runs its SSE code on AMD CPUs; told their vector units, it uses AVX2.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import os
import socket
import time
from typing import Any

import paddle
import paddle.distributed as dist
from paddle.base import core
from paddle.distributed import collective

from .. import host_reads


def reuse_freed_host_memory() -> bool:
    """Keep freed host memory in the heap for the next allocation; returns whether the C library took it.

    glibc serves blocks above its mmap threshold (128 KiB, adapting up to 32 MiB) with fresh pages from the
    kernel and unmaps them on free, so every large CPU tensor pays a page fault per 4 KiB on first touch: an
    elementwise op over a 32 MiB activation costs several times its arithmetic. With the thresholds raised,
    a step reuses the blocks the previous step freed. Paddle's allocator statistics (the memory metrics)
    count tensor bytes and do not change; the process RSS stays at its high-water mark.
    """
    name = ctypes.util.find_library("c")
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None) if name else None
    if mallopt is None:  # not glibc
        return False
    trim_threshold, mmap_threshold = -1, -3  # M_TRIM_THRESHOLD, M_MMAP_THRESHOLD
    return bool(mallopt(mmap_threshold, 1 << 30)) and bool(mallopt(trim_threshold, 1 << 30))


def use_avx2_math_on_amd(cpuinfo_path: str = "/proc/cpuinfo") -> bool:
    """Let MKL use AVX2 on an AMD CPU that has it; returns whether this process now asks for it.

    The MKL bundled with Paddle's CPU build picks its code path by CPU vendor and runs SSE on AMD: a float32
    matmul there is about 2.8x slower than MKL's AVX2 path on the same core. MKL reads
    ``MKL_DEBUG_CPU_TYPE`` at its first call, so this runs before the model computes anything. A value the
    user set is kept; Intel CPUs and builds without MKL are left alone.
    """
    if "MKL_DEBUG_CPU_TYPE" in os.environ:
        return os.environ["MKL_DEBUG_CPU_TYPE"] == "5"
    if getattr(paddle.version, "with_mkl", "OFF") != "ON":
        return False
    try:
        with open(cpuinfo_path) as f:
            cpuinfo = f.read(1 << 16)
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    if "AuthenticAMD" not in cpuinfo or "avx2" not in flags:
        return False
    os.environ["MKL_DEBUG_CPU_TYPE"] = "5"
    return True


def all_to_all_single(x: paddle.Tensor, in_splits: list[int], out_splits: list[int], group) -> paddle.Tensor:
    """Rows ``in_splits[j]`` of ``x`` go to rank j of ``group``; returns the rows received, ordered by source rank."""
    world, rank = group.nranks, group.rank
    sizes: list[paddle.Tensor] = []
    dist.all_gather(sizes, paddle.to_tensor(in_splits, dtype="int64"), group=group)
    table = host_reads.read(paddle.stack(sizes), "cpu_all_to_all").tolist()  # table[src][dst]
    longest = max(sum(row) for row in table)
    padded = paddle.zeros([longest] + x.shape[1:], dtype=x.dtype)
    if x.shape[0]:
        padded[: x.shape[0]] = x
    buffers: list[paddle.Tensor] = []
    dist.all_gather(buffers, padded, group=group)
    pieces = []
    for src in range(world):
        start = sum(table[src][:rank])
        pieces.append(buffers[src][start: start + table[src][rank]])
    assert [p.shape[0] for p in pieces] == list(out_splits), "all-to-all sizes disagree between ranks"
    return paddle.concat(pieces, axis=0)


# fleet's pipeline schedule on gloo: the batched point-to-point path calls ``send_on_calc_stream``, which
# ProcessGroupGloo lacks; the non-batched one uses isend / irecv.
PIPELINE_CONFIGS = {"use_batch_p2p_comm": False}


def give_cpu_a_device_id() -> None:
    """``PipelineLayer`` reads ``ParallelEnv().device_id``, which the CPU environment does not set (a fresh
    ``ParallelEnv`` is made on every call, so the default goes on the class)."""
    if not hasattr(dist.ParallelEnv(), "_device_id"):
        dist.ParallelEnv._device_id = 0


def pipeline_pairs(hcg) -> None:
    """Route fleet's pipeline point-to-point traffic through a group per pair of neighbouring stages.

    ProcessGroupGloo matches a send with a receive by a counter that every operation on the group advances.
    On the whole pipeline group, two neighbours' counters drift apart as soon as a stage talks to both of its
    neighbours in different numbers (the interleaved schedule's ring), and their messages never match. A
    two-rank group per neighbouring pair sees exactly the operations of that pair, in the same order on both
    ends. Every rank creates every pair group in the same order.
    """
    pipe_group = hcg.get_pipe_parallel_group()
    pairs = {}
    for ranks in hcg.topology().get_comm_list("pipe"):
        for i in range(len(ranks)):
            pair = tuple(sorted((ranks[i], ranks[(i + 1) % len(ranks)])))
            if pair[0] != pair[1] and pair not in pairs:
                pairs[pair] = dist.new_group(list(pair))
    me = dist.get_rank()

    def through_pair(original, peer_name):
        def p2p(tensor, *args, **kwargs):  # (tensor, peer, group, ...), by position or by name
            args = list(args)
            peer = args[0] if args else kwargs.get(peer_name, 0)
            group = args[1] if len(args) > 1 else kwargs.get("group")
            if group is not None and group.id == pipe_group.id:
                group = pairs[tuple(sorted((me, peer)))]
                if len(args) > 1:
                    args[1] = group
                else:
                    kwargs["group"] = group
            return original(tensor, *args, **kwargs)

        return p2p

    for name, peer_name in (("send", "dst"), ("isend", "dst"), ("recv", "src"), ("irecv", "src")):
        setattr(dist, name, through_pair(getattr(dist, name), peer_name))


def reduce_scatter(x: paddle.Tensor, axis: int, group) -> paddle.Tensor:
    """Sum over ``group`` and keep this rank's equal piece along ``axis``: an all-reduce, then a slice."""
    out = x.clone()
    dist.all_reduce(out, group=group)
    return paddle.split(out, group.nranks, axis=axis)[group.rank].contiguous()


def use_private_group_rendezvous() -> None:
    """Give every gloo group created from now on its own rendezvous store.

    ``ProcessGroupGloo`` connects its members through the global TCP store under keys that are just the
    group rank ("0", "1", ...), the same keys for every group. A member can then read the address a rank
    of an earlier group published and connect to the wrong peer ("Connection refused", a gloo TIMEOUT or
    "136 vs 45" address-size errors, mostly with four or more ranks). Here each group's lowest rank opens
    a fresh store, announces it under a key unique to that group, and the group's rendezvous runs there.
    fleet (its topology, ``PipelineLayer``'s shared-weight groups) calls ``paddle.distributed.new_group``,
    which is replaced for the life of the process; every rank creates every group in the same order.
    """
    if getattr(dist.new_group, "__name__", "") == "_group_with_own_store":  # wrapped already
        return
    original = dist.new_group
    stores = []  # the group stores live as long as the process
    counter = itertools.count()

    def _group_with_own_store(ranks=None, *args, **kwargs):
        number = next(counter)
        members = sorted(ranks) if ranks is not None else list(range(dist.get_world_size()))
        if len(members) < 2 or dist.get_rank() not in members:
            return original(ranks, *args, **kwargs)
        store = _group_store(number, members)
        stores.append(store)
        global_store = collective._default_store
        collective._default_store = store
        try:
            return original(ranks, *args, **kwargs)
        finally:
            collective._default_store = global_store

    dist.new_group = _group_with_own_store


def _group_store(number: int, members: list[int]):
    key = f"ernie_moe/group_store/{number}"
    default: Any = collective._default_store  # set once the default group exists, which every caller follows
    is_master = dist.get_rank() == members[0]
    if is_master:
        host = os.environ.get("PADDLE_CURRENT_ENDPOINT", "127.0.0.1:0").split(":")[0]
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        default.set(key, f"{host}:{port}".encode())
    host, port = default.get(key).decode().split(":")
    if not is_master:
        _wait_until_listening(host, int(port))
    return core.TCPStore(host, int(port), is_master, len(members))


def _wait_until_listening(host: str, port: int, timeout_s: float = 900.0) -> None:
    """Return once ``host:port`` accepts a connection. The master announces its store before it listens (its
    constructor waits for the members), and a store client refused on its first try waits 3 s before the next:
    probing here first makes a group in about 0.3 s instead of 3.4 s. After ``timeout_s`` the client's own
    connection error speaks."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            time.sleep(0.01)
