"""ERNIE-4.5-VL's inputs as the interop tests make them (a SentencePiece tokenizer with its special tokens,
pictures, conversations), our model's outputs on them, and the other libraries' sides run in their own processes."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import paddle
from PIL import Image

from ernie_moe.batch import Batch
from ernie_moe.config import load_config
from ernie_moe.data.encoding.images import MEAN, STD
from ernie_moe.data.feeding.loader import build_tokenizer
from ernie_moe.data.formats.chat import ERNIE_VL_TEMPLATE
from ernie_moe.model.blocks import block_inputs

# the other libraries' sides of the interop tests, each run in its own process
PF_SIDE = Path(__file__).with_name("paddleformers_side.py")
HF_SIDE = Path(__file__).with_name("transformers_side.py")


def other_side(script: Path, *args, cwd, timeout: int = 300) -> None:
    """Run another library's side of an interop test (``script`` with ``args``) in its own process."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(script), *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]


def paddleformers(*args, cwd):
    """Run PaddleFormers' side in its own process."""
    other_side(PF_SIDE, *args, cwd=cwd)


# ERNIE-4.5-VL's special tokens (the slot strings the processor expands are not tokens), and a video placeholder
# for transformers, which marks video tokens with an id of their own
SPECIALS = ["<|begin_of_sentence|>", "<|end_of_sentence|>", "<|IMAGE_START|>", "<|IMAGE_END|>", "<|VIDEO_START|>",
            "<|VIDEO_END|>", "<|IMAGE_PLACEHOLDER|>", "<|VIDEO_PLACEHOLDER|>"]


WORDS = ("a the cat dog red green blue square round grid what is this describe compare them colour shape and "
         "hello there small animal moves left same object yes tiny both first then ok picture video user "
         "assistant you are brief").split()


BUDGET = {"image_min_pixels": 4 * 28 * 28, "image_max_pixels": 128 * 28 * 28,
          "video_min_pixels": 4 * 28 * 28, "video_max_pixels": 16 * 28 * 28}


def _sentencepiece_model(vocab_size: int, specials: list[str]) -> bytes:
    """A small BPE SentencePiece model of the test words, ``specials`` its user-defined pieces (the lowest ids)."""
    import sentencepiece

    rng = np.random.default_rng(0)
    corpus = [" ".join(rng.choice(WORDS, 12)) + " Picture 1: Video 2: User: Assistant: ?!., \n" for _ in range(300)]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=model, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=False, unk_id=0, bos_id=1, eos_id=2, pad_id=3,
        minloglevel=2, **({"user_defined_symbols": specials} if specials else {}))
    return model.getvalue()


def make_ernie_tokenizer(folder, chat_template: str | None = ERNIE_VL_TEMPLATE):
    """A small SentencePiece model carrying ERNIE-4.5-VL's special tokens, with its chat template."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.model").write_bytes(_sentencepiece_model(400, SPECIALS))
    config = {"tokenizer_class": "Ernie4_5_VLTokenizer", "additional_special_tokens": SPECIALS}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


# ERNIE's vocabulary order: the text pieces, then the sentence markers, the image placeholder, the image and video
# markers (every id from the placeholder up is an image-side token, as FastDeploy reads them)
SERVED_PIECES = 300
SERVED_SPECIALS = [*SPECIALS[:2], "<|IMAGE_PLACEHOLDER|>", *SPECIALS[2:6], "<|VIDEO_PLACEHOLDER|>"]
SERVED_VOCAB = SERVED_PIECES + len(SERVED_SPECIALS)
SERVED_PLACEHOLDER = SERVED_PIECES + SERVED_SPECIALS.index("<|IMAGE_PLACEHOLDER|>")


def make_served_tokenizer(folder):
    """A SentencePiece tokenizer laid out as ERNIE-4.5-VL's: its special tokens after the text pieces, as added
    tokens (``added_tokens_decoder``), with ERNIE-4.5-VL's chat template."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.model").write_bytes(_sentencepiece_model(SERVED_PIECES, []))
    decoder = {str(SERVED_PIECES + i): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                        "normalized": False, "single_word": False}
               for i, t in enumerate(SERVED_SPECIALS)}
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Ernie4_5_VLTokenizer", "additional_special_tokens": SERVED_SPECIALS,
        "added_tokens_decoder": decoder, "chat_template": ERNIE_VL_TEMPLATE}))
    return folder


