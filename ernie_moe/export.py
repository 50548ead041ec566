"""Write a model folder as PaddleFormers' ``from_pretrained`` reads it (Hugging Face layout), or as
transformers' ``AutoModelForImageTextToText.from_pretrained`` reads it (``--format transformers``).

    python -m ernie_moe.export SOURCE OUTPUT [--model-type ernie4_5_moe_vl|ernie4_5_moe|ernie4_5]
    python -m ernie_moe.export SOURCE OUTPUT --format transformers
    python -m ernie_moe.export CHECKPOINT OUTPUT --ema [--format transformers]
    python -m ernie_moe.export ADAPTER OUTPUT --merge-lora [--base BASE] [--format transformers]
    python -m ernie_moe.export ADAPTER OUTPUT --adapter --format transformers [--base BASE]
    python -m ernie_moe.export FOLDER --check

Without ``--format`` the folder is PaddleFormers' form, which vLLM, SGLang and FastDeploy read (the MoE layer
range per modality, a correction bias in every MoE layer, the remote code ``auto_map`` names); ``--no-mtp`` leaves
the multi-token prediction layers out (SGLang's ERNIE-4.5-VL loader cannot take them). ``--check`` says, for any
model folder, what each engine would do with it (``checkpoint.engines``), and exits 1 when an engine would fail.

SOURCE is a training checkpoint (``checkpoint-<step>``), a final model, or any folder that
``training.model_name_or_path`` reads. With ``--ema``, the checkpoint's EMA of the weights (``training.ema_decay``)
is written in place of the trained weights. With ``--merge-lora``, ADAPTER is a LoRA run's final model (its
adapter): the output is the base model it refers to (or ``--base``) with ``A B * scaling`` added to each
adapted weight; with ``--adapter --format transformers`` the output is the adapter in PEFT's form (routed
experts excepted: transformers stacks them). Tensors are read and converted one at a time and written in shards of at
most ``--max-shard-size-gb``; the tokenizer files and the processor and generation settings are copied. The
text model types leave out the vision side. The two formats hold the same tensors and differ in config.json
(transformers' nests the text and vision sections); a setting transformers cannot express is an export error.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import save_file

from .checkpoint.checkpoint import BASE_FILE, EMA, IndexedTensors
from .checkpoint.engines import check_folder, summary_lines
from .checkpoint.formats import (
    FUSED_PIECES,
    MODEL_TYPES,
    VL,
    CheckpointError,
    SourceCheckpoint,
    to_hf,
    transformers_name,
)
from .checkpoint.model_files import PADDLEFORMERS, TRANSFORMERS, correction_bias_zeros, model_config_dict
from .checkpoint.remote_code import ship_remote_code
from .cli import MAX_GB, bounded
from .config.load import ConfigError, build
from .config.model_folder import model_config_from
from .config.schema import ModelConfig
from .config.transformers_form import special_ids, to_transformers
from .config.validate import check_model
from .data.encoding.processor_config import FILE as PROCESSOR_FILE
from .data.encoding.processor_config import for_library, longest_side_rule, read_saved
from .data.encoding.tokenizer import tokenizer_in
from .finetune.adapter_files import adapter_base, merged_weight, read_adapter
from .finetune.peft_files import write_peft_adapter
from .model.parameter_kinds import MTP
from .paths import write_output

TOKENIZER_FILES = ("tokenizer.model", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "tokenizer.json")


def model_names(source_names) -> list[str]:
    """This package's parameter names for a folder's tensor names (split q/k/v and gate/up fused)."""
    names = []
    for name in source_names:
        for fused, pieces in FUSED_PIECES.items():
            for piece in pieces:
                if name.endswith(f".{piece}.weight"):
                    name = name[: -len(f"{piece}.weight")] + f"{fused}.weight"
        if name not in names:
            names.append(name)
    return names


def export(source_dir, output_dir, model_type: str = VL, max_shard_bytes: int = 5 * 2 ** 30,
           adapter_dir=None, form: str = PADDLEFORMERS, ema: bool = False, any_image_rule: bool = False,
           mtp: bool = True) -> dict:
    """``any_image_rule``: write a folder of a run that resized images by their longest side, which the
    libraries' image processors cannot reproduce (refused without it); ``mtp``: keep the multi-token prediction
    layers (where the form has them)."""
    refuse_writing_into(output_dir, [source_dir, adapter_dir])
    source = SourceCheckpoint(source_dir)
    averages = ema_of(source_dir) if ema else None
    cfg = build(ModelConfig, model_config_from(source_dir), "model")
    check_model(cfg)
    source.check_size(cfg)
    adapter = read_adapter(adapter_dir, cfg) if adapter_dir is not None else None
    saved = read_saved(adapter_dir or source_dir)  # processor settings; an adapter's run encoded inputs its own way
    side = longest_side_rule(saved)
    if side and model_type == VL and not any_image_rule:
        raise ValueError(f"the run that wrote {adapter_dir or source_dir} resized images by their longest side "
                         f"(data.max_image_side {side}), a rule neither PaddleFormers' nor transformers' image "
                         "processor follows: they would cut other patch grids than training did. Train with the pixel "
                         "budget (data.max_image_side 0, data.image_max_pixels), or pass --any-image-rule to write "
                         "the folder anyway (this package's commands still encode as training did)")
    if form == TRANSFORMERS and model_type != VL:
        raise ValueError(f"--format transformers writes the VL model ({VL}), not {model_type}")
    try:
        tokenizer = tokenizer_in(source_dir, cfg.im_patch_id)
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    if form == TRANSFORMERS:
        config = to_transformers(cfg, special_ids(tokenizer), source.config)
    else:
        config = model_config_dict(cfg, hf_layout=True, model_type=model_type, base=source.config,
                                   special=special_ids(tokenizer))
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[list[str]] = []
    weight_map: dict[str, str] = {}
    shard: dict[str, Any] = {}  # name -> array
    size = total = 0

    def flush():
        nonlocal shard, size
        if shard:
            shards.append(sorted(shard))
            part = out / f"part-{len(shards)}.safetensors"
            try:
                save_file(shard, str(part), metadata={"format": "np"})
            except SafetensorError as err:  # a full or read-only disk, in safetensors' own words
                raise OSError(f"cannot write {part}: {err}") from None
        shard, size = {}, 0

    names = model_names(source.names())
    left_out = len(names)
    if form == TRANSFORMERS or not mtp:  # transformers' ERNIE-4.5-VL has no multi-token prediction layers
        names = [n for n in names if not n.startswith(MTP)]
    left_out -= len(names)
    if form != TRANSFORMERS and not any(n.startswith(MTP) for n in names):
        config["num_nextn_predict_layers"] = 0  # PaddleFormers would otherwise expect multi-token-prediction weights
    if cfg.tie_word_embeddings and "lm_head.weight" in names:
        names.remove("lm_head.weight")  # a copy of the embedding that a tied model does not read
    for name in names:
        value, _ = source.paddle_tensor(name)
        if value is None:  # a fused weight whose pieces the folder does not all hold
            raise CheckpointError(f"{source_dir} lacks {name} (or a piece of it)")
        if averages is not None and name in averages.where:
            value = averages.get(name)
        if adapter is not None:
            value = merged_weight(name, value, adapter, cfg)
        if not np.isfinite(value).all():  # every loader refuses such a folder: say so before writing it
            raise CheckpointError(f"{name} holds nan or inf values{' after merging the adapter' if adapter else ''}:"
                                  " the weights are damaged (a diverged run, or a broken conversion); nothing "
                                  "written for it")
        for hf_name, array in to_hf(name, value, cfg, model_type):
            shard[transformers_name(hf_name) if form == TRANSFORMERS else hf_name] = array
            size += array.nbytes
            total += array.nbytes
        if size >= max_shard_bytes:
            flush()
    if model_type != "ernie4_5":  # transformers and the engines hold a correction bias in every MoE layer: zeros
        for hf_name, array in correction_bias_zeros(cfg, set(names)):
            shard[transformers_name(hf_name) if form == TRANSFORMERS else hf_name] = array
            total += array.nbytes
    flush()
    for k, names in enumerate(shards, start=1):
        filename = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        (out / f"part-{k}.safetensors").rename(out / filename)
        weight_map.update({name: filename for name in names})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    write_output(out / "model.safetensors.index.json", json.dumps(index, indent=2))
    write_output(out / "config.json", json.dumps(config, indent=2))
    for filename in (*TOKENIZER_FILES, "generation_config.json"):
        if (Path(source_dir) / filename).is_file():
            shutil.copy(Path(source_dir) / filename, out / filename)
    if saved is not None:
        write_output(out / PROCESSOR_FILE, json.dumps(for_library(saved, form == TRANSFORMERS), indent=2))
    if form == PADDLEFORMERS:
        ship_remote_code(out, source_dir, vl=model_type == VL)
    return {"tensors": len(weight_map), "shards": len(shards), "bytes": total, "left_out": left_out}


def ema_of(checkpoint_dir) -> IndexedTensors:
    """A full fine-tuning checkpoint's EMA; CheckpointError when it has none."""
    folder = Path(checkpoint_dir)
    if (folder / BASE_FILE).is_file():
        raise CheckpointError(f"{folder} is a LoRA run's checkpoint: with training.save_ema_as_final its final_model "
                              "is the adapter of the EMA")
    if not (folder / f"{EMA}.index.json").is_file():
        raise CheckpointError(f"{folder} holds no EMA of the weights ({EMA}.index.json): a checkpoint of a run with "
                              "training.ema_decay, saved once the EMA had started, has one")
    return IndexedTensors(folder, f"{EMA}.index.json")


