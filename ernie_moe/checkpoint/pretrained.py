"""Starting a run from a published ERNIE 4.5 checkpoint (``training.model_name_or_path``).

The folder's ``config.json`` gives the model's shape (``config.model_folder``); keys set in the run's
``model`` section override it, which is how a dense or text-only source grows experts or a vision side.
:func:`load_pretrained` then fills every parameter it can and says what it did with each:

- loaded: the same tensor under the same name;
- converted: transposed from the Hugging Face layout, q/k/v or gate/up fused, rows of a correction bias;
- upcycled: a routed expert copied from the dense MLP of the same layer (sparse upcycling);
- copied: a multi-token prediction depth the source lacks, its attention and norms from the last decoder layer and
  its MLP from the last dense one (``training.mtp_init: last_layer``);
- new: nothing in the source for it (routers of upcycled layers, shared experts, the vision side of a
  text model, multi-token prediction layers by default), so it keeps its seeded initial value;
- ignored: tensors of the source this model has no place for (multi-token prediction layers of a model configured
  without them, a tied head).
"""

from __future__ import annotations

import re
from collections import defaultdict

import numpy as np
import paddle

from ..model.parameter_kinds import MTP, expert_slot, is_router_bias
from ..nn.param_spec import full_shape
from ..nn.sharding import shard_of
from ..parallel.env import DistEnv
from ..parallel.pipeline import TrainedModel
from .formats import CheckpointError, SourceCheckpoint


def load_pretrained(model: TrainedModel, directory, env: DistEnv | None = None, source: SourceCheckpoint | None = None,
                    mtp_init: str = "scratch") -> dict:
    """Fill this rank's parameters from ``directory`` (``source``: that folder, already opened); ``mtp_init``: how
    multi-token prediction layers the folder lacks start (``training.mtp_init``); returns the report (all ranks'
    names, on every rank)."""
    source = source or SourceCheckpoint(directory)
    report = defaultdict(list)
    named = model.stable_named_parameters(include_tied_copy=True)
    copies = _mtp_copies(model.cfg, source) if mtp_init == "last_layer" else {}
    for stable, param in named:
        whole = full_shape(param)
        value, how = _source_tensor(source, stable, whole)
        if value is None and stable in copies:
            value, _ = source.paddle_tensor(copies[stable])
            how = "copied" if value is not None else how
        if value is None:
            report["new"].append(stable)
            continue
        if list(value.shape) != whole:
            raise CheckpointError(f"tensor '{stable}' from {directory} has shape {list(value.shape)}; this model "
                                  f"expects {whole} (check the model section of the config against "
                                  f"{directory}/config.json)")
        mine = np.ascontiguousarray(shard_of(param, value))
        if not np.isfinite(mine).all():  # it would answer in padding tokens, and training stops at its first step
            raise CheckpointError(f"'{directory}': tensor {stable} holds nan or inf values: the weights are damaged "
                                  "(a diverged run, or a broken conversion)")
        param.set_value(paddle.to_tensor(mine).astype(param.dtype))
        report[how].append(stable)
    report["read"] = sorted(source.used)
    if env is not None and env.world_size > 1:  # each rank filled its own parameters
        gathered = env.all_gather_object(dict(report))
        report = defaultdict(list)
        for part in gathered:
            for key, names in part.items():
                report[key].extend(names)
    result: dict = {key: sorted(set(report[key])) for key in ("loaded", "converted", "upcycled", "copied", "new")}
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


def _mtp_copies(cfg, source: SourceCheckpoint) -> dict[str, str]:
    """Where each multi-token prediction depth's decoder layer is copied from when the source has no MTP layers:
    ``model.mtp_block.{k}.<attention, norms>`` from the last decoder layer, ``...mlp.*`` from the last dense one."""
    if any(n.startswith(MTP) for n in source.names()):
        return {}
    last = cfg.num_hidden_layers - 1
    dense = [i for i in range(cfg.num_hidden_layers) if not cfg.moe_modalities_at(i)]
    parts = {"input_layernorm.weight": last, "post_attention_layernorm.weight": last,
             "self_attn.qkv_proj.weight": last, "self_attn.o_proj.weight": last}
    if dense:
        parts.update({"mlp.up_gate_proj.weight": dense[-1], "mlp.down_proj.weight": dense[-1]})
    return {f"{MTP}block.{k}.{part}": f"model.layers.{layer}.{part}"
            for k in range(cfg.num_nextn_predict_layers) for part, layer in parts.items()}


def format_report(report: dict, limit: int = 6) -> str:
    """A few lines for the log: a count per kind and the names, layer and expert numbers folded."""
    lines = [f"initialised from {report['source']} ({report['model_type']}, {report['form']}):"]
    for kind in ("loaded", "converted", "upcycled", "copied", "new", "ignored"):
        names = report[kind]
        if not names:
            continue
        folded = sorted({re.sub(r"\.(layers|experts|blocks|mtp_block)\.\d+\.", r".\1.*.", n) for n in names})
        shown = ", ".join(folded[:limit]) + (f", ... ({len(folded) - limit} more)" if len(folded) > limit else "")
        lines.append(f"  {kind:9s} {len(names):5d}  {shown}")
    return "\n".join(lines)
