"""A model's answers to a benchmark's items: each item as a one-turn conversation encoded as the model's training
encoded its data, answered greedily, several side by side; each data rank answers its share and the item scores
are summed over the data ranks."""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import paddle

from ..data.encoding.tokenizer import Tokenizer
from ..data.formats.jsonl import decode_image, load_image, parse_messages
from ..data.formats.sample import BadSample, Sample
from ..generation import ContextTooLong, Decoding, check_room, generate_batch, prompt_encoder
from ..parallel.pipeline import TrainedModel
from .formats import Benchmark
from .scoring import figures, judge, unit_of, user_content


@dataclass
class Answered:
    """A benchmark's figures, each answered item's record and the items skipped by reason."""

    figures: dict
    items: list[dict] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)


def item_sample(bench: Benchmark, index: int, max_pixels: int) -> Sample:
    """Item ``index`` of ``bench`` as a user turn with its images decoded; BadSample when an image cannot be."""
    item = bench.items[index]
    images = [decode_image(io.BytesIO(image), f"{bench.path.name} item {item.id} image {n}", max_pixels)
              if isinstance(image, bytes) else load_image(image, max_pixels)
              for n, image in enumerate(item.images, start=1)]
    conversation, _, _ = parse_messages([{"role": "user", "content": user_content(bench.kind, item)}],
                                        ["image"] * len(images), [])
    return Sample(images, conversation=conversation)


@paddle.no_grad()
def answer_benchmark(model: TrainedModel, tokenizer: Tokenizer, data_cfg, bench: Benchmark, max_new_tokens: int,
                     side_by_side: int = 8,
                     data_rank: int = 0, data_world: int = 1, sum_over_ranks: Callable | None = None,
                     on_answers: Callable[[int], None] | None = None, sees_images: bool = True) -> Answered:
    """Greedy answers of ``model`` to this data rank's share of ``bench`` (items ``data_rank::data_world``),
    judged as the benchmark's harness judges them. ``sum_over_ranks(array) -> array`` sums over the data ranks
    (None: one process); every rank gets the whole benchmark's figures, and its own items' records."""
    was_training = model.training
    model.eval()
    encoder = prompt_encoder(tokenizer, model.cfg, data_cfg)
    never = (model.cfg.im_patch_id,)
    count = len(bench.items)
    scores, answered = np.zeros(count), np.zeros(count)
    records: list[dict] = []
    skipped: Counter = Counter()
    group: list[tuple[int, object]] = []

    def flush():
        outs = generate_batch(model, [prompt for _, prompt in group], [Decoding(max_new_tokens)] * len(group),
                              tokenizer.eos_id, never=never, tokens=tokenizer.vocab_size)
        for (index, _), out in zip(group, outs):
            item = bench.items[index]
            reply = tokenizer.decode(out.ids)
            extracted, score = judge(bench.kind, item, reply)
            scores[index], answered[index] = score, 1.0
            records.append({"id": item.id, "unit": unit_of(bench.kind, item), "category": item.category,
                            "l2_category": item.l2_category, "reply": reply, "extracted": extracted,
                            "gold": list(item.answers), "score": score})
        if on_answers is not None:
            on_answers(len(group))
        group.clear()

    for index in range(data_rank, count, data_world):
        try:
            if bench.items[index].images and not sees_images:
                raise BadSample("needs_vision", "the model holds no vision encoder")
            prompt = encoder.prompt(item_sample(bench, index, data_cfg.max_image_pixels))
            check_room(prompt, model.cfg.max_position_embeddings)
        except ContextTooLong:
            skipped["too_long"] += 1
            continue
        except BadSample as bad:
            skipped[bad.reason if bad.reason in SKIP_REASONS else "other"] += 1
            continue
        group.append((index, prompt))
        if len(group) == side_by_side:
            flush()
    if group:
        flush()
    if was_training:
        model.train()
    skips = np.array([skipped[reason] for reason in SKIP_REASONS], dtype=np.float64)
    totals = np.concatenate([scores, answered, skips])
    if sum_over_ranks is not None:
        totals = sum_over_ranks(totals)
    scores, answered, skips = totals[:count], totals[count: 2 * count], totals[2 * count:]
    scored = {int(i): float(scores[i]) for i in np.flatnonzero(answered)}
    return Answered(figures(bench.kind, bench.items, scored), records,
                    Counter({reason: int(n) for reason, n in zip(SKIP_REASONS, skips) if n}))


# what an item is skipped for: its image (missing, undecodable, over data.max_image_pixels), a prompt the model has
# no positions left after, images for a text model, and anything else the encoder refuses
SKIP_REASONS = ("missing_image", "corrupt_image", "image_too_large", "too_long", "needs_vision", "other")
