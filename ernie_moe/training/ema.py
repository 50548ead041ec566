"""An exponential moving average (EMA) of the trained weights, split over the ranks that hold copies of them.

The rule (``training.ema_*``): after the first step at or past ``ema_start_step`` the EMA is a float32 copy of
the weights; from then on, after every step ``s`` with ``(s - ema_start_step) % ema_update_every == 0``,
``ema = decay * ema + (1 - decay) * weights``.

Data-parallel replicas hold the same weights, so each keeps the EMA of the parameters it owns only (the
ownership of ``parallel.replicas.owners``): no rank holds a whole copy where there are replicas. At sharding
stage 3 the owners are the weights' (``parallel.zero``), and the other ranks gather the averages from them as they
gather the weights. With
``training.offload_optim`` the averages wait in host memory. To evaluate or save the EMA, :meth:`swapped_in`
writes each owner's averages into its parameters and sends them to the other replicas, and puts the trained
weights back afterwards (each owner keeps its share of them meanwhile).
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import paddle

from ..config.schema import TrainingConfig
from ..nn.param_spec import full_shape
from ..parallel.env import DistEnv
from ..parallel.pipeline import TrainedModel
from ..parallel.replicas import broadcast_owned, owners, replica_sets
from ..parallel.zero import ShardSet


class WeightAverage:
    def __init__(self, training_cfg: TrainingConfig, env: DistEnv, model: TrainedModel,
                 shards: list[ShardSet] | None = None, weights_sharded: bool = False):
        t = training_cfg
        self.decay, self.start, self.every = t.ema_decay, t.ema_start_step, t.ema_update_every
        self.on_host = t.offload_optim
        named = [(n, p) for n, p in model.stable_named_parameters(include_tied_copy=True) if not p.stop_gradient]
        shards = shards or []
        tied_copies = {id(p) for p in getattr(model, "tied_copies", list)()}
        self.sets = []  # (parameters, their owners, group): the parameters the replicas share out
        shared = set()
        self.owned = []  # (exported name, parameter, saved): this rank's; ``saved`` is False for a tied copy
        if weights_sharded:  # sharding stage 3: each owner averages the weights it keeps; the others gather them
            mine = {id(p) for shard in shards for p in shard.owned()}
            others = {id(p) for shard in shards for p in shard.params} - mine
            self.owned = [(n, p, id(p) not in tied_copies) for n, p in named if id(p) not in others]
            named = []
        for replica in replica_sets(named, env):
            params = [p for _, p in replica.named]
            owner = owners(replica.group.nranks, [math.prod(full_shape(p)) for p in params])
            self.sets.append((params, owner, replica.group))
            shared |= {id(p) for p in params}
            self.owned += [(n, p, id(p) not in tied_copies) for (n, p), o in zip(replica.named, owner)
                           if o == replica.group.rank]
        self.owned += [(n, p, id(p) not in tied_copies) for n, p in named if id(p) not in shared]
        self.values: dict[int, paddle.Tensor] = {}  # id(parameter) -> its average; empty until the EMA starts
        self.updates = 0  # how many times the EMA has taken the weights in (the first copy included)

    @property
    def started(self) -> bool:
        return self.updates > 0

    def _float32(self, param) -> paddle.Tensor:
        value = param.detach().astype("float32")
        return value.cpu() if self.on_host else value.clone()

    @paddle.no_grad()
    def update(self, step: int) -> None:
        """After the optimizer step ``step`` (a step that was skipped for inf / nan leaves the weights as they
        were, and is taken in like any other)."""
        if step < self.start:
            return
        if not self.started:
            self.values = {id(p): self._float32(p) for _, p, _ in self.owned}
        elif (step - self.start) % self.every == 0:
            for _, param, _ in self.owned:
                key = id(param)
                self.values[key] = self.values[key] * self.decay + self._float32(param) * (1.0 - self.decay)
        else:
            return
        self.updates += 1

    @contextmanager
    def swapped_in(self):
        """Inside, every rank's parameters hold the EMA (a collective over the replicas: every rank enters)."""
        if not self.started:
            raise RuntimeError("the EMA has not started yet")
        kept = {id(p): p.detach().clone() for _, p, _ in self.owned}
        self._write({id(p): self.values[id(p)] for _, p, _ in self.owned})
        try:
            yield
        finally:
            self._write(kept)

    @paddle.no_grad()
    def _write(self, values: dict) -> None:
        for _, param, _ in self.owned:
            param.set_value(values[id(param)].astype(param.dtype))
        for params, owner, group in self.sets:
            broadcast_owned(params, owner, group)

    # checkpoints: the averages under the exported names, whole tensors (checkpoint.checkpoint writes them)
    def saved_states(self) -> list:
        """(exported name, parameter, average) of what this rank writes: its share, tied copies left out."""
        return [(n, p, self.values[id(p)]) for n, p, saved in self.owned if saved] if self.started else []

    def load(self, read, updates: int) -> None:
        """``read(name, parameter)``: this rank's slice of the saved average of ``name``."""
        self.values = {id(p): self._float32(paddle.to_tensor(read(n, p))) for n, p, _ in self.owned} \
            if updates else {}
        self.updates = updates
