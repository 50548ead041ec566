"""Generation: key/value-cached logits against the plain forward, decoding, the command line and its errors."""

import json
import subprocess
import sys
from collections import Counter

import numpy as np
import paddle
import pytest
from PIL import Image
from support.models import side_by_side_prompts
from support.runs import ROOT

from ernie_moe.checkpoint import save_model
from ernie_moe.config import DataConfig, load_config
from ernie_moe.data import build_tokenizer
from ernie_moe.data.formats.sample import Chunk, Sample
from ernie_moe.data.formats.synthetic import SyntheticShapes
from ernie_moe.generation import KVCache, forward_cached, generate
from ernie_moe.generation.decoding import _extended, choose, prompt_inputs, token_inputs
from ernie_moe.generation.prompts import prompt_encoder
from ernie_moe.model.ernie_vl import ErnieMoEForConditionalGeneration
from ernie_moe.nn.flashmask import RowBounds

SMALL = ["data.image_size=56"]
KINDS = {"dense": ["model.moe_num_experts=[]", "model.moe_intermediate_size=[]"],
         "text_moe": ["model.moe_num_experts=[4]", "model.moe_intermediate_size=[64]"],
         "vl": []}


def built(kind, *overrides):
    cfg = load_config(ROOT / "configs" / "vl_moe.yaml", [*SMALL, *KINDS[kind], *overrides])
    paddle.seed(3)
    model = ErnieMoEForConditionalGeneration(cfg.model)
    model.eval()
    return cfg, model


def a_prompt(cfg, with_image: bool):
    sample = SyntheticShapes(0, "eval", 1, cfg.data.image_size)[0]
    chunks = [Chunk(image=0)] if with_image else []
    sample = Sample(sample.images if with_image else [], chunks + sample.chunks[1:3])
    tokenizer = build_tokenizer(cfg)
    return prompt_encoder(tokenizer, cfg.model, cfg.data).prompt(sample), tokenizer


@pytest.mark.parametrize("kind", list(KINDS))
def test_cached_logits_equal_the_whole_sequence_forward(kind):
    """Prefill, then one token at a time: every step's logits equal those of the whole sequence run at once."""
    cfg, model = built(kind)
    prompt, _ = a_prompt(cfg, with_image=kind == "vl")
    new = [7, 9, 11, 5, 8]
    whole = forward_cached(model, prompt_inputs(prompt, 588), KVCache(cfg.model.num_hidden_layers))
    full = forward_cached(model, prompt_inputs(_extended(prompt, new), 588), KVCache(cfg.model.num_hidden_layers))
    np.testing.assert_allclose(whole.numpy(), full.numpy()[:, : len(prompt)], atol=1e-5, rtol=1e-5)
    cache = KVCache(cfg.model.num_hidden_layers)
    forward_cached(model, prompt_inputs(prompt, 588), cache)
    position = int(prompt.position_ids.max()) + 1
    for i, token in enumerate(new):
        step = forward_cached(model, token_inputs(token, position + i, 588), cache)
        np.testing.assert_allclose(step.numpy()[0, -1], full.numpy()[0, len(prompt) + i], atol=1e-5, rtol=1e-5)
    # and the model's own training forward gives the same logits
    ids = paddle.to_tensor(_extended(prompt, new).input_ids[None])
    from ernie_moe.batch import Batch

    batch = Batch(ids, paddle.full_like(ids, -100), paddle.to_tensor(_extended(prompt, new).token_type_ids[None]),
                  paddle.to_tensor(_extended(prompt, new).position_ids[None]), paddle.full_like(ids, ids.shape[1]),
                  prompt_inputs(prompt, 588)[4], prompt_inputs(prompt, 588)[5].numpy())
    np.testing.assert_allclose(model(batch, return_logits=True).logits.numpy(), full.numpy(), atol=1e-5, rtol=1e-5)