def picture(folder, name, height, width, seed):
    """A smooth random colour image, saved as PNG (lossless): what both sides read."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (max(height // 8, 2), max(width // 8, 2), 3), dtype=np.uint8)
    Image.fromarray(small).resize((width, height), Image.BILINEAR).save(folder / name)
    return name


def text(t):
    return {"type": "text", "text": t}


def conversations(folder):
    """(messages with their image and video files as parts, images, videos): the issue's cases and more."""
    img = {name: picture(folder, f"{name}.png", h, w, i) for i, (name, h, w) in enumerate([
        ("small", 70, 100), ("tall", 330, 60), ("wide", 60, 330), ("large", 600, 500), ("tiny", 20, 20),
        ("other", 112, 84)])}
    clip = [picture(folder, f"clip{i}.png", 90, 120, 10 + i) for i in range(4)]
    walk = [picture(folder, f"walk{i}.png", 64, 64, 20 + i) for i in range(6)]

    def image(name):
        return {"type": "image", "image": img[name]}

    def video(frames):
        return {"type": "video", "video": frames}

    return [
        [{"role": "user", "content": "Hello there, what is a cat?"},
         {"role": "assistant", "content": "A small animal."}],
        [{"role": "user", "content": [image("small"), text("What is this?")]},
         {"role": "assistant", "content": "A red square."}],
        [{"role": "user", "content": [image("tall"), image("wide"), image("large"), text("Compare them.")]},
         {"role": "assistant", "content": "Tall, wide and large."}],
        [{"role": "user", "content": [image("small"), text("What colour?")]},
         {"role": "assistant", "content": "Green."},
         {"role": "user", "content": "And the shape?"},
         {"role": "assistant", "content": "Round."}],
        [{"role": "system", "content": "You are brief."},
         {"role": "user", "content": [image("other"), text("Describe.")]},
         {"role": "assistant", "content": "A grid."}],
        [{"role": "user", "content": [video(clip), text("What happens?")]},
         {"role": "assistant", "content": "It moves left."}],
        [{"role": "user", "content": [image("small"), video(walk), text("Same object?")]},
         {"role": "assistant", "content": "Yes."}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
         {"role": "user", "content": [image("wide"), text("And this?")]},
         {"role": "assistant", "content": "A dog."}],
        [{"role": "user", "content": [image("other"), text("Wie heißt das? café")]},
         {"role": "assistant", "content": "Ein Café – naïve."}],
        [{"role": "user", "content": [text("First "), image("small"), text(" then "), image("tall"), text(" ok?")]},
         {"role": "assistant", "content": "Both blue."}],
        [{"role": "system", "content": "Two clips."},
         {"role": "user", "content": [video(clip), video(walk), text("Which is longer?")]},
         {"role": "assistant", "content": "The second."}],
        [{"role": "user", "content": [image("tiny"), text("  Tiny?\n\nReally  ")]},
         {"role": "assistant", "content": " Yes, tiny.\n"}],
    ]


def shown(messages):
    """The messages as a chat template receives them: text-only contents as strings, media as bare parts."""
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = [{"type": p["type"]} if p["type"] != "text" else p for p in content]
        out.append({"role": m["role"], "content": content})
    return out


def media(messages, kind):
    return [p[kind] for m in messages if isinstance(m["content"], list) for p in m["content"] if p["type"] == kind]


def ernie_config(folder, *overrides):
    """A config for the tokenizer in ``folder/tokenizer``, its placeholder id as model.im_patch_id."""
    tokenizer = [f"data.tokenizer_path={folder / 'tokenizer'}"]
    placeholder = build_tokenizer(load_config(None, tokenizer)).placeholder_id()
    return load_config(None, [*tokenizer, "model.vocab_size=400", f"model.im_patch_id={placeholder}", *overrides])


def assert_same_visuals(ours, ref, where: str) -> None:
    """Our grids and patches equal the processor's grids and pixels."""
    if not ours.grids:
        assert ref["grid_thw"].size == 0, where
        return
    np.testing.assert_array_equal(np.stack(ours.grids), ref["grid_thw"], err_msg=where)
    # the processor leaves rescaling and normalisation to the model: apply them to its uint8 pixels
    pixels = ref["images"].astype(np.float32).reshape(-1, 3, 14 * 14) / 255.0
    expected = ((pixels - MEAN[None, :, None]) / STD[None, :, None]).reshape(ref["images"].shape)
    np.testing.assert_allclose(np.concatenate(ours.patches), expected, atol=1e-5, err_msg=where)


# A tiny ERNIE-4.5-VL with the published routing: aux-loss-free (a random correction bias), text and vision
# experts, every layer from the second a MoE layer, the published dispatch (all-gather, unpadded all-to-all)
# with capacity for every token.
VL_MODEL = {"vocab_size": 400, "max_position_embeddings": 4096, "moe_use_aux_free": True, "moe_layer_interval": 1,
            "moe_capacity": [8, 8, 8], "moe_multimodal_dispatch_use_allgather": "v2-alltoall-unpad"}


def vl_logits(model, sample, bfloat16_pixels: bool = True) -> np.ndarray:
    """Our logits on an encoded conversation, its pixels rounded to bfloat16 as PaddleFormers' ViT takes them
    (or as they are)."""
    with paddle.no_grad():
        return model(one_row_batch(sample, bfloat16_pixels), return_logits=True).logits.numpy()


def one_row_batch(sample, bfloat16_pixels: bool = True, labelled: bool = False) -> Batch:
    """An encoded conversation as a batch of one row; ``labelled``: every position's label is the next token (the
    last has none), else no labels."""
    ids = paddle.to_tensor(sample.input_ids[None])
    labels = paddle.full_like(ids, -100)
    if labelled:
        labels = paddle.concat([ids[:, 1:], labels[:, :1]], axis=1)
    patches = np.concatenate(sample.patches) if sample.patches else np.zeros([0, 588], np.float32)
    pixels = paddle.to_tensor(patches)
    if bfloat16_pixels:
        pixels = pixels.astype("bfloat16").astype("float32")
    grids = np.stack(sample.grids) if sample.grids else np.zeros([0, 3], np.int64)
    types, positions = (paddle.to_tensor(a[None]) for a in (sample.token_type_ids, sample.position_ids))
    return Batch(ids, labels, types, positions, paddle.full_like(ids, ids.shape[1]), pixels, grids)


def mtp_logits(model, batch: Batch) -> np.ndarray:
    """The logits of a batch's rows, then each MTP depth's: ``[(1 + depths) x rows, seq, vocab]``."""
    with paddle.no_grad():
        x = block_inputs(batch)
        for block in model.trunk():
            x = block(x)
        return model.head(x[0]).numpy()


def a_font(folder):
    """A TrueType font file: the one Pillow carries inside (ERNIE's Roboto is not installed here)."""
    from PIL import ImageFont

    (folder / "font.ttf").write_bytes(ImageFont.load_default(12).path.getvalue())
    return str(folder / "font.ttf")
