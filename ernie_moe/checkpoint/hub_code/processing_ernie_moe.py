"""The image processor and processor of an ERNIE-4.5-VL model folder written by ernie_moe, for transformers'
``AutoProcessor`` / ``AutoImageProcessor`` with ``trust_remote_code`` (vLLM and SGLang call them). Images are
resized by ERNIE's pixel budget into whole merge blocks and cut into channel-major patches in merge-block order,
as the training encoded them; the pixels stay 0-255 (the engines rescale and normalise them with
``rescale_factor``, ``image_mean`` and ``image_std``). Each ``<|image@placeholder|>`` of the text becomes one
``<|IMAGE_PLACEHOLDER|>`` per merged patch, a video's per pair of merged frames."""

import math

import numpy as np
from PIL import Image
from transformers.feature_extraction_utils import BatchFeature
from transformers.image_processing_utils import BaseImageProcessor
from transformers.processing_utils import ProcessorMixin

MAX_ASPECT = 200


def budget_size(height, width, unit, min_pixels, max_pixels):
    """ERNIE-4.5-VL's resize: sides the nearest multiples of ``unit``, scaled into the pixel budget (transformers runs
    this file without ernie_moe, so the rule is written here again; the tests hold it to the training's)."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        if height > width:
            width = max(unit, round(width / unit) * unit)
            height = math.floor(width * MAX_ASPECT / unit) * unit
        else:
            height = max(unit, round(height / unit) * unit)
            width = math.floor(height * MAX_ASPECT / unit) * unit
    h, w = max(unit, round(height / unit) * unit), max(unit, round(width / unit) * unit)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = math.floor(height / beta / unit) * unit, math.floor(width / beta / unit) * unit
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / unit) * unit, math.ceil(width * beta / unit) * unit
    return h, w


def _rgb(image):
    if isinstance(image, Image.Image):
        return np.asarray(image.convert("RGB"))
    array = np.asarray(image)
    if array.ndim == 3 and array.shape[0] in (1, 3) and array.shape[-1] not in (1, 3):
        array = array.transpose(1, 2, 0)  # channels first
    if array.dtype != np.uint8:
        array = np.clip(array * 255 if array.max() <= 1 else array, 0, 255).astype(np.uint8)
    return array if array.shape[-1] == 3 else np.repeat(array[..., :1], 3, axis=-1)


class Ernie4_5_VLImageProcessor(BaseImageProcessor):
    model_input_names = ["images", "grid_thw"]

    def __init__(self, min_pixels=56 * 56, max_pixels=28 * 28 * 1280, patch_size=14, merge_size=2,
                 temporal_conv_size=2, image_mean=(0.48145466, 0.4578275, 0.40821073),
                 image_std=(0.26862954, 0.26130258, 0.27577711), rescale_factor=1 / 255, video_min_pixels=None,
                 video_max_pixels=None, **kwargs):
        kwargs.pop("size", None)
        super().__init__(**kwargs)
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        self.video_min_pixels = video_min_pixels or min_pixels
        self.video_max_pixels = video_max_pixels or max_pixels
        self.size = {"min_pixels": min_pixels, "max_pixels": max_pixels, "shortest_edge": min_pixels,
                     "longest_edge": max_pixels}
        self.patch_size, self.merge_size, self.temporal_conv_size = patch_size, merge_size, temporal_conv_size
        self.image_mean, self.image_std, self.rescale_factor = list(image_mean), list(image_std), rescale_factor

    def _patches(self, frames, low, high):
        unit = self.patch_size * self.merge_size
        height, width = frames[0].shape[:2]
        h, w = budget_size(height, width, unit, low, high)
        out = []
        for frame in frames:
            if frame.shape[:2] != (h, w):
                frame = np.asarray(Image.fromarray(frame).resize((w, h), Image.Resampling.BICUBIC))
            p, m = self.patch_size, self.merge_size
            gh, gw = h // p, w // p
            x = frame.astype(np.float32).transpose(2, 0, 1).reshape(3, gh // m, m, p, gw // m, m, p)
            out.append(x.transpose(1, 4, 2, 5, 0, 3, 6).reshape(gh * gw, 3 * p * p))
        return np.concatenate(out), [len(frames), h // self.patch_size, w // self.patch_size]

    def preprocess(self, images=None, videos=None, return_tensors=None, **kwargs):
        patches, grids = [], []
        for image in images or []:
            data, grid = self._patches([_rgb(image)], self.min_pixels, self.max_pixels)
            patches.append(data)
            grids.append(grid)
        for video in videos or []:
            frames = [_rgb(frame) for frame in video]
            frames += frames[-1:] * (-len(frames) % self.temporal_conv_size)
            data, grid = self._patches(frames, self.video_min_pixels, self.video_max_pixels)
            patches.append(data)
            grids.append(grid)
        data = {"images": np.concatenate(patches) if patches else np.zeros([0, 3 * self.patch_size ** 2], np.float32),
                "grid_thw": np.array(grids, np.int64).reshape(-1, 3)}
        return BatchFeature(data, tensor_type=return_tensors)


class Ernie4_5_VLProcessor(ProcessorMixin):
    attributes = ["image_processor", "tokenizer"]
    image_processor_class = "AutoImageProcessor"
    tokenizer_class = "AutoTokenizer"
    IMAGE_SLOT, VIDEO_SLOT, PLACEHOLDER = "<|image@placeholder|>", "<|video@placeholder|>", "<|IMAGE_PLACEHOLDER|>"

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, chat_template=chat_template)
        self.spatial_conv_size = image_processor.merge_size
        self.temporal_conv_size = image_processor.temporal_conv_size

    def __call__(self, text=None, images=None, videos=None, return_tensors=None, **kwargs):
        texts = [text] if isinstance(text, str) else list(text or [])
        images = [images] if images is not None and not isinstance(images, (list, tuple)) else images
        visual = self.image_processor.preprocess(images=images, videos=videos)
        tokens = [int(np.prod(g)) // self.spatial_conv_size ** 2 for g in visual["grid_thw"]]
        count = len(images or [])
        image_tokens, video_tokens = iter(tokens[:count]), iter(tokens[count:])
        expanded = []
        for piece in texts:
            out = []
            for part in piece.split(self.IMAGE_SLOT):
                out.append(self._videos(part, video_tokens))
            expanded.append("".join(self.PLACEHOLDER * next(image_tokens) + p if i else p for i, p in enumerate(out)))
        data = dict(self.tokenizer(expanded, add_special_tokens=False, **kwargs)) if texts else {}
        data.update(visual)
        data["image_type_ids"] = np.array([0] * count + [1] * (len(tokens) - count), np.int64)
        return BatchFeature(data, tensor_type=return_tensors)

    def _videos(self, text, video_tokens):
        parts = text.split(self.VIDEO_SLOT)
        return "".join(self.PLACEHOLDER * (next(video_tokens) // self.temporal_conv_size) + p if i else p
                       for i, p in enumerate(parts))

    @property
    def model_input_names(self):
        return ["input_ids", "attention_mask", "images", "grid_thw", "image_type_ids"]
