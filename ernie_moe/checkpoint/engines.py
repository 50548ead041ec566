"""Whether vLLM, SGLang and FastDeploy load a model folder, and load it as trained: each engine's reading of
``config.json``, of the tensor names and of the folder's files, written down from its own loaders.

Read from vLLM 0.33.0 and SGLang 0.5.23 (``model_executor/models/ernie45_vl*.py``, ``ernie45_moe.py``,
``ernie_mtp.py``; ``srt/models/ernie45_vl.py``, ``ernie45_moe_vl.py``, ``ernie4.py`` and its multimodal processor)
and FastDeploy's develop branch (``model_executor/models/ernie4_5_vl/``, ``default_loader_v1.py``), the
transformers steps at their pin (5.19). A *problem* stops the engine or makes it serve another model than the one
trained (a layer built dense, a bias left uninitialised); a *note* is what it leaves out without harm.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeGuard

from ..json_files import UnreadableJSON, read_json
from .errors import CheckpointError
from .formats import read_weight_map

ENGINES = {"vllm": "vLLM 0.33.0", "sglang": "SGLang 0.5.23", "fastdeploy": "FastDeploy (develop)"}
VL_ARCHITECTURE = "Ernie4_5_VLMoeForConditionalGeneration"
ARCHITECTURES = {  # what each engine registers for ERNIE 4.5
    "vllm": {VL_ARCHITECTURE, "Ernie4_5_MoeForCausalLM", "Ernie4_5ForCausalLM"},
    "sglang": {VL_ARCHITECTURE, "Ernie4_5_MoeForCausalLM", "Ernie4_5_ForCausalLM"},
    "fastdeploy": {VL_ARCHITECTURE, "Ernie4_5_MoeForCausalLM", "Ernie4_5ForCausalLM", "Ernie4_5_ForCausalLM"},
}
AUTO = ("vllm", "sglang")  # the engines that read a folder through transformers' Auto classes
TRANSFORMERS_TYPES = ("ernie4_5", "ernie4_5_moe")  # model types AutoConfig knows without remote code
KNOWN_TOKENIZERS = ("LlamaTokenizer", "LlamaTokenizerFast", "PreTrainedTokenizerFast", "TokenizersBackend")
# fields the VL class reads without a default (vLLM and SGLang), and what SGLang's processor reads besides
VL_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
             "vocab_size", "intermediate_size", "hidden_act", "tie_word_embeddings", "im_patch_id",
             "pixel_hidden_size", "spatial_conv_size", "temporal_conv_size", "use_temporal_conv", "moe_k")
VISION_FIELDS = ("patch_size", "spatial_merge_size", "hidden_size", "embed_dim", "depth", "num_heads", "mlp_ratio")
MARKER_IDS = ("image_start_token_id", "image_end_token_id", "video_start_token_id", "video_end_token_id")
BIAS = "mlp.moe_statics.e_score_correction_bias"


@dataclass
class EngineReport:
    """One engine's reading of a folder."""

    engine: str
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return ENGINES[self.engine]

    def as_dict(self) -> dict:
        return {"engine": self.name, "loads": not self.problems, "problems": self.problems, "notes": self.notes}


