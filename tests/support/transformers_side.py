"""Hugging Face transformers' side of the interop tests, run in its own process: torch and paddle never share one.

    python transformers_side.py make DIR CONFIG        # a random tiny ERNIE-4.5-VL, save_pretrained(DIR);
                                                       # CONFIG: JSON of Ernie4_5_VLMoeConfig's arguments
    python transformers_side.py logits DIR OUT CASES...  # AutoModelForImageTextToText.from_pretrained(DIR): what
                                                       # it found missing or unexpected (OUT/loading.json) and its
                                                       # logits on each case (.npz of its inputs) as OUT/<stem>.npy
    python transformers_side.py peft BASE ADAPTER OUT CASES...  # the same with PeftModel.from_pretrained(ADAPTER)
                                                       # over BASE; the LoRA tensors it holds as OUT/peft_state.npz
    python transformers_side.py resave DIR OUT         # from_pretrained(DIR), then save_pretrained(OUT)
    python transformers_side.py grids DIR OUT WxH...   # from_pretrained(DIR)'s loading info, its config's token
                                                       # ids and AutoImageProcessor's grid of an image of each size
                                                       # (OUT/grids.json)
"""

import json
import sys
from pathlib import Path

# PaddleFormers' paddlecodec installs a module named torchcodec without that package's metadata, which
# transformers then fails to read; this process needs no video decoder
sys.modules["torchcodec"] = None

import numpy as np  # noqa: E402
import torch  # noqa: E402


def make(directory, config):
    from transformers import Ernie4_5_VLMoeConfig, Ernie4_5_VLMoeForConditionalGeneration

    torch.manual_seed(1)
    model = Ernie4_5_VLMoeForConditionalGeneration(Ernie4_5_VLMoeConfig(**json.loads(config)))
    with torch.no_grad():
        for name, value in model.named_parameters():
            # a modality's experts, its router and the correction bias each get values of their own, so that
            # which expert a token goes to shows in the outputs
            if name.endswith("e_score_correction_bias"):
                value.uniform_(-0.3, 0.3)
            elif ".experts." in name or name.endswith("gate.weight"):
                value.normal_(0.0, 0.1)
    model.save_pretrained(directory)


def load(directory):
    from transformers import AutoModelForImageTextToText

    model, info = AutoModelForImageTextToText.from_pretrained(directory, output_loading_info=True,
                                                              dtype=torch.float32)
    return model.eval(), {k: sorted(map(str, v)) for k, v in info.items()}


def logits(directory, out, *cases, adapter=None):
    model, info = load(directory)
    if adapter is not None:
        from peft import PeftModel, get_peft_model_state_dict

        model = PeftModel.from_pretrained(model, adapter).eval()
        state = get_peft_model_state_dict(model)
        np.savez(Path(out) / "peft_state.npz", **{k: v.float().numpy() for k, v in state.items()})
    if Path(directory, "preprocessor_config.json").is_file():
        from transformers import AutoImageProcessor

        info["image_processor_size"] = dict(AutoImageProcessor.from_pretrained(directory).size)
    Path(out, "loading.json").write_text(json.dumps(info))
    for case in cases:
        data = dict(np.load(case))
        inputs = {"input_ids": torch.from_numpy(data["input_ids"]),
                  "position_ids": torch.from_numpy(data["position_ids"]),
                  "moe_mm_token_type_ids": torch.from_numpy(data["moe_mm_token_type_ids"])}
        for pixels, grid in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
            if data[grid].size:
                inputs.update({pixels: torch.from_numpy(data[pixels]), grid: torch.from_numpy(data[grid])})
        with torch.no_grad():
            result = model(**inputs, use_cache=False)
        np.save(Path(out) / f"{Path(case).stem}.npy", result.logits.float().numpy())


def resave(directory, out):
    model, _ = load(directory)
    model.save_pretrained(out)


def grids(directory, out, *sizes):
    from PIL import Image
    from transformers import AutoImageProcessor

    model, info = load(directory)
    processor = AutoImageProcessor.from_pretrained(directory)
    found = {}
    for size in sizes:
        width, height = map(int, size.split("x"))
        image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8))
        found[size] = processor(images=[image], return_tensors="pt")["image_grid_thw"][0].tolist()
    text = model.config.text_config
    info.update(grids=found, vocab_size=text.vocab_size, image_token_id=model.config.image_token_id,
                video_token_id=model.config.video_token_id)
    Path(out, "grids.json").write_text(json.dumps(info))


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    {"make": make, "logits": logits, "resave": resave, "grids": grids,
     "peft": lambda base, adapter, out, *cases: logits(base, out, *cases, adapter=adapter)}[command](*args)