def test_a_step_whose_tokens_see_every_key_is_attended_without_a_mask():
    """One new token per row, no padding before any prompt and no hidden slot (most decoding steps): it sees every
    cached key, so no mask is made (the logits above are those of the masked whole-sequence forward). Padding, a
    hidden draft or several new tokens keep the mask."""
    cache = KVCache(2)
    cache.length = 5
    assert cache.bounds(1, 1) is None and KVCache(2, np.zeros(3, np.int64)).bounds(3, 1, 5) is None
    assert cache.bounds(1, 2).ends.numpy().tolist() == [[7] * 7]  # causal among the new: first_row keeps it
    padded = KVCache(2, np.array([0, 2]))
    padded.length = 5
    assert padded.bounds(2, 1).ends.numpy().tolist() == [[6] * 6, [0, 1, 6, 6, 6, 6]]
    cache.hide(1, 0, 3)
    assert cache.bounds(1, 1).ends.numpy().tolist() == [[6, 6, 6, 3, 6, 6]]
    # the mask the host makes for these steps is the one the device would make of the same bounds
    padded.hide(2, 1, 4)
    for bounds, queries in ((padded.bounds(2, 3), 3), (padded.bounds(2, 1), 1), (cache.bounds(1, 2), 2)):
        device = RowBounds(bounds.ends, first_row=bounds.first_row)
        np.testing.assert_array_equal(bounds.dense_bias(queries, 4).numpy(), device.dense_bias(queries, 4).numpy())
        assert (bounds.dense_bias(queries, 4).numpy() == 0).any() and (bounds.dense_bias(queries, 4).numpy() < 0).any()


def test_greedy_decoding_with_and_without_the_cache_agree():
    cfg, model = built("vl")
    prompt, tokenizer = a_prompt(cfg, with_image=True)
    image = (cfg.model.im_patch_id,)
    cached = generate(model, prompt, 12, eos_id=-1, never=image)
    plain = generate(model, prompt, 12, eos_id=-1, use_cache=False, never=image)
    assert cached.ids == plain.ids and cached.stop == "length" and len(cached.ids) == 12
    assert image[0] not in cached.ids
    sampled = [generate(model, prompt, 12, eos_id=-1, temperature=1.0, seed=s, never=image).ids for s in (1, 1, 2)]
    assert sampled[0] == sampled[1] and sampled[0] != sampled[2]


@pytest.mark.parametrize("kind", ["text_moe", "vl"])
def test_prompts_decoded_side_by_side_get_the_answers_each_gets_alone(kind):
    """Prompts of different lengths (padded on the left, padding seen by no row) with images: the first logits of
    each row equal its own forward's; greedy answers token for token, with rows stopping at different steps (an
    end-of-sentence token one row meets early, and each row's own length limit), sampled answers with each row's seed,
    and the uncached reference,
    all equal to each prompt decoded alone."""
    from ernie_moe.generation.decoding import Decoding, batch_inputs, generate_batch

    cfg, model = built(kind)
    prompts = side_by_side_prompts(cfg)
    if kind == "text_moe":
        prompts = [p for p in prompts if not p.patches]
    assert len({len(p) for p in prompts}) == len(prompts)
    layers = cfg.model.num_hidden_layers
    inputs, padding = batch_inputs(prompts, 588)
    together = forward_cached(model, inputs, KVCache(layers, padding)).numpy()
    for row, prompt in enumerate(prompts):
        alone = forward_cached(model, prompt_inputs(prompt, 588), KVCache(layers)).numpy()[0]
        np.testing.assert_allclose(together[row, padding[row]:], alone, atol=1e-5, rtol=1e-5)
    never = (cfg.model.im_patch_id,)
    alone = [generate(model, p, 10, eos_id=-1, never=never) for p in prompts]
    eos = alone[1].ids[3]  # a token one answer meets early: that row stops there, the others go on
    for temperature in (0.0, 1.0):
        decodings = [Decoding(10 - row, temperature, seed=5 + row) for row in range(len(prompts))]
        expected = [generate(model, p, d.max_new_tokens, eos_id=eos, temperature=temperature, seed=d.seed,
                             never=never) for p, d in zip(prompts, decodings)]
        for use_cache in (True, False):
            got = generate_batch(model, prompts, decodings, eos_id=eos, use_cache=use_cache, never=never)
            assert got == expected, (temperature, use_cache)
    assert {out.stop for out in expected} >= {"eos", "length"}


def test_sampling_keeps_to_the_nucleus():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    rng = np.random.default_rng(0)
    drawn = Counter(choose(logits, 1.0, 0.7, rng) for _ in range(2000))
    assert set(drawn) == {0, 1} and 0.55 < drawn[0] / 2000 < 0.7  # 0.5 / 0.8 of the draws
    assert choose(logits, 0.0, 1.0, rng) == 0


def test_a_messages_file_names_its_images_as_training_records_do(tmp_path):
    from argparse import Namespace

    from ernie_moe.data.formats.sample import BadSample
    from ernie_moe.generate import keyed_prompts

    Image.fromarray(np.zeros((28, 28, 3), np.uint8)).save(tmp_path / "a.png")
    chat = tmp_path / "chat.jsonl"
    turn = [{"role": "user", "content": "<image> what?"}]
    chat.write_text(json.dumps({"images": "a.png", "messages": turn}) + "\n")  # one path, not a list
    ((_, sample),) = keyed_prompts(Namespace(messages=str(chat), image=[], prompt=None), DataConfig())
    assert len(sample.images) == 1 and sample.images[0].shape == (28, 28, 3)
    chat.write_text(json.dumps({"images": 7, "messages": turn}) + "\n")
    with pytest.raises(BadSample, match="chat.jsonl line 1: images must be a path or a list of paths, not 7"):
        keyed_prompts(Namespace(messages=str(chat), image=[], prompt=None), DataConfig())