def check_folder(folder) -> list[EngineReport]:
    """Each engine's problems and notes with the model folder ``folder``."""
    folder = Path(folder)
    reports = {engine: EngineReport(engine) for engine in ENGINES}
    try:
        config = read_json(folder / "config.json")
    except UnreadableJSON as err:
        _problem(reports, f"config.json: {err}")
        return list(reports.values())
    if not isinstance(config, dict):
        _problem(reports, "config.json is not a JSON object")
        return list(reports.values())
    if (folder / "lora_config.json").is_file() or (folder / "adapter_config.json").is_file():
        _problem(reports, "a LoRA adapter, not a model: merge it into its base first (python -m ernie_moe.export "
                          "ADAPTER OUT --merge-lora)")
        return list(reports.values())
    if config.get("model_type") == "ernie4_5_vl_moe":
        _problem(reports, "transformers' nested ERNIE-4.5-VL config (export --format transformers): the engines' ERNIE "
                          "classes read the PaddleFormers form (python -m ernie_moe.export SOURCE OUT, no --format)")
        return list(reports.values())
    try:
        names = tensor_names(folder)
    except CheckpointError as err:
        _problem(reports, str(err))
        return list(reports.values())
    architecture = (config.get("architectures") or [None])[0]
    for engine, known in ARCHITECTURES.items():
        if architecture not in known:
            reports[engine].problems.append(f"architectures {config.get('architectures')!r}: the engine "
                                            f"registers {', '.join(sorted(known))}")
    _check_dtype(config, names, reports)
    _check_auto_config(folder, config, reports)
    if architecture == VL_ARCHITECTURE:
        _check_vl_config(config, reports)
    _check_moe_tensors(config, names, architecture == VL_ARCHITECTURE, reports)
    _check_files(folder, config, architecture == VL_ARCHITECTURE, reports)
    return list(reports.values())


def _problem(reports: dict[str, EngineReport], line: str, engines=tuple(ENGINES)) -> None:
    """``line`` as a problem of each of ``engines``."""
    for engine in engines:
        reports[engine].problems.append(line)


def _lacks_remote_class(folder: Path, auto_map, key: str) -> bool:
    """Whether ``auto_map`` names no ``key`` class whose module the folder holds (transformers cannot build it)."""
    target = _auto_map_file(auto_map, key)
    return target is None or not (folder / target).is_file()


def tensor_names(folder: Path) -> list[str]:
    """The tensor names a folder's safetensors hold (its index's, or the single file's header)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return list(read_weight_map(index))
    single = folder / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        try:
            with safe_open(str(single), framework="numpy") as f:
                return list(f.keys())
        except Exception as err:  # safetensors reports a bad header in several ways
            raise CheckpointError(f"cannot read {single}: {err}") from None
    raise CheckpointError(f"{folder} holds no safetensors weights (model.safetensors.index.json or "
                          "model.safetensors): the engines read only those")


def _check_dtype(config: dict, names: list[str], reports: dict[str, EngineReport]) -> None:
    has_torch, has_paddle = "torch_dtype" in config, "dtype" in config
    if has_torch == has_paddle:
        reports["fastdeploy"].problems.append(
            "config.json must hold exactly one of torch_dtype (the Hugging Face layout) and dtype (the Paddle layout): "
            f"it has {'both' if has_torch else 'neither'}, so FastDeploy cannot tell how to read the weights")
    fused = [n for n in names if re.search(r"\.(qkv_proj|up_gate_proj)\.weight$", n) and "vision_model" not in n]
    if fused:
        _problem(reports, f"{len(fused)} fused tensors of the Paddle layout (e.g. {fused[0]}): the engine reads split "
                          "q/k/v and gate/up projections (write the folder with python -m ernie_moe.export)", AUTO)


def _check_auto_config(folder: Path, config: dict, reports: dict[str, EngineReport]) -> None:
    """vLLM and SGLang read config.json with transformers' AutoConfig: a model type it knows, or remote code."""
    if config.get("model_type") in TRANSFORMERS_TYPES:
        return
    target = _auto_map_file(config.get("auto_map"), "AutoConfig")
    if target is None:
        line = (f"model_type {config.get('model_type')!r} is not a transformers model type and config.json has no "
                "auto_map.AutoConfig: AutoConfig.from_pretrained raises")
    elif not (folder / target).is_file():
        line = f"config.json's auto_map names {target}, which the folder lacks: AutoConfig.from_pretrained raises"
    else:
        return
    _problem(reports, line, AUTO)


def auto_map_files(auto_map, key: str | None = None) -> list[str]:
    """The module files an ``auto_map`` names, in order, once each: ``key``'s entry, or every entry. An entry is
    ``module.Class`` (or ``repo--module.Class``), or a ``[slow, fast]`` pair of them."""
    if not isinstance(auto_map, dict):
        return []
    entries = [auto_map.get(key)] if key else list(auto_map.values())
    names = [e for entry in entries for e in (entry if isinstance(entry, list) else [entry])]
    return list(dict.fromkeys(e.split("--")[-1].rsplit(".", 1)[0] + ".py"
                              for e in names if isinstance(e, str) and "." in e))


