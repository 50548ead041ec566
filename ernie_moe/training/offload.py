"""Optimizer offload (``training.offload_optim``): AdamW moments and float32 master weights live in host
memory between steps and visit the device one bucket of parameters at a time for the update.

Each bucket is its own AdamW (same schedule, same settings), so the arithmetic is that of one AdamW over
every parameter. On a GPU the states wait in pinned host memory; on a CPU host memory is where everything
already is, so the same moves are copies and save nothing.
"""

from __future__ import annotations

import paddle

from ..config.schema import OFFLOAD_BUCKET_BYTES

BUCKET_BYTES = OFFLOAD_BUCKET_BYTES


def state_bytes_per_parameter(multi_precision: bool) -> int:
    """Two float32 moments, and a float32 master copy of a low-precision weight."""
    return 8 + (4 if multi_precision else 0)


def buckets(params: list, per_parameter: int, limit: int | None = None) -> list[list]:
    """Consecutive runs of ``params`` whose states stay under ``limit`` bytes (default ``BUCKET_BYTES``; a
    larger tensor alone)."""
    limit = limit or BUCKET_BYTES
    runs: list[list] = []
    run: list = []
    size = 0
    for param in params:
        if run and size + param.size * per_parameter > limit:
            runs.append(run)
            run, size = [], 0
        run.append(param)
        size += param.size * per_parameter
    return runs + ([run] if run else [])


def _host_place():
    if paddle.is_compiled_with_cuda() and paddle.device.get_device().startswith("gpu"):
        return paddle.CUDAPinnedPlace()
    return paddle.CPUPlace()


class OffloadedOptimizer:
    """Steps ``parts`` (AdamW optimizers, or fleet's sharding optimizer around one) one after another, each
    with its states brought to where they were made, and sends them back to host memory afterwards."""

    def __init__(self, parts: list):
        self.parts = parts
        self.home: dict[int, dict] = {}  # id(state tensor on the host) -> the place it was made on

    def step(self) -> None:
        for part in self.parts:
            adamw = getattr(part, "_inner_opt", part)
            self._move(adamw, to_host=False)
            part.step()
            self._move(adamw, to_host=True)

    def _move(self, adamw, to_host: bool) -> None:
        host = _host_place()
        tables = [*adamw._accumulators.values(), adamw._master_weights]
        for table in tables:
            for key, tensor in list(table.items()):
                if to_host:
                    moved = tensor._copy_to(host, True)
                    self.home[id(moved)] = tensor.place
                else:
                    place = self.home.pop(id(tensor), None)
                    if place is None:
                        continue  # made on its device and not offloaded yet
                    moved = tensor._copy_to(place, True)
                table[key] = moved

    def clear_grad(self) -> None:
        for part in self.parts:
            part.clear_grad()

    def get_lr(self) -> float:
        return self.parts[0].get_lr()
