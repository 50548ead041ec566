"""What a run writes for use: the model folder (or, for LoRA, the adapter) of its weights now, the EMA's where the
run exports those, and whether the serving engines would serve it as trained."""

from __future__ import annotations

import contextlib
from pathlib import Path

from ..checkpoint import save_model
from ..checkpoint.engines import check_folder, summary_lines
from ..checkpoint.model_files import PADDLEFORMERS, folder_config, inference_files
from ..checkpoint.remote_code import ship_remote_code
from ..config import Config
from ..data.encoding.tokenizer import Tokenizer
from ..finetune.adapter_files import save_adapter
from ..finetune.lora import LoRASettings
from ..parallel.env import DistEnv
from ..parallel.zero import whole_weights
from .assembly import Assembled


def export(parts: Assembled, cfg: Config, tokenizer: Tokenizer, env: DistEnv, folder: Path) -> bool:
    """The model folder or adapter of the weights now (every rank calls this); whether they were the EMA's."""
    # sharding stage 3: a full model's weights are gathered one by one as they are written, an adapter's together
    with whole_weights(parts.model) if parts.base is not None else contextlib.nullcontext():
        return _write(parts, cfg, tokenizer, env, folder)


def _write(parts: Assembled, cfg: Config, tokenizer: Tokenizer, env: DistEnv, folder: Path) -> bool:
    t = cfg.training
    files = inference_files(cfg, tokenizer, t.final_model_format)
    ema = parts.ema if t.save_ema_as_final and parts.ema is not None and parts.ema.started else None
    with ema.swapped_in() if ema is not None else contextlib.nullcontext():
        if parts.base is not None:  # the adapter alone, as PaddleFormers' LoRAModel reads it
            save_adapter(parts.model, cfg.model, LoRASettings.of(t), folder, tokenizer, env, parts.base, files)
        else:
            save_model(parts.model, cfg.model, str(folder), tokenizer, env, hf_layout=True,
                       source=folder_config(t.model_name_or_path), extra=files, form=t.final_model_format)
            if env.is_main and t.final_model_format == PADDLEFORMERS:
                ship_remote_code(folder, t.model_name_or_path)
    return ema is not None


def serving_check(folder: Path) -> dict:
    """Whether vLLM, SGLang and FastDeploy would serve ``folder`` as trained: printed, and returned by engine."""
    reports = check_folder(folder)
    print("\n".join(summary_lines(reports)), flush=True)
    return {r.engine: r.as_dict() for r in reports}
