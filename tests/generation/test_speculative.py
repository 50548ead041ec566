"""Speculative decoding with the multi-token prediction layers (``generation.speculative``): greedy answers token for
token those of plain decoding, sampling with the model's own distribution, and drafts a trained model keeps. On
images with video: tests/data/test_ernie_inputs.py; on the server: tests/generation/test_serving.py."""

from collections import Counter

import numpy as np
import paddle
import pytest
from support.models import side_by_side_prompts
from support.runs import ROOT

from ernie_moe.config import load_config
from ernie_moe.data import build_datasets
from ernie_moe.data.encoding.packing import split_answer
from ernie_moe.data.feeding.loader import collate, training_encoder
from ernie_moe.data.formats.sample import Chunk, Sample
from ernie_moe.evaluation.generated import evaluate_by_generation
from ernie_moe.generation import Decoding, KVCache, forward_cached, generate_batch, generate_drafting
from ernie_moe.generation.decoding import _extended, prompt_inputs
from ernie_moe.generation.speculative import distribution, verify
from ernie_moe.model.blocks import block_inputs
from ernie_moe.model.ernie_vl import ErnieMoEForConditionalGeneration
from ernie_moe.model.mtp import split_rows
from ernie_moe.parallel.env import DistEnv
from ernie_moe.training import Trainer
from ernie_moe.training.rollouts import answer_row

MTP = ["data.image_size=56", "model.num_nextn_predict_layers=1"]


def test_a_checked_draft_leaves_the_target_distribution_as_it_is():
    """Whatever the draft's distribution q, the token ``verify`` gives is distributed as p: exactly (its
    probabilities summed over the draws of q) and as drawn (20,000 seeded draws, chi-square)."""
    rng = np.random.default_rng(0)
    for p, q in [(rng.dirichlet(np.ones(6)), rng.dirichlet(np.ones(6))),
                 (np.array([0.5, 0.5, 0, 0, 0, 0]), np.array([0, 0.2, 0.2, 0.2, 0.2, 0.2])),
                 (np.array([0, 0, 1.0, 0, 0, 0]), np.array([0, 0, 1.0, 0, 0, 0]))]:
        kept = np.minimum(p, q)  # q(x) min(1, p(x) / q(x)): the draft x kept
        residual = np.maximum(p - q, 0)
        exact = kept + (1 - kept.sum()) * (residual / residual.sum() if residual.sum() else 0)
        np.testing.assert_allclose(exact, p, atol=1e-12)
        draws = 20000
        tokens = [verify(p, q, int(rng.choice(6, p=q)), rng)[1] for _ in range(draws)]
        counts = np.bincount(tokens, minlength=6)
        assert counts[p == 0].sum() == 0
        seen = p > 0
        chi2 = (((counts[seen] - draws * p[seen]) ** 2) / (draws * p[seen])).sum()
        assert chi2 < 25.0, (p, counts)  # 5 degrees of freedom at most: p < 1e-4


def built(*overrides):
    cfg = load_config(ROOT / "configs" / "vl_moe.yaml", [*MTP, *overrides])
    paddle.seed(3)
    model = ErnieMoEForConditionalGeneration(cfg.model)
    model.eval()
    return cfg, model