def run(*args):
    return subprocess.run([sys.executable, "-m", "ernie_moe.generate", *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("model")
    cfg, model = built("vl")
    save_model(model, cfg.model, str(out), build_tokenizer(cfg), hf_layout=True)
    return out, cfg


@pytest.mark.slow
def test_the_command_line_captions_an_image_and_reports_bad_input(model_dir, tmp_path):
    out, cfg = model_dir
    from ernie_moe.data.held_out import write_held_out

    write_held_out(tmp_path, 0, cfg.data.image_size, 1)
    done = run("--model", out, "--image", tmp_path / "00000.png", "--max-new-tokens", 6)
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.split()) == 6  # an untrained model: six words, none of them the end
    # the same model in a checkpoint's (Paddle) layout says the same
    _, model = built("vl")
    save_model(model, cfg.model, str(tmp_path / "paddle_layout"), build_tokenizer(cfg))
    again = run("--model", tmp_path / "paddle_layout", "--image", tmp_path / "00000.png", "--max-new-tokens", 6)
    assert again.returncode == 0 and again.stdout == done.stdout, again.stderr
    conversation = tmp_path / "chat.jsonl"
    turn = [{"role": "user", "content": "<image>"}]
    conversation.write_text(json.dumps({"images": ["00000.png"], "messages": turn}) + "\n\n"
                            + json.dumps({"id": "second", "images": ["00000.png"], "messages": turn}) + "\n")
    done = run("--model", out, "--messages", conversation, "--max-new-tokens", 3)
    assert done.returncode == 0, done.stderr
    answers = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(a.get("id"), a["line"], a["tokens"]) for a in answers] == [(None, 1, 3), ("second", 3, 3)]
    (tmp_path / "other").mkdir()
    other = load_config(ROOT / "configs" / "vl_moe.yaml", ["model.hidden_size=32"]).model
    (tmp_path / "other" / "config.json").write_text((out / "config.json").read_text().replace(
        '"hidden_size": 64', f'"hidden_size": {other.hidden_size}'))
    for name in out.iterdir():
        if name.name != "config.json":
            (tmp_path / "other" / name.name).write_bytes(name.read_bytes())
    bad = {"missing image": (["--image", tmp_path / "nope.png"], "nope.png' does not exist"),
           "empty prompt": (["--prompt", " "], "--prompt is empty"),
           "no new tokens": (["--image", tmp_path / "00000.png", "--max-new-tokens", 0], "at least 1"),
           "incompatible folder": (["--image", tmp_path / "00000.png"],
                                   "config.json describes an embedding of [32, 32] (vocab_size, hidden_size); its "
                                   "tensor model.embed_tokens.weight is [32, 64]"),
           "too long": (["--prompt", "a " * 5000], "positions")}
    for what, (args, message) in bad.items():
        model = tmp_path / "other" if what == "incompatible folder" else out
        done = run("--model", model, *args)
        assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, (what, done.stderr)


def test_ids_past_the_tokenizers_vocabulary_are_never_generated(monkeypatch):
    """The default model's vocabulary is larger than its tokenizer's word list: an id the tokenizer cannot
    decode is never chosen, greedy or sampled, even where the model favours it above all others."""
    from ernie_moe.generation import decoding

    cfg, model = built("vl")
    prompt, tokenizer = a_prompt(cfg, with_image=True)
    favoured = cfg.model.vocab_size - 1
    assert tokenizer.vocab_size <= favoured
    real = decoding.forward_cached

    def favouring(*args):
        logits = real(*args)
        bias = np.zeros(logits.shape[-1], np.float32)
        bias[favoured] = 1e4
        return logits + paddle.to_tensor(bias)

    monkeypatch.setattr(decoding, "forward_cached", favouring)
    assert generate(model, prompt, 4, tokenizer.eos_id).ids[0] == favoured  # the model does favour it
    for temperature in (0.0, 1.0):
        out = generate(model, prompt, 4, tokenizer.eos_id, temperature, tokens=tokenizer.vocab_size)
        assert out.ids and all(i < tokenizer.vocab_size for i in out.ids)
        tokenizer.decode(out.ids)
