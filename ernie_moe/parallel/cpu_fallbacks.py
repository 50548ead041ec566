"""What the gloo (CPU) backend lacks, built from what it has. Used only on gloo, never on the GPU path.

- ProcessGroupGloo has no all-to-all; this one all-gathers every rank's padded send buffer and keeps the
  slices addressed to this rank: correct, world-size times the traffic.
- Group creation with four or more gloo ranks races; it is serialised.
"""

from __future__ import annotations

import contextlib

import paddle
import paddle.distributed as dist


def all_to_all_single(x: paddle.Tensor, in_splits: list[int], out_splits: list[int], group) -> paddle.Tensor:
    """Rows ``in_splits[j]`` of ``x`` go to rank j of ``group``; returns the rows received, ordered by source rank."""
    world, rank = group.nranks, group.rank
    sizes: list[paddle.Tensor] = []
    dist.all_gather(sizes, paddle.to_tensor(in_splits, dtype="int64"), group=group)
    table = [s.numpy().tolist() for s in sizes]  # table[src][dst]
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


@contextlib.contextmanager
def serialized_group_creation():
    """Create process groups one at a time.

    With four or more gloo ranks, concurrent rendezvous of disjoint groups of the same kind (the data
    groups [0, 2] and [1, 3], say) pair up members of different groups and fail or hang. A barrier before
    each ``new_group`` (every rank creates every group, in the same order) serialises them; fleet's
    topology calls ``paddle.distributed.new_group`` too, so the wrapper is installed for the duration.
    """
    original = dist.new_group

    def one_at_a_time(*args, **kwargs):
        dist.barrier()
        return original(*args, **kwargs)

    dist.new_group = one_at_a_time
    try:
        yield
    finally:
        dist.new_group = original
