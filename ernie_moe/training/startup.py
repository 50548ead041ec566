"""What a run settles before it claims its output folder and builds its model: the device's memory against the
planner's prediction, and the model's vocabulary and image placeholder against the tokenizer."""

from __future__ import annotations

import dataclasses

from ..config import Config, ConfigError
from ..config.schema import ModelConfig, TrainingConfig
from ..data.encoding.tokenizer import Tokenizer
from ..monitor.memory import MemoryMonitor
from ..parallel.env import DistEnv


def device_bytes(training_cfg: TrainingConfig) -> float:
    return (training_cfg.device_memory_gb or MemoryMonitor().device_total_gb()) * 2 ** 30


def check_memory(cfg: Config, env: DistEnv) -> None:
    """Stop before building anything when the memory planner predicts that the layout does not fit."""
    from ..memory.report import report

    text, ok = report(cfg, env.world_size, device_bytes(cfg.training) / 2 ** 30, run_search=False)
    if not ok:
        raise ConfigError(f"the memory planner predicts that this layout does not fit the device:\n{text}")


def sized_to_tokenizer(cfg: Config, tokenizer: Tokenizer, say: bool) -> Config:
    """A model built here (no ``training.model_name_or_path``) whose ``model.vocab_size`` the tokenizer outgrows
    (the default config's 32 words, with data read as bytes) takes the tokenizer's vocabulary, rounded up to a
    multiple of the tensor-parallel degree, and ``say`` prints a note; a loaded model's vocabulary is its own."""
    m, tp = cfg.model, cfg.parallel.tensor_parallel_degree
    if cfg.training.model_name_or_path or tokenizer.vocab_size <= m.vocab_size:
        return cfg
    size = -(-tokenizer.vocab_size // tp) * tp
    if say:
        print(f"note: model.vocab_size {m.vocab_size} is below the tokenizer's {tokenizer.vocab_size} tokens: the "
              f"model built here has {size}", flush=True)
    return dataclasses.replace(cfg, model=dataclasses.replace(m, vocab_size=size))


def check_tokenizer(tokenizer: Tokenizer, model_cfg: ModelConfig) -> None:
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size is "
                          f"{model_cfg.vocab_size}; raise model.vocab_size to at least {tokenizer.vocab_size}.")
    own = tokenizer.placeholder_id()
    if own is not None and own != model_cfg.im_patch_id:
        raise ConfigError(f"the tokenizer's image placeholder piece has id {own} but model.im_patch_id is "
                          f"{model_cfg.im_patch_id}; set model.im_patch_id={own}.")