@pytest.mark.parametrize("kind", ["text_moe", "vl"])
def test_greedy_speculative_answers_are_plain_greedy_answers(kind):
    """Prompts of different lengths side by side (with images), rows stopping at different steps (an end-of-sentence
    token one meets early, each row's own limit): the answers plain greedy decoding gives, with every draft counted.
    An untrained MTP layer's drafts are mostly rejected: this checks the rejections and the cache they leave."""
    overrides = ["model.moe_num_experts=[4]", "model.moe_intermediate_size=[64]"] if kind == "text_moe" else []
    cfg, model = built(*overrides)
    prompts = side_by_side_prompts(cfg)
    if kind == "text_moe":
        prompts = [p for p in prompts if not p.patches]
    never = (cfg.model.im_patch_id,)
    first = generate_batch(model, prompts, [Decoding(10)] * len(prompts), -1, never=never)
    eos = first[1].ids[3]
    decodings = [Decoding(12 - row) for row in range(len(prompts))]
    plain = generate_batch(model, prompts, decodings, eos, never=never)
    fast = generate_drafting(model, prompts, decodings, eos, never=never, draft_tokens=3)
    assert [(o.ids, o.stop) for o in fast] == [(o.ids, o.stop) for o in plain]
    assert {o.stop for o in plain} >= {"eos", "length"}
    assert all(o.drafted >= len(o.ids) // 2 and 0 <= o.accepted <= o.drafted for o in fast)


def test_speculative_sampling_draws_what_plain_sampling_draws():
    """The second token of 3,000 answers sampled side by side (temperature 1, top-p 0.9, each row its own seed) by
    speculative decoding with an untrained MTP layer (drafts kept and rejected alike): distributed as the model's
    own p(x2) = sum over x1 of p(x1) p(x2 | x1), computed here from its logits (chi-square)."""
    cfg, model = built()
    prompt = side_by_side_prompts(cfg)[1]  # text alone
    layers, t, top_p = cfg.model.num_hidden_layers, 1.0, 0.9
    first = distribution(forward_cached(model, prompt_inputs(prompt, 588), KVCache(layers)).numpy()[0, -1], t, top_p)
    second = np.zeros_like(first)
    for x1 in np.flatnonzero(first):
        logits = forward_cached(model, prompt_inputs(_extended(prompt, [int(x1)]), 588), KVCache(layers))
        second += first[x1] * distribution(logits.numpy()[0, -1], t, top_p)
    rows = 3000
    outs = generate_drafting(model, [prompt] * rows, [Decoding(2, t, top_p, seed) for seed in range(rows)], -1,
                             draft_tokens=3)
    assert all(len(o.ids) == 2 for o in outs)
    kept = sum(o.accepted for o in outs) / sum(o.drafted for o in outs)
    assert 0.05 < kept < 0.95, kept  # both ways through the check
    counts = np.bincount([o.ids[1] for o in outs], minlength=len(second))
    likely = second * rows >= 5  # cells with too few expected draws are pooled
    observed = np.append(counts[likely], counts[~likely].sum())
    expected = np.append(second[likely], second[~likely].sum()) * rows
    chi2 = ((observed - expected) ** 2 / np.maximum(expected, 1e-9)).sum()
    freedom = len(observed) - 1
    assert counts[second == 0].sum() == 0 and chi2 < freedom + 4.5 * np.sqrt(2 * freedom), (chi2, freedom)  # 1e-4


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The default model trained with one MTP depth (300 steps), and captioning prompts (an image each)."""
    out = tmp_path_factory.mktemp("mtp")
    tr = Trainer(load_config(ROOT / "configs" / "vl_moe.yaml", [
        "model.num_nextn_predict_layers=1", "training.max_steps=300", "training.eval_steps=0",
        "data.num_eval_samples=16", "logging.visualdl=false", "logging.progress_bar=false",
        f"training.output_dir={out}"]))
    tr.train()
    tr.parts.model.eval()
    cfg = tr.cfg
    encoder = training_encoder(tr.tokenizer, cfg, Counter())
    _, held_out = build_datasets(cfg)
    prompts = [encoder.prompt(Sample(held_out[i].images, [Chunk(image=0)])) for i in range(16)]
    return tr.parts.model, tr.tokenizer, prompts, tr.cfg


def test_a_trained_mtp_layer_drafts_what_the_model_then_says(trained):
    """After 300 steps the MTP layer's drafts are kept more than 80% of the time, and the greedy answers side by side
    are those plain decoding gives, each counting its drafts."""
    model, tokenizer, prompts, _ = trained
    never = (model.cfg.im_patch_id,)
    decodings = [Decoding(24)] * len(prompts)
    plain = generate_batch(model, prompts, decodings, tokenizer.eos_id, never=never, tokens=tokenizer.vocab_size)
    fast = generate_drafting(model, prompts, decodings, tokenizer.eos_id, never=never, tokens=tokenizer.vocab_size,
                             draft_tokens=3)
    assert [o.ids for o in fast] == [o.ids for o in plain] and all(o.stop == "eos" for o in plain)
    drafted, kept = sum(o.drafted for o in fast), sum(o.accepted for o in fast)
    assert drafted >= sum(len(o.ids) for o in fast) // 2 and kept > 0.8 * drafted, (kept, drafted)


def hand_counted_drafts(model, prompt, answer: list[int], never, vocab: int) -> tuple[int, int]:
    """(drafted, kept) of one greedy answer decoded with one draft a step, counted by hand from one teacher-forced
    forward of the prompt and the answer: the MTP depth at position i drafts the token at i + 2 (from the model's
    hidden state at i and the token at i + 1); a step checks its draft against the answer's token there, and a kept
    draft brings the token after it too."""
    row = answer_row(prompt, answer, len(prompt) + len(answer), 0)
    model.train()  # the depth runs in the training forward (dropless: the same routing as in evaluation)
    try:
        with paddle.no_grad():
            x = block_inputs(collate([row]))
            for block in model.trunk():
                x = block(x)
    finally:
        model.eval()
    _, depth = split_rows(x[0], 1)
    logits = model.head(depth).numpy()[0].astype(np.float64)
    logits[:, list(never)] = -np.inf
    logits[:, vocab:] = -np.inf
    drafts = logits.argmax(axis=-1)
    start, drafted, kept, p = len(prompt), 0, 0, 1  # answer[0] comes from the prompt's last logits
    while p < len(answer):
        ok = drafts[start + p - 2] == answer[p]
        drafted, kept, p = drafted + 1, kept + ok, p + 1
        if ok and p < len(answer):
            p += 1
    return drafted, kept


def test_the_draft_acceptance_an_evaluation_logs_is_the_hand_count(trained):
    """``eval_draft_acceptance`` (held-out answers decoded with one draft a step) against the drafts of the plain
    greedy answers counted by hand."""
    model, tokenizer, _, cfg = trained
    _, held_out = build_datasets(cfg)
    encoder = training_encoder(tokenizer, cfg, Counter())
    never = (cfg.model.im_patch_id,)
    projection = model.model.mtp_linear_proj[0].weight
    trained_weights = projection.numpy()
    # the trained depth drafts nearly everything right: noise on its projection makes it miss some
    noise = np.random.default_rng(0).normal(0.0, 0.5 * trained_weights.std(), trained_weights.shape)
    projection.set_value((trained_weights + noise).astype(trained_weights.dtype))
    try:
        got = evaluate_by_generation(model, held_out, encoder, tokenizer, DistEnv(), 12, 24)
        drafted = kept = 0
        for index in range(12):
            prompt, _, _ = split_answer(encoder(held_out[index]))
            out = generate_batch(model, [prompt], [Decoding(24)], tokenizer.eos_id, never=never,
                                 tokens=tokenizer.vocab_size)[0]
            answer = out.ids + ([tokenizer.eos_id] if out.stop == "eos" else [])
            d, k = hand_counted_drafts(model, prompt, answer, never, tokenizer.vocab_size)
            drafted, kept = drafted + d, kept + k
    finally:
        projection.set_value(trained_weights)
    assert drafted > 12 and 0 < kept < drafted, (kept, drafted)
    assert got["eval_draft_acceptance"] == pytest.approx(kept / drafted, abs=1e-12)
