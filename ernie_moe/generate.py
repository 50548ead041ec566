"""Ask a trained model: ``python -m ernie_moe.generate --model DIR [--image IMG ...] [--prompt TEXT]``.

With images and no prompt the model continues from the images (a captioning model captions them); with
``--prompt`` the text goes in as a user turn of the chat format the trainer writes (``User: ... Assistant: ``);
``--messages FILE.jsonl`` takes one conversation per line, in the training JSONL shape, image paths relative to
the file, and prints one JSON line per answer naming its record (``line``, and ``id`` where the record has
one). Images and videos are encoded as the folder's training encoded them (its ``preprocessor_config.json``;
``--config FILE``: a training config whose data section overrides it). Decoding is greedy unless
``--temperature`` is above 0, one forward per new token over a key/value cache, and stops at the end-of-sentence
token. Several prompts (``--messages``) are decoded side by side, ``--batch-size`` at a time (one forward per new
token for all of them; each answer is the one its prompt gets alone). One process.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .checkpoint.errors import CheckpointError
from .cli import add_decoding_arguments, at_least_one, thinking_of
from .config import ConfigError
from .config.schema import DataConfig
from .data.encoding.packing import BadSample
from .data.formats.erniekit import record_thinking
from .data.formats.jsonl import images_of, load_image, load_video, local, parse_messages, parse_record
from .data.formats.sample import Chunk, Sample
from .generation import (
    Decoding,
    UsageError,
    check_room,
    folder_run_config,
    generate_drafting,
    load_model_folder,
    prompt_encoder,
)
from .paths import not_a_file

# a --messages file is read whole: far above any hand-written set of prompts
MAX_MESSAGES_BYTES = 64 * 1024 * 1024


def keyed_prompts(args, data: DataConfig) -> list[tuple[dict | None, Sample]]:
    """(which record, sample) of each prompt, its images and videos read as ``data`` reads a training record's:
    for ``--messages`` the record's line and its ``id`` if it has one, so each answer names its prompt; None
    otherwise."""
    max_pixels = data.max_image_pixels
    if args.messages:
        path = Path(args.messages)
        problem = not_a_file(path)
        if problem is not None:
            raise UsageError(f"--messages file '{path}' {problem}")
        if path.stat().st_size > MAX_MESSAGES_BYTES:
            raise UsageError(f"--messages file '{path}' is over {MAX_MESSAGES_BYTES // 2 ** 20} MiB")
        samples: list[tuple[dict | None, Sample]] = []
        for number, line in enumerate(path.read_bytes().splitlines(), start=1):
            if not line.strip():
                continue
            record = parse_record(line, f"{path} line {number}")
            conversation, images, videos = parse_messages(record.get("messages"),
                                                          images_of(record, f"{path} line {number}"),
                                                          record.get("videos", []))
            conversation.enable_thinking = record_thinking(record, f"{path} line {number}", thinking_of(args))
            key = {"line": number, **({"id": record["id"]} if isinstance(record.get("id"), (str, int)) else {})}
            samples.append((key, Sample([load_image(path.parent / str(p), max_pixels) for p in images],
                                        videos=[load_video(path.parent, v, max_pixels, data.video_reading)
                                                for v in videos],
                                        conversation=conversation)))
        if not samples:
            raise UsageError(f"--messages file '{path}' holds no conversation")
        return samples
    images = [load_image(local(Path(), p, "image"), max_pixels) for p in args.image]
    chunks = [Chunk(image=i) for i in range(len(images))]
    if args.prompt is not None:
        if not args.prompt.strip():
            raise UsageError("--prompt is empty")
        conversation, _, _ = parse_messages([{"role": "user", "content": args.prompt}], args.image, [])
        conversation.enable_thinking = thinking_of(args)
        return [(None, Sample(images, conversation=conversation))]
    if not images:
        raise UsageError("nothing to continue: give --image, --prompt or --messages")
    return [(None, Sample(images, chunks))]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="final model, checkpoint or PaddleFormers ERNIE 4.5 folder")
    parser.add_argument("--image", action="append", default=[], help="an image file (repeat for several)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="a user turn")
    source.add_argument("--messages", help="JSONL: one {'images': [...], 'messages': [...]} conversation per line")
    add_decoding_arguments(parser, max_new_tokens=64)
    parser.add_argument("--batch-size", type=at_least_one, default=8, help="prompts decoded side by side")
    args = parser.parse_args(argv)
    try:
        data = folder_run_config(args.model, args.config).data
        keyed = keyed_prompts(args, data)
        keys, samples = [key for key, _ in keyed], [sample for _, sample in keyed]
        loaded = load_model_folder(args.model)
        model, tokenizer, cfg = loaded.model, loaded.tokenizer, loaded.cfg
        if tokenizer is None:  # load_model_folder refuses a folder without one unless told otherwise
            raise CheckpointError(f"'{args.model}' holds no tokenizer")
        if not loaded.sees_images and any(sample.images for sample in samples):
            raise UsageError(f"'{args.model}' is a text model (it holds no vision encoder): it cannot take images")
        prompts = [prompt_encoder(tokenizer, cfg, data).prompt(sample) for sample in samples]
        for prompt in prompts:
            check_room(prompt, cfg.max_position_embeddings)
    except (BadSample, UsageError, CheckpointError, ConfigError, OSError, ValueError) as err:
        print(f"generate error: {err}", file=sys.stderr)
        return 2
    answered: dict[str, float] = {"seconds": 0.0, "tokens": 0, "drafted": 0, "accepted": 0}
    for start in range(0, len(prompts), args.batch_size):
        group = prompts[start: start + args.batch_size]
        decoding = Decoding(args.max_new_tokens, args.temperature, args.top_p, args.seed)
        began = time.perf_counter()
        outs = generate_drafting(model, group, [decoding] * len(group), tokenizer.eos_id,
                                 never=(cfg.im_patch_id,) if loaded.sees_images else (), tokens=tokenizer.vocab_size,
                                 draft_tokens=args.draft_tokens)
        for name, value in (("seconds", time.perf_counter() - began), ("tokens", sum(len(o.ids) for o in outs)),
                            ("drafted", sum(o.drafted for o in outs)), ("accepted", sum(o.accepted for o in outs))):
            answered[name] += value
        for key, out in zip(keys[start: start + args.batch_size], outs):
            text = tokenizer.decode(out.ids)
            answer = {**key, "text": text, "tokens": len(out.ids), "stop": out.stop} if key is not None else None
            print(json.dumps(answer, ensure_ascii=False) if answer is not None else text, flush=True)
    if answered["drafted"]:  # the model's multi-token prediction layers drafted: how well, and how fast
        print(f"speculative decoding: {answered['accepted']} of {answered['drafted']} drafted tokens kept "
              f"({answered['accepted'] / answered['drafted']:.0%}), {answered['tokens'] / answered['seconds']:.1f} "
              "tokens/s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
