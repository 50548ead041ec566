"""A model folder (a final model, a training checkpoint, a PaddleFormers ERNIE 4.5 folder, a LoRA run's
adapter) as a single-device model in evaluation mode, with its tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import paddle

from ..checkpoint.checkpoint import BASE_FILE
from ..checkpoint.errors import CheckpointError
from ..checkpoint.formats import VL, SourceCheckpoint
from ..checkpoint.pretrained import load_pretrained
from ..config import Config, load_config
from ..config.load import build
from ..config.model_folder import model_config_from
from ..config.schema import ModelConfig
from ..config.validate import check_model
from ..data.encoding.processor_config import folder_settings
from ..data.encoding.tokenizer import Tokenizer, tokenizer_in
from ..finetune.adapter_files import adapter_base, load_adapter
from ..model.ernie_vl import ErnieMoEForConditionalGeneration
from ..model.parameter_kinds import is_vision


def folder_run_config(directory, config_path=None) -> Config:
    """The config under which inputs to the folder's model are encoded as its training encoded them: the folder's
    processor settings (``preprocessor_config.json``) under the sections of the YAML file ``config_path``."""
    return load_config(config_path, check_paths=False, base=folder_settings(directory))


@dataclass
class LoadedModel:
    model: ErnieMoEForConditionalGeneration  # in evaluation mode
    tokenizer: Tokenizer | None
    cfg: ModelConfig
    sees_images: bool  # the folder held the vision encoder and adapter (a text model's folder does not)


def load_model_folder(directory, need_tokenizer: bool = True) -> LoadedModel:
    """Raises CheckpointError (or ConfigError) naming what is wrong: no folder, no config.json, tensors of
    another shape, weights missing (only a text model's missing vision side is allowed)."""
    folder = Path(directory)
    if not folder.is_dir():
        raise CheckpointError(f"model folder '{folder}' " + ("is a file, not a model folder (give the folder that "
                                                             "holds config.json)" if folder.exists() else
                                                             "does not exist"))
    adapter = folder if (folder / BASE_FILE).is_file() else None  # a LoRA adapter: its base, then its pairs
    weights = Path(adapter_base(folder)) if adapter else folder
    cfg = build(ModelConfig, model_config_from(weights), "model")
    check_model(cfg)  # what a run checks of its model section, before anything is built from it
    source = SourceCheckpoint(weights)  # opened once: a .pdparams folder is read whole when opened
    source.check_size(cfg)
    paddle.seed(0)
    model = ErnieMoEForConditionalGeneration(cfg)
    report = load_pretrained(model, weights, source=source)
    if adapter:
        load_adapter(model, cfg, adapter)
    missing = report.get("new", [])
    # a text model's folder has no vision side; a VL folder without one is incomplete
    text_only = bool(missing) and all(is_vision(name) for name in missing) and report["model_type"] != VL
    if missing and not text_only:
        # a VL folder's missing vision side is named as well: the folder says it is a VL model
        unexpected = [name for name in missing if not is_vision(name)] or missing
        raise CheckpointError(f"'{weights}' holds no weights for {len(unexpected)} of this model's parameters (e.g. "
                              f"{unexpected[0]}): not a complete model of the shape its config.json describes")
    model.eval()
    try:
        tokenizer = tokenizer_in(folder, cfg.im_patch_id)
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    if tokenizer is None and need_tokenizer:
        raise CheckpointError(f"'{folder}' holds no tokenizer (tokenizer.model, vocab.json or tokenizer_config.json)")
    return LoadedModel(model, tokenizer, cfg, sees_images=not text_only)
