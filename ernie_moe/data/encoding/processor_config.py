"""A model folder's ``preprocessor_config.json``: how the run that wrote it encoded its inputs, so that every
command reading the folder encodes an image, a video or a conversation into the tokens the training saw.

It holds the keys PaddleFormers' and Hugging Face transformers' ERNIE-4.5-VL image processors read (the pixel
budget, patch and merge sizes, rescaling, mean and std) and, under ``ernie_moe``, the run's data section and seed
(sequence length, the longest-side rule, video sampling, the synthetic data), for which they have no key. A
folder PaddleFormers or transformers wrote gives its pixel budget.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ...config import ConfigError, DataConfig
from ...config.load import build
from ...config.schema import ModelConfig
from ...json_files import read_json_object
from .images import MEAN, STD

FILE = "preprocessor_config.json"
MAX_BYTES = 1 << 20  # a processor config is a few hundred bytes; anything far larger is not one
# data keys that name the run's own files and readers, not how a sample becomes tokens
_NOT_ENCODING = ("dataset", "train_path", "train_probs", "eval_path", "tokenizer_path", "num_workers",
                 "num_train_samples")


def processor_config(data: DataConfig, model_cfg: ModelConfig, seed: int, transformers: bool = False) -> dict:
    """The ``preprocessor_config.json`` of a run with data section ``data``, naming PaddleFormers' processor
    classes or, with ``transformers``, transformers'."""
    vision = model_cfg.vision_config
    out = {**for_library({}, transformers), "do_resize": True, "resample": 3, "do_rescale": True,
           "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": MEAN.tolist(), "image_std": STD.tolist(),
           "do_convert_rgb": True,
           "patch_size": vision.patch_size, "merge_size": vision.spatial_merge_size,
           "temporal_conv_size": model_cfg.temporal_conv_size}
    if data.pixel_budget:  # the longest-side rule has no key in either library (the export refuses it)
        low, high = data.pixel_budget
        out.update(min_pixels=low, max_pixels=high, size={"shortest_edge": low, "longest_edge": high},
                   image_min_pixels=low, image_max_pixels=high, video_min_pixels=data.video_min_pixels,
                   video_max_pixels=data.video_max_pixels)
    encoding = {k: v for k, v in dataclasses.asdict(data).items() if k not in _NOT_ENCODING}
    if data.max_image_side:  # the longest-side rule: no budget (a saved budget beside a side is the budget's)
        encoding.update(image_max_pixels=0, video_max_pixels=0)
    out["ernie_moe"] = {"data": encoding, "seed": seed}
    return out


def processor_file(data: DataConfig, model_cfg: ModelConfig, seed: int, transformers: bool = False) -> dict[str, str]:
    """{file name: text} of the processor settings, for the files a save writes."""
    return {FILE: json.dumps(processor_config(data, model_cfg, seed, transformers), indent=2)}


def for_library(saved: dict, transformers: bool) -> dict:
    """A processor config naming PaddleFormers' processor classes or transformers'."""
    prefix = "Ernie4_5_VLMoe" if transformers else "Ernie4_5_VL"
    return {**saved, "image_processor_type": f"{prefix}ImageProcessor", "processor_class": f"{prefix}Processor"}


def folder_settings(directory) -> dict:
    """The config sections (``data`` and, from this package's folders, ``training.seed``) under which a model
    folder's inputs are encoded as its training encoded them; {} for a folder without the file. ConfigError
    naming the file when it cannot be read or holds values of the wrong kind."""
    path = Path(directory) / FILE
    saved = read_saved(directory)
    if saved is None:
        return {}
    own = saved.get("ernie_moe")
    if own is not None:
        if not isinstance(own, dict) or not isinstance(own.get("data"), dict):
            raise ConfigError(f"{path}: 'ernie_moe' must be an object with the run's 'data' section.")
        settings = {"data": _run_data(own["data"])}
        if own.get("seed") is not None:
            settings["training"] = {"seed": own["seed"]}
    else:
        settings = {"data": _library_budget(saved)}
    try:
        build(DataConfig, settings["data"], "data")
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
    return settings


def longest_side_rule(saved: dict | None) -> int:
    """The longest side a folder's run resized images to (its ``data.max_image_side``), 0 when it used the pixel
    budget that PaddleFormers' and transformers' image processors read (or the folder does not say)."""
    own = (saved or {}).get("ernie_moe")
    data = own.get("data") if isinstance(own, dict) else None
    side = _run_data(data).get("max_image_side") if isinstance(data, dict) else None
    return side if isinstance(side, int) and not isinstance(side, bool) and side > 0 else 0


def _run_data(saved: dict) -> dict:
    """The data section a folder's run kept (under ``ernie_moe``), as a config reads it: its keys this version
    knows (a newer version's do not stop a read), and a longest side kept beside a budget read as the budget's."""
    known = {f.name for f in dataclasses.fields(DataConfig)}
    data = {k: v for k, v in saved.items() if k in known}
    if data.get("image_max_pixels") and data.get("max_image_side"):
        data["max_image_side"] = 0  # such a run resized by the budget
    return data


def read_saved(directory) -> dict | None:
    """A folder's processor config as it is (None without one); ConfigError naming the file when it is far too
    large, unreadable or not a JSON object."""
    path = Path(directory) / FILE
    if not path.is_file():
        return None
    return read_json_object(path, ConfigError, max_bytes=MAX_BYTES)


def _library_budget(saved: dict) -> dict:
    """The pixel budget of a PaddleFormers (``min_pixels`` / ``max_pixels``) or transformers (``size``) processor."""
    given = saved.get("size")
    size: dict = given if isinstance(given, dict) else {}
    low = saved.get("image_min_pixels", saved.get("min_pixels", size.get("shortest_edge")))
    high = saved.get("image_max_pixels", saved.get("max_pixels", size.get("longest_edge")))
    data: dict = {}
    if high is not None:
        data.update(image_max_pixels=high, **({"image_min_pixels": low} if low is not None else {}))
    for key in ("video_min_pixels", "video_max_pixels"):
        if saved.get(key) is not None:
            data[key] = saved[key]
    return data
