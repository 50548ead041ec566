"""The run's checkpoints as it saves them: now, or written in the background while training goes on, and the
newest of its lineage (a resume's source, then its saves)."""

from __future__ import annotations

import paddle
import paddle.distributed as dist

from ..checkpoint import Run, start_checkpoint
from ..checkpoint.checkpoint import PendingCheckpoint
from ..checkpoint.files import BackgroundWrites
from ..checkpoint.lineage import Checkpoint
from ..config import Config
from ..data.encoding.tokenizer import Tokenizer
from ..parallel.env import DistEnv
from .assembly import Assembled


class Saves:
    def __init__(self, cfg: Config, tokenizer: Tokenizer, env: DistEnv, run: Run, parts: Assembled):
        self.cfg, self.tokenizer, self.env, self.run, self.parts = cfg, tokenizer, env, run, parts
        self.last: Checkpoint | None = None  # the lineage's newest: a resume's source, then its saves
        self.writes = BackgroundWrites() if cfg.training.async_save else None  # the background writer
        self.pending: PendingCheckpoint | None = None  # a save being written in the background

    def save(self) -> None:
        """Checkpoint the state's step, unless the last steps were skipped: a checkpoint from inside a run of
        non-finite steps would be the one a resume picks, and pruning would remove the good ones before it."""
        in_a_row, step = self.parts.precision.skipped_in_a_row, self.parts.state.step
        if in_a_row:
            if self.env.is_main:
                print(f"not saving at step {step}: the last {in_a_row} step(s) were skipped for non-finite "
                      "gradients", flush=True)
            return
        self.finish()  # a second save waits for the first
        pending = start_checkpoint(self.parts, self.cfg, self.tokenizer, self.env, self.run, self.last, self.writes)
        if self.writes is None:
            self.last = pending.finish(self.env)
        else:
            self.pending = pending

    def finish(self, wait: bool = True) -> None:
        """Complete a save written in the background: now, waiting for this rank's files, or without ``wait``
        only once every rank has written its files (the ranks still writing are counted: one number summed over
        the job, whatever its size)."""
        pending = self.pending
        if pending is None:
            return
        if not wait:
            writing = paddle.to_tensor([0.0 if pending.written_here() else 1.0])
            if self.env.world_size > 1:
                dist.all_reduce(writing)  # over every rank of the job
            if float(writing):
                return
        self.pending = None
        self.last = pending.finish(self.env)