def _auto_map_file(auto_map, key: str) -> str | None:
    """The file ``key``'s ``auto_map`` entry names first (a pair's slow class), or None."""
    return next(iter(auto_map_files(auto_map, key)), None)


def _is_whole(value) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_vl_config(config: dict, reports: dict[str, EngineReport]) -> None:
    missing = [k for k in VL_FIELDS if k not in config]
    if missing:
        _problem(reports, f"config.json lacks {', '.join(missing)}, which the ERNIE-4.5-VL class reads without a "
                          "default", AUTO)
    layers = config.get("num_hidden_layers")
    experts = config.get("moe_num_experts")
    if not (isinstance(experts, list) and len(experts) == 2 and all(_is_whole(e) and e > 0 for e in experts)):
        _problem(reports, f"moe_num_experts {experts!r}: the ERNIE-4.5-VL class indexes [text, vision] expert "
                          "counts", AUTO)
    elif experts[0] != experts[1]:
        reports["vllm"].problems.append(f"moe_num_experts {experts}: vLLM asserts one count for text and vision")
    widths = config.get("moe_intermediate_size")
    if not (isinstance(widths, list) and len(widths) == 2):
        _problem(reports, f"moe_intermediate_size {widths!r}: the ERNIE-4.5-VL class indexes [text, vision] expert "
                          "widths", AUTO)
    for key in ("moe_layer_start_index", "moe_layer_end_index"):
        value = config.get(key)
        if not (isinstance(value, list) and len(value) == 2 and all(_is_whole(v) for v in value)):
            _problem(reports, f"{key} {value!r}: the ERNIE-4.5-VL class indexes it as a [text, vision] list "
                              "(TypeError on a number)", AUTO)
        elif _is_whole(layers) and not all(0 <= v < layers for v in value):
            _problem(reports, f"{key} {value}: every entry must be a layer in 0..{layers - 1} (the engines compare "
                              "layers with it literally; -1 is not the last layer there)", AUTO)
    vision = config.get("vision_config")
    vision = vision if isinstance(vision, dict) else {}
    absent = [k for k in VISION_FIELDS if k not in vision]
    if absent:
        _problem(reports, f"vision_config lacks {', '.join(absent)}", AUTO)
    if "in_channels" not in vision:
        reports["vllm"].problems.append("vision_config lacks in_channels")
    if "in_chans" not in vision:
        reports["sglang"].problems.append("vision_config lacks in_chans (SGLang's name for the image channels)")
    if vision.get("hidden_size") != vision.get("embed_dim"):
        reports["vllm"].problems.append(f"vision_config.hidden_size {vision.get('hidden_size')!r} differs from "
                                        f"embed_dim {vision.get('embed_dim')!r}: vLLM asserts them equal")
    absent = [k for k in MARKER_IDS if k not in config]
    if absent:
        reports["sglang"].problems.append(f"config.json lacks {', '.join(absent)}, which SGLang's multimodal "
                                          "processor reads (AttributeError)")
        reports["vllm"].problems.append(f"config.json lacks {', '.join(absent)}: vLLM would route the image and "
                                        "video start / end markers to the text experts, where training routed them "
                                        "to the vision experts")


def _moe_layers(config: dict, literal: bool) -> set[int]:
    """The decoder layers an engine builds as MoE from config.json: vLLM and SGLang from the lowest start to the
    highest end (``literal`` False), FastDeploy comparing each layer with the values as written (an end of -1
    then holds no layer)."""
    layers = config.get("num_hidden_layers")
    experts = config.get("moe_num_experts")
    if not _is_whole(layers) or not experts:
        return set()
    starts, ends = config.get("moe_layer_start_index", 0), config.get("moe_layer_end_index", layers - 1)
    if ends is None:
        ends = layers - 1
    starts = starts if isinstance(starts, list) else [starts]
    ends = ends if isinstance(ends, list) else [ends]
    if not starts or not ends or not all(_is_whole(v) for v in [*starts, *ends]):
        return set()
    if not literal:
        ends = [e if e >= 0 else layers + e for e in ends]
    interval = config.get("moe_layer_interval", 1)
    interval = interval if _is_whole(interval) and interval > 0 else 1
    return {i for i in range(layers) if (i + 1) % interval == 0 and min(starts) <= i <= max(ends)}


