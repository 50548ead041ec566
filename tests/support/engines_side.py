"""The serving engines' transformers side of the engine tests, run with the engines' pin (transformers 5.19, in
``engines-venv/`` as .ci/run installs it): what vLLM and SGLang call to read a model folder.

    python engines_side.py FOLDER REQUEST OUT  # AutoConfig, AutoTokenizer and AutoProcessor with
                                               # trust_remote_code on FOLDER; REQUEST (JSON): texts to tokenize,
                                               # a prompt and image files for the processor; OUT/engines.json and
                                               # OUT/engines.npz
"""

import json
import sys
from pathlib import Path

import numpy as np
import transformers
from PIL import Image
from transformers import AutoConfig, AutoProcessor, AutoTokenizer

CONFIG_FIELDS = ("model_type", "moe_layer_start_index", "moe_layer_end_index", "moe_num_experts",
                 "moe_intermediate_size", "use_temporal_conv", "im_patch_id", "hidden_act", "image_start_token_id",
                 "image_end_token_id", "video_start_token_id", "video_end_token_id", "spatial_conv_size",
                 "temporal_conv_size")


def main(folder, request, out):
    request = json.loads(Path(request).read_text())
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    processor = AutoProcessor.from_pretrained(folder, trust_remote_code=True)
    vision = config.vision_config
    images = [Image.open(path) for path in request["images"]]
    processed = processor(text=[request["prompt"]], images=images, return_tensors="np")
    image_processor = processor.image_processor
    result = {
        "transformers": transformers.__version__,
        "config": {"class": f"{type(config).__module__}.{type(config).__name__}",
                   **{key: getattr(config, key, "absent") for key in CONFIG_FIELDS},
                   "vision": {key: getattr(vision, key, "absent") for key in (
                       "in_channels", "in_chans", "hidden_size", "embed_dim", "patch_size", "spatial_merge_size")}},
        "tokenizer": {"class": f"{type(tokenizer).__module__}.{type(tokenizer).__name__}",
                      "ids": [tokenizer(text, add_special_tokens=False)["input_ids"] for text in request["texts"]],
                      "eos_token_id": tokenizer.eos_token_id},
        "processor": {"class": f"{type(processor).__module__}.{type(processor).__name__}",
                      "size": image_processor.size, "spatial_conv_size": processor.spatial_conv_size,
                      "temporal_conv_size": processor.temporal_conv_size},
    }
    Path(out, "engines.json").write_text(json.dumps(result, indent=2))
    # the patches as the engines normalise them (rescale, then the mean and std of each channel's pixels)
    patch = vision.patch_size ** 2
    mean = np.repeat(np.asarray(image_processor.image_mean, np.float64), patch)
    std = np.repeat(np.asarray(image_processor.image_std, np.float64), patch)
    normalised = (processed["images"] * image_processor.rescale_factor - mean) / std
    np.savez(Path(out, "engines.npz"), input_ids=processed["input_ids"], patches=normalised,
             grid_thw=processed["grid_thw"])


if __name__ == "__main__":
    main(*sys.argv[1:])
