"""Starting a run from a published ERNIE 4.5 checkpoint (``training.model_name_or_path``).

The folder's ``config.json`` gives the model's shape (``config.model_folder``); keys set in the run's
``model`` section override it, which is how a dense or text-only source grows experts or a vision side.
:func:`load_pretrained` then fills every parameter it can and says what it did with each:

- loaded: the same tensor under the same name;
- converted: transposed from the Hugging Face layout, q/k/v or gate/up fused, rows of a correction bias;
- upcycled: a routed expert copied from the dense MLP of the same layer (sparse upcycling);
- new: nothing in the source for it (routers of upcycled layers, shared experts, the vision side of a
  text model), so it keeps its seeded initial value;
- ignored: tensors of the source this model has no place for (multi-token-prediction blocks, a tied head).
"""

from __future__ import annotations

import re
from collections import defaultdict

import numpy as np
import paddle

from ..model.parameter_kinds import expert_slot, is_router_bias
from ..nn.param_spec import full_shape
from ..nn.sharding import shard_of
from .formats import CheckpointError, SourceCheckpoint


def load_pretrained(model, directory, env=None, source: SourceCheckpoint | None = None) -> dict:
    """Fill this rank's parameters from ``directory`` (``source``: that folder, already opened); returns the report
    (all ranks' names, on every rank)."""
    source = source or SourceCheckpoint(directory)
    report = defaultdict(list)
    named = model.stable_named_parameters(include_tied_copy=True)
    for stable, param in named:
        whole = full_shape(param)
        value, how = _source_tensor(source, stable, whole)
        if value is None:
            report["new"].append(stable)
            continue
        if list(value.shape) != whole:
            raise CheckpointError(f"tensor '{stable}' from {directory} has shape {list(value.shape)}; this model "
                                  f"expects {whole} (check the model section of the config against "
                                  f"{directory}/config.json)")
        param.set_value(paddle.to_tensor(np.ascontiguousarray(shard_of(param, value))).astype(param.dtype))
        report[how].append(stable)
    report["read"] = sorted(source.used)
    if env is not None and env.world_size > 1:  # each rank filled its own parameters
        gathered = env.all_gather_object(dict(report))
        report = defaultdict(list)
        for part in gathered:
            for key, names in part.items():
                report[key].extend(names)
    result = {key: sorted(set(report[key])) for key in ("loaded", "converted", "upcycled", "new")}
    result["ignored"] = sorted(set(source.names()) - set(report["read"]))
    result.update(source=str(directory), model_type=source.model_type, form=source.form)
    return result


def _source_tensor(source: SourceCheckpoint, stable: str, whole: list[int]):
    """(Paddle-layout tensor for ``stable``, how it was obtained), or (None, 'new')."""
    value, converted = source.paddle_tensor(stable)
    if value is not None:
        if stable == "lm_head.weight" and list(value.shape) != whole and list(value.T.shape) == whole:
            value, converted = np.ascontiguousarray(value.T), True  # text models keep a [vocab, hidden] head
        rows = whole[0] - value.shape[0] if value.ndim == 2 else 0
        if is_router_bias(stable) and rows > 0 and value.shape[1] == whole[1]:
            # a text model's [1, experts] bias: the vision row starts at zero
            value, converted = np.concatenate([value, np.zeros([rows, value.shape[1]], value.dtype)]), True
        return value, "converted" if converted else "loaded"
    slot = expert_slot(stable)
    if slot and not any(n.startswith(slot[0] + "experts.") for n in source.names()):
        dense_name = slot[0] + slot[1]
        dense, _ = source.paddle_tensor(dense_name)
        if dense is not None:
            if list(dense.shape) != whole:
                raise CheckpointError(
                    f"cannot upcycle {dense_name} {list(dense.shape)} into {stable} {whole}: an expert copied "
                    "from the dense MLP needs its width (set model.moe_intermediate_size to the source's "
                    "intermediate_size)")
            return dense, "upcycled"
    return None, "new"


def format_report(report: dict, limit: int = 6) -> str:
    """A few lines for the log: a count per kind and the names, layer and expert numbers folded."""
    lines = [f"initialised from {report['source']} ({report['model_type']}, {report['form']}):"]
    for kind in ("loaded", "converted", "upcycled", "new", "ignored"):
        names = report[kind]
        if not names:
            continue
        folded = sorted({re.sub(r"\.(layers|experts|blocks|mtp_block)\.\d+\.", r".\1.*.", n) for n in names})
        shown = ", ".join(folded[:limit]) + (f", ... ({len(folded) - limit} more)" if len(folded) > limit else "")
        lines.append(f"  {kind:9s} {len(names):5d}  {shown}")
    return "\n".join(lines)