def refuse_writing_into(output_dir, read_dirs) -> None:
    """ValueError, before anything is written, when ``output_dir`` is a folder the command reads or lies inside
    one (an export into its own checkpoint overwrote the files it then failed to read)."""
    out = Path(output_dir).resolve()
    for folder in (Path(d).resolve() for d in read_dirs if d is not None):
        if out == folder or folder in out.parents:
            raise ValueError(f"the output folder {output_dir} is {'the' if out == folder else 'inside the'} folder "
                             f"{folder} this export reads; write it elsewhere")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="checkpoint or model folder")
    parser.add_argument("output", nargs="?", help="folder to write")
    parser.add_argument("--check", action="store_true",
                        help="say whether vLLM, SGLang and FastDeploy would serve SOURCE as trained (exit 1 if not)")
    parser.add_argument("--no-mtp", action="store_true", help="leave the multi-token prediction layers out")
    parser.add_argument("--model-type", default=VL, choices=MODEL_TYPES)
    parser.add_argument("--max-shard-size-gb", type=bounded(float, 0, MAX_GB, low_included=False), default=5.0)
    parser.add_argument("--merge-lora", action="store_true", help="SOURCE is a LoRA adapter: merge it into its base")
    parser.add_argument("--adapter", action="store_true",
                        help="with --format transformers, SOURCE is a LoRA adapter: write it in PEFT's form")
    parser.add_argument("--base", help="with --merge-lora: the base model folder (default: the one the adapter names)")
    parser.add_argument("--ema", action="store_true", help="write the checkpoint's EMA of the weights")
    parser.add_argument("--format", default=PADDLEFORMERS, choices=(PADDLEFORMERS, TRANSFORMERS),
                        help="whose config.json to write (the tensors are the same)")
    parser.add_argument("--any-image-rule", action="store_true",
                        help="write the folder of a run that resized images by their longest side "
                             "(data.max_image_side), which the libraries' image processors cannot reproduce")
    args = parser.parse_args(argv)
    if args.check:
        return _check(args.source)
    if args.output is None:
        parser.error("give the folder to write (OUTPUT), or --check")
    try:
        if args.adapter:
            return _peft_adapter(args)
        source, adapter = args.source, None
        if args.merge_lora:
            source, adapter = adapter_base(args.source, args.base), args.source
        if args.ema and args.merge_lora:
            raise ValueError("--ema writes a full fine-tuning checkpoint's EMA; a LoRA run's EMA is its final_model "
                             "with training.save_ema_as_final")
        done = export(source, args.output, args.model_type, int(args.max_shard_size_gb * 2 ** 30), adapter,
                      args.format, args.ema, args.any_image_rule, not args.no_mtp)
    except (CheckpointError, ConfigError, ValueError, OSError) as err:
        print(f"export error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {done['tensors']} tensors ({done['bytes'] / 2 ** 20:.1f} MiB) in {done['shards']} shard(s) to "
          f"{args.output} ({'transformers ' + VL if args.format == TRANSFORMERS else args.model_type}, "
          "Hugging Face layout)")
    if done["left_out"]:
        why = ("as asked (--no-mtp)" if args.no_mtp and args.format != TRANSFORMERS else
               "transformers' ERNIE-4.5-VL has no MTP layers (the PaddleFormers form keeps them)")
        print(f"left out {done['left_out']} multi-token prediction tensors: {why}")
    if args.format != TRANSFORMERS and not args.adapter:
        print("\n".join(summary_lines(check_folder(args.output))))
    return 0