def _check_moe_tensors(config: dict, names: list[str], vl: bool, reports: dict[str, EngineReport]) -> None:
    held: dict[int, int] = {}
    biased = set()
    for name in names:
        found = re.match(r"model\.layers\.(\d+)\.mlp\.(experts\.|gate\.|shared_experts\.|moe_statics\.)", name)
        if found:
            held[int(found.group(1))] = held.get(int(found.group(1)), 0) + 1
            if name.endswith(BIAS):
                biased.add(int(found.group(1)))
    for engine, literal in (("vllm", False), ("sglang", False), ("fastdeploy", True)):
        built = _moe_layers(config, literal)
        dense = sorted(set(held) - built)
        if dense:
            skipped = sum(held[i] for i in dense)
            reports[engine].problems.append(
                f"layers {_layer_list(dense)} hold experts, but {ENGINES[engine]}'s reading of moe_layer_start_index "
                f"{config.get('moe_layer_start_index')!r} / moe_layer_end_index {config.get('moe_layer_end_index')!r} "
                f"builds them dense and skips their {skipped} expert, router and shared-expert tensors")
        without = sorted(set(built) - set(held))
        if without:
            reports[engine].problems.append(f"layers {_layer_list(without)} are MoE layers by config.json but the "
                                            "folder holds no experts for them")
        unbiased = sorted(built & set(held) - biased)
        if unbiased:
            if engine == "vllm":
                reports[engine].problems.append(
                    f"layers {_layer_list(unbiased)} have no {BIAS}: vLLM creates it in every MoE layer and refuses "
                    "the folder (weights not initialized)")
            elif engine == "sglang":
                reports[engine].problems.append(
                    f"layers {_layer_list(unbiased)} have no {BIAS}: SGLang adds its uninitialised memory to the "
                    "router's scores (tokens misrouted)")
            elif config.get("moe_use_aux_free"):
                reports[engine].problems.append(
                    f"layers {_layer_list(unbiased)} have no {BIAS}, which FastDeploy reads with moe_use_aux_free")
    mtp = [n for n in names if n.startswith("model.mtp_")]
    if mtp:
        if vl:
            reports["sglang"].problems.append(
                f"{len(mtp)} multi-token prediction tensors (model.mtp_*): SGLang's ERNIE-4.5-VL loader raises "
                "KeyError on them; write a folder without them for SGLang (python -m ernie_moe.export SOURCE OUT "
                "--no-mtp)")
            for engine in ("vllm", "fastdeploy"):
                reports[engine].notes.append(f"skips the {len(mtp)} multi-token prediction tensors (no drafting from "
                                             "them for the VL model)")
        else:
            for engine in ENGINES:
                reports[engine].notes.append(f"reads the {len(mtp)} multi-token prediction tensors as its ERNIE MTP "
                                             "draft model")


def _layer_list(layers: list[int]) -> str:
    return ", ".join(map(str, layers[:8])) + (f" ... ({len(layers)} layers)" if len(layers) > 8 else "")


