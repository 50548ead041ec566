"""The server's overhead: tokens per second through ``python -m ernie_moe.serve`` (the openai client, whole and
streamed answers) against ``generation.generate`` on the same model, prompt and tokens.

    python benchmarks/bench_serve.py [--new-tokens 128] [--rounds 3] [--model DIR]

The default model is ``configs/vl_moe.yaml`` with random weights, saved to a temporary folder (random weights
seldom choose the end token, so every answer runs to ``--new-tokens``); the prompt is a question about one
synthetic image, sent as a data URL. The server runs in this process on a free loopback port; greedy, the best
of ``--rounds`` for each way, the ways taking turns.
"""

from __future__ import annotations

import argparse
import base64
import io
import logging
import tempfile
import threading
import time
import warnings
from pathlib import Path

import paddle
from PIL import Image

from ernie_moe.checkpoint import save_model
from ernie_moe.config import load_config
from ernie_moe.data import build_tokenizer
from ernie_moe.data.formats.jsonl import parse_messages
from ernie_moe.data.formats.synthetic import SyntheticShapes
from ernie_moe.generation import generate
from ernie_moe.model.ernie_vl import ErnieMoEForConditionalGeneration
from ernie_moe.serving.chat_model import ChatModel
from ernie_moe.serving.openai_api import Limits
from ernie_moe.serving.server import ChatServer

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "What is in the picture?"


def best_rates(ways: dict, rounds: int) -> dict[str, tuple[float, int]]:
    """Each way's (tokens per second of its fastest round, tokens per answer); the ways take turns in each
    round, so that a slow spell of the machine falls on all of them."""
    best, tokens = dict.fromkeys(ways, float("inf")), {}
    for _ in range(rounds):
        for name, run in ways.items():
            start = time.perf_counter()
            tokens[name] = run()
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: (tokens[name] / best[name], tokens[name]) for name in ways}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", help="a model folder (default: the default config, random weights)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    from openai import OpenAI

    cfg = load_config(ROOT / "configs" / "vl_moe.yaml")
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.model
        if folder is None:
            paddle.seed(0)
            folder = str(Path(scratch) / "model")
            save_model(ErnieMoEForConditionalGeneration(cfg.model), cfg.model, folder, build_tokenizer(cfg),
                       hf_layout=True)
        chat = ChatModel(folder)
        image = SyntheticShapes(cfg.training.seed, "eval", 1, cfg.data.image_size)[0].images[0]
        png = io.BytesIO()
        Image.fromarray(image).save(png, "PNG")
        url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                 {"type": "text", "text": QUESTION}]}]
        conversation, _, _ = parse_messages(messages, [], [])
        prompt = chat.encode(conversation, [image])
        server = ChatServer(("127.0.0.1", 0), chat, "bench", Limits(max_tokens=args.new_tokens), None,
                            log_requests=False)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        client = OpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="unused")

        def whole() -> int:
            return client.chat.completions.create(model="bench", messages=messages,
                                                  max_tokens=args.new_tokens).usage.completion_tokens

        def streamed() -> int:
            chunks = list(client.chat.completions.create(model="bench", messages=messages,
                                                         max_tokens=args.new_tokens, stream=True))
            return chunks[-1].usage.completion_tokens

        def direct() -> int:
            return len(generate(chat.model, prompt, args.new_tokens, chat.tokenizer.eos_id,
                                never=(chat.cfg.im_patch_id,), tokens=chat.tokenizer.vocab_size).ids)

        rates = best_rates({"generate": direct, "server, whole answer": whole, "server, streamed": streamed},
                           args.rounds)
        server.shutdown()
    print(f"prompt {len(prompt)} tokens (one {cfg.data.image_size}px image, as a data URL), best of {args.rounds}")
    base = rates["generate"][0]
    for name, (rate, tokens) in rates.items():
        print(f"{name:22s} {rate:8.1f} tokens/s ({tokens} tokens)  {rate / base:.2f}x")


if __name__ == "__main__":
    main()
