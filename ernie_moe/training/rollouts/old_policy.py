"""The old policy as the trainer computes it (``router_replay: old_policy``): each row's token log-probabilities and
routes from a forward of the weights that sampled it, through the run's own layout."""

from __future__ import annotations

from ... import host_reads
from ...data.encoding.packing import Row
from ...data.feeding.loader import collate
from ...moe.replay import moe_layer_ids, recording, routes_of_forward
from ...objectives.base import REFERENCE_LOGPS
from ...objectives.policy import OLD_LOGPS


def old_policy(rows: list[Row], runner, length: int, micro_batch_size: int, accumulation_steps: int) -> None:
    """Each row's ``OLD_LOGPS`` and routes, in place, a step's micro-batches at a time (a pipeline schedule's
    shape); a pipeline's last stage holds the log-probabilities, the other stages keep the sampler's, unread."""
    model = runner.model
    batches = [collate(rows[i:i + micro_batch_size]) for i in range(0, len(rows), micro_batch_size)]
    with recording(model) as records:
        for first in range(0, len(batches), accumulation_steps):
            # what the objective's reference pass keeps: each token's log-probability
            runner.logps_pass(batches[first:first + accumulation_steps])
    for i, batch in enumerate(batches):
        mine = rows[i * micro_batch_size:(i + 1) * micro_batch_size]
        reference = batch.objective_inputs.get(REFERENCE_LOGPS)
        if reference is not None:
            for row, logps in zip(mine, host_reads.read(reference, "rollout")):
                row.inputs[OLD_LOGPS] = logps
        routes = routes_of_forward(records, i, moe_layer_ids(model.cfg), len(mine), length, model.cfg.moe_k)
        for row, table in zip(mine, routes):
            row.routes = table
