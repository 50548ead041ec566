"""What a run settles before it claims its output folder and builds its model (the device's memory against the
planner's prediction, the model's vocabulary and image placeholder against the tokenizer), and what it says as it
starts: the notes on settings this machine does not act on, the pretrained weights' import report, the data
report."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import paddle

from .. import json_files
from ..checkpoint.pretrained import format_report
from ..config import Config, ConfigError
from ..config.schema import ModelConfig, TrainingConfig
from ..data.encoding.tokenizer import Tokenizer
from ..data.feeding.loader import sample_encoder
from ..data.feeding.report import data_report, describe
from ..monitor.memory import MemoryMonitor
from ..parallel.env import DistEnv
from ..paths import write_output


def device_bytes(training_cfg: TrainingConfig) -> float:
    return (training_cfg.device_memory_gb or MemoryMonitor().device_total_gb()) * 2 ** 30


def check_memory(cfg: Config, env: DistEnv) -> None:
    """Stop before building anything when the memory planner predicts that the layout does not fit."""
    from ..memory.report import report

    text, ok = report(cfg, env.world_size, device_bytes(cfg.training) / 2 ** 30, run_search=False)
    if not ok:
        raise ConfigError(f"the memory planner predicts that this layout does not fit the device:\n{text}")


def sized_to_tokenizer(cfg: Config, tokenizer: Tokenizer, say: bool) -> Config:
    """A model built here (no ``training.model_name_or_path``) takes from its tokenizer what must agree with it:
    the vocabulary when the tokenizer outgrows ``model.vocab_size`` (the default config's 32 words, with data read
    as bytes), rounded up to a multiple of the tensor-parallel degree, and the image placeholder's id
    (``model.im_patch_id``) when the tokenizer has one of its own (an ERNIE SentencePiece tokenizer); ``say``
    prints a note of each. A loaded model's vocabulary and placeholder are its own."""
    m, tp = cfg.model, cfg.parallel.tensor_parallel_degree
    if cfg.training.model_name_or_path:
        return cfg
    vocab, placeholder = m.vocab_size, m.im_patch_id
    if tokenizer.vocab_size > m.vocab_size:
        vocab = size = -(-tokenizer.vocab_size // tp) * tp
        if say:
            print(f"note: model.vocab_size {m.vocab_size} is below the tokenizer's {tokenizer.vocab_size} tokens: "
                  f"the model built here has {size}", flush=True)
    own = tokenizer.placeholder_id()
    if own is not None and own != m.im_patch_id:
        placeholder = own
        if say:
            print(f"note: the tokenizer's image placeholder has id {own}: the model built here takes it as "
                  f"model.im_patch_id (not {m.im_patch_id})", flush=True)
    if (vocab, placeholder) == (m.vocab_size, m.im_patch_id):
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(m, vocab_size=vocab, im_patch_id=placeholder))


def check_tokenizer(tokenizer: Tokenizer, model_cfg: ModelConfig) -> None:
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size is "
                          f"{model_cfg.vocab_size}; raise model.vocab_size to at least {tokenizer.vocab_size}.")
    own = tokenizer.placeholder_id()
    if own is not None and own != model_cfg.im_patch_id:
        raise ConfigError(f"the tokenizer's image placeholder piece has id {own} but model.im_patch_id is "
                          f"{model_cfg.im_patch_id}; set model.im_patch_id={own}.")


def notes(cfg: Config, env: DistEnv, mixed_precision: str | None) -> None:
    """What a setting does not do on this machine, said once by rank 0 (``mixed_precision``: the AMP dtype, or
    None)."""
    t = cfg.training
    if not env.is_main:
        return
    if mixed_precision and not paddle.is_compiled_with_cuda():
        print(f"note: {mixed_precision} mixed precision needs a GPU; on this CPU build Paddle computes in "
              "float32 (loss scaling and the inf/nan step guard still apply)", flush=True)
    if t.final_model_format == "transformers" and cfg.model.num_nextn_predict_layers:
        print("note: the final model in transformers' form leaves the multi-token prediction layers out "
              "(transformers' ERNIE-4.5-VL has none); the checkpoints keep them", flush=True)
    if t.offload_optim and not paddle.device.get_device().startswith("gpu"):
        print("note: training.offload_optim keeps optimizer states in host memory between steps; on a CPU that "
              "is where they already are, so it saves nothing here (the same moves run)", flush=True)


def import_report(report: dict, cfg: Config, env: DistEnv) -> None:
    """The pretrained weights' import report, printed and written to import_report.json by rank 0."""
    if env.is_main:
        print(format_report(report), flush=True)
        out = Path(cfg.training.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        write_output(out / "import_report.json", json.dumps(report, indent=2))


def report_data(train_set, tokenizer: Tokenizer, cfg: Config, env: DistEnv) -> None:
    """One encoded sample and the data's figures, printed and written to data_report.json by rank 0
    (``data.report_samples`` of them; 0: none)."""
    if not env.is_main or not cfg.data.report_samples:
        return
    report = data_report(train_set, sample_encoder(tokenizer, cfg, Counter()), tokenizer, cfg.data.report_samples,
                         cfg.training.seed)
    print(describe(report), flush=True)
    write_output(Path(cfg.training.output_dir) / "data_report.json", json_files.dumps(report, indent=2))