def _check(folder) -> int:
    """``--check``: each engine's problems and notes with ``folder``; 1 when one would not serve it as trained."""
    if not Path(folder).is_dir():
        print(f"export error: {folder} is not a folder", file=sys.stderr)
        return 2
    reports = check_folder(folder)
    for report in reports:
        print(f"{report.name}: {'loads it as trained' if not report.problems else 'would not serve it as trained'}")
        for problem in report.problems:
            print(f"  problem: {problem}")
        for note in report.notes:
            print(f"  note: {note}")
    return 1 if any(r.problems for r in reports) else 0


def _peft_adapter(args) -> int:
    """``--adapter --format transformers``: the adapter in PEFT's form, for the base in transformers' form."""
    if args.format != TRANSFORMERS or args.merge_lora:
        raise ValueError("--adapter writes a LoRA adapter in PEFT's form: give it with --format transformers, "
                         "without --merge-lora")
    base = adapter_base(args.source, args.base)
    refuse_writing_into(args.output, [args.source, base])
    cfg = build(ModelConfig, model_config_from(base), "model")
    done = write_peft_adapter(args.source, args.output, cfg, args.base)
    print(f"wrote {done['tensors']} LoRA tensors on {done['layers']} layers ({done['bytes'] / 2 ** 20:.1f} MiB) to "
          f"{args.output} (PEFT's form, for transformers' {VL})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
