"""The reference model of a preference run, and its pass over each step's pairs.

The reference is the model the run starts from (``training.dpo.reference: model``). A LoRA run has it already: the
base with the adapters switched off, so nothing is copied. A full fine-tune keeps a frozen copy of the weights that
train, on the ranks that hold them (the layout's own placement, no gradients, no optimizer states), and swaps it in
for the reference pass. The routers' correction biases are kept too, so the reference routes as the starting model
did however the aux-loss-free rule moves the policy's. The reference pass runs in evaluation mode (no router
statistics, no router losses, no dropout), as the pass of a separate frozen model would.

With ``training.dpo.reference: precomputed`` the starting model's log-probabilities of every training and held-out
pair are computed in one pass before the first step, while the weights are still the reference's, and kept in the
output folder (``reference_logps.json``: what they were computed for; ``reference_logps_{train,eval}.npy``); a
resume reads them back. No reference weights are held, and a step runs no reference pass.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import paddle

from .. import json_files
from ..batch import PAIR_SIDES, rows_with_pairs
from ..config.schema import Config
from ..data import RowStream, rank_batches
from ..data.encoding.tokenizer import Tokenizer
from ..finetune.lora import LoRALinear
from ..model.parameter_kinds import is_router_bias
from ..objectives.base import REFERENCE_LOGPS
from ..parallel.env import DistEnv
from ..parallel.pipeline import TrainedModel


class ReferenceModel:
    def __init__(self, model: TrainedModel, lora: bool, holds: Callable[[paddle.Tensor], bool] = lambda param: True):
        """``holds(param)``: whether this rank keeps ``param`` between its uses (at sharding stage 3 its owner)."""
        self.adapters = [layer for layer in model.sublayers() if isinstance(layer, LoRALinear)] if lora else []
        kept = [p for name, p in model.named_parameters()
                if (is_router_bias(name) or (not lora and not p.stop_gradient)) and holds(p)]
        self.weights = [(p, p.detach().clone()) for p in kept]

    def prepare(self, runner, datasets: dict, tokenizer: Tokenizer, cfg, env: DistEnv) -> str | None:
        """Nothing: the reference's pass runs in each step."""
        return None

    def fill(self, runner, micro_batches) -> None:
        with self.active():
            runner.logps_pass(micro_batches)

    @contextmanager
    def active(self):
        """Inside, the model computes as the reference (every rank of the layout enters together)."""
        self._swap()
        for layer in self.adapters:
            layer.switched_on = False
        try:
            yield
        finally:
            for layer in self.adapters:
                layer.switched_on = True
            self._swap()

    @paddle.no_grad()
    def _swap(self) -> None:
        """The held weights into the parameters and theirs into the holders, one tensor at a time (no second
        copy of the model at any moment)."""
        for param, held in self.weights:
            theirs = param.detach().clone()
            param.set_value(held)
            paddle.assign(theirs, output=held)


class PrecomputedReference:
    FILES = {"train": "reference_logps_train.npy", "eval": "reference_logps_eval.npy"}
    RECORD = "reference_logps.json"

    def __init__(self):
        self.tables: dict[str, np.ndarray] = {}  # split -> [pairs, 2] (nan: a pair that was skipped)

    def fill(self, runner, micro_batches) -> None:
        for batch in micro_batches:
            keys = batch.row_keys
            values = np.stack([self.tables["eval"][-1 - k] if k < 0 else self.tables["train"][k] for k in keys])
            batch.objective_inputs[REFERENCE_LOGPS] = paddle.to_tensor(np.nan_to_num(values).astype(np.float32))

    def prepare(self, runner, datasets: dict, tokenizer: Tokenizer, cfg: Config, env: DistEnv) -> str:
        """Read the figures from the output folder when they were computed for this data and start, else compute
        them with the model as it now is (the starting weights) and write them; says which."""
        folder = Path(cfg.training.output_dir)
        record: dict = {"model_name_or_path": cfg.training.model_name_or_path, "seed": cfg.training.seed,
                  "sizes": {split: len(data) for split, data in datasets.items()},
                  "data": [cfg.data.dataset, cfg.data.train_path, cfg.data.eval_path, cfg.data.max_seq_len]}
        if (folder / self.RECORD).is_file() and json_files.read_json(folder / self.RECORD) == record:
            self.tables = {split: np.load(folder / self.FILES[split], allow_pickle=False) for split in datasets}
            if all(len(self.tables[s]) == n for s, n in record["sizes"].items()):
                return f"reference log-probabilities read from {folder / self.RECORD}"
        self.tables = {split: self._compute(runner, data, split == "eval", tokenizer, cfg, env)
                       for split, data in datasets.items()}
        if env.is_main:
            folder.mkdir(parents=True, exist_ok=True)
            for split, table in self.tables.items():
                np.save(folder / self.FILES[split], table, allow_pickle=False)
            (folder / self.RECORD).write_text(json_files.dumps(record, indent=2))
        return f"reference log-probabilities of {sum(map(len, self.tables.values()))} pairs computed before the " \
               f"first step ({folder / self.RECORD})"

    @staticmethod
    def _compute(runner, dataset, held_out: bool, tokenizer: Tokenizer, cfg: Config, env: DistEnv) -> np.ndarray:
        """Every pair of ``dataset`` through ``runner.logps_pass``, each data rank its share, in the training's
        micro-batch shape; gathered on every rank."""
        from collections import Counter

        t = cfg.training
        rows = RowStream(dataset, tokenizer, cfg, Counter(), shuffle=False, held_out=held_out)
        batches = rank_batches(rows, t.per_device_train_batch_size * env.data_world, env.data_rank, env.data_world,
                               drop_last=False)
        found = {}
        for group in runner.micro_batch_groups(batches, t):
            runner.logps_pass(group)
            for batch in group:
                reference = batch.objective_inputs.get(REFERENCE_LOGPS)
                if reference is None:  # a pipeline stage before the last
                    continue
                held = rows_with_pairs(batch.labels.numpy(), batch.objective_inputs[PAIR_SIDES].numpy())
                for key, value, real in zip(batch.row_keys, reference.numpy(), held):
                    if real:
                        found[int(key)] = value.astype(np.float64).tolist()
        table = np.full([len(dataset), 2], np.nan)
        for part in env.all_gather_object(found):
            for key, value in part.items():
                table[-1 - key if held_out else key] = value
        return table