def _check_files(folder: Path, config: dict, vl: bool, reports: dict[str, EngineReport]) -> None:
    tokenizer_config = json_object(folder / "tokenizer_config.json")
    if (folder / "tokenizer.model").is_file():
        known = tokenizer_config.get("tokenizer_class") in KNOWN_TOKENIZERS or (folder / "tokenizer.json").is_file()
        if not known and _lacks_remote_class(folder, tokenizer_config.get("auto_map"), "AutoTokenizer"):
            _problem(reports, "tokenizer_config.json has no auto_map.AutoTokenizer whose file the folder holds: "
                              f"AutoTokenizer cannot build {tokenizer_config.get('tokenizer_class')!r}", AUTO)
        if vl:
            _check_image_ids(folder, config, tokenizer_config, reports["fastdeploy"])
    elif (folder / "tokenizer.json").is_file():
        reports["fastdeploy"].problems.append("no tokenizer.model: FastDeploy's ERNIE tokenizer reads SentencePiece")
    else:
        _problem(reports, "no tokenizer.model or tokenizer.json: the tokenizer is this package's own (a word list or "
                          "bytes), which no engine reads; train with a SentencePiece tokenizer (data.tokenizer_path)")
    if not tokenizer_config.get("chat_template") and not (folder / "chat_template.jinja").is_file():
        _problem(reports, "no chat template (tokenizer_config.json's chat_template or chat_template.jinja): chat "
                          "requests cannot be rendered")
    if not (folder / "generation_config.json").is_file():
        for engine in ENGINES:
            reports[engine].notes.append("no generation_config.json: stop ids from config.json alone")
    if not vl:
        return
    processor = json_object(folder / "preprocessor_config.json")
    if not processor:
        _problem(reports, "no preprocessor_config.json: images cannot be encoded")
        return
    if _lacks_remote_class(folder, processor.get("auto_map"), "AutoProcessor"):
        _problem(reports, "preprocessor_config.json has no auto_map.AutoProcessor whose file the folder holds: "
                          f"AutoProcessor cannot build {processor.get('processor_class')!r}", AUTO)
    absent = [k for k in ("min_pixels", "max_pixels") if k not in processor]
    if absent:
        reports["vllm"].problems.append(f"preprocessor_config.json lacks {', '.join(absent)} (vLLM sizes images by "
                                        "the remote processor's pixel budget)")
    named = {name for source in (config, tokenizer_config, processor)
             for name in auto_map_files(source.get("auto_map"))}
    for name in sorted(named):
        if not (folder / name).is_file():
            _problem(reports, f"auto_map names {name}, which the folder lacks", AUTO)



def json_object(path: Path) -> dict:
    """The JSON object in ``path``; {} for none, or for a file that is not one (the checks name what lacks)."""
    if not path.is_file():
        return {}
    try:
        value = read_json(path)
    except UnreadableJSON:
        return {}
    return value if isinstance(value, dict) else {}


def _check_image_ids(folder: Path, config: dict, tokenizer_config: dict, report: EngineReport) -> None:
    """FastDeploy takes every token id at or above ``im_patch_id`` for an image token: only the placeholder and the
    special tokens may lie there."""
    from ..data.encoding.tokenizer import SentencePieceTokenizer

    placeholder = config.get("im_patch_id")
    if not _is_whole(placeholder):
        return
    try:
        tokenizer = SentencePieceTokenizer(str(folder), placeholder)
    except (ValueError, OSError, RuntimeError) as err:
        report.problems.append(f"cannot read tokenizer.model: {err}")
        return
    if tokenizer.token_id("<|IMAGE_PLACEHOLDER|>") is None:
        report.problems.append("the tokenizer has no <|IMAGE_PLACEHOLDER|> token, which FastDeploy's processor "
                               "writes for each image patch")
    special = set(tokenizer.special.values())
    text = [i for i in range(placeholder, tokenizer.sp.get_piece_size())
            if i not in special and not (tokenizer.sp.is_control(i) or tokenizer.sp.is_unknown(i))]
    if text:
        report.problems.append(f"{len(text)} text tokens have ids at or above im_patch_id {placeholder} (e.g. "
                               f"{text[0]}): FastDeploy takes every such id for an image token and routes it to "
                               "the vision experts")


def summary_lines(reports: list[EngineReport]) -> list[str]:
    """What a run prints at its end: the engines that load the folder as trained, then each problem once, with the
    engines it stops."""
    fine = [r.name for r in reports if not r.problems]
    lines = [f"serving: {', '.join(fine)} load this folder as trained"] if fine else []
    problems: dict[str, list[str]] = {}
    for report in reports:
        for problem in report.problems:
            problems.setdefault(problem, []).append(report.name)
    return lines + [f"serving: {', '.join(names)}: {problem}" for problem, names in problems.items()]
