"""``python -m ernie_moe.doctor --serve FOLDER``: the serving engines installed here (vLLM, SGLang, FastDeploy, on
the user's GPUs) each load the folder as users start them, are asked one question with an image through the
OpenAI chat-completions API, greedily, and their answer and its tokens' log-probabilities are held against this
package's own decoding of the same conversation (``ernie_moe.generate``'s, encoded as the training encoded it).
``--engine-command`` serves the folder with any other OpenAI-compatible command instead."""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import shlex
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from ..checkpoint.engines import ENGINES, check_folder
from ..generation.decoding import Decoding, generate_batch
from ..serving.chat_model import ChatModel
from ..serving.openai_api import Limits, parse_request

# how users start each engine's OpenAI server (module to find it by, command); {python} {model} {port} filled in
COMMANDS = {
    "vllm": ("vllm", "{python} -m vllm.entrypoints.openai.api_server --model {model} --port {port} "
                     "--trust-remote-code --served-model-name served --max-model-len 8192"),
    "sglang": ("sglang", "{python} -m sglang.launch_server --model-path {model} --port {port} --trust-remote-code "
                         "--served-model-name served"),
    "fastdeploy": ("fastdeploy", "{python} -m fastdeploy.entrypoints.openai.api_server --model {model} --port {port} "
                                 "--served-model-name served --enable-mm"),
}
QUESTION = "Describe the image."
LOGPROB_TOLERANCE = 0.5  # nats: an engine computes in bf16, this package's check in float32


@dataclass
class ServedAnswer:
    """One engine's answer beside this package's."""

    engine: str
    answer: str
    ours: str
    logprob_difference: float | None  # largest |engine - ours| over the answer's tokens; None: not comparable
    note: str = ""
    answered: bool = True

    @property
    def passed(self) -> bool:
        return self.answered and self.answer == self.ours and (
            self.logprob_difference is None or self.logprob_difference <= LOGPROB_TOLERANCE)


def installed_engines() -> list[str]:
    return [name for name, (module, _) in COMMANDS.items() if importlib.util.find_spec(module) is not None]


def question_body(image: np.ndarray, max_tokens: int) -> dict:
    """The chat-completions request both sides answer: the image as a data URL and the question, greedy."""
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    return {"model": "served", "temperature": 0, "max_tokens": max_tokens, "logprobs": True, "top_logprobs": 1,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": QUESTION}]}]}


def our_answer(folder, body: dict) -> tuple[str, list[float]]:
    """This package's greedy answer to ``body`` and each answer token's log-probability (plain decoding)."""
    chat = ChatModel(folder, draft_tokens=0)
    request = parse_request(body, "served", Limits(), None, chat.data.max_image_pixels)
    prompt = chat.encode(request.conversation, request.images)
    out = generate_batch(chat.model, [prompt], [Decoding(request.sampling.max_new_tokens, 0.0, 1.0, 0)],
                         chat.tokenizer.eos_id, never=(chat.cfg.im_patch_id,) if chat.sees_images else (),
                         tokens=chat.tokenizer.vocab_size, with_logps=True)[0]
    logps = list(out.logps or [])[: len(out.ids)]
    return chat.tokenizer.decode(out.ids), logps


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ask_engine(command: str, folder, body: dict, timeout: float) -> dict:
    """Start ``command`` serving ``folder``, wait until it answers ``/v1/models`` (or ends, or ``timeout`` passes),
    ask ``body``, stop it; its answer as the API gives it. RuntimeError saying why there is none."""
    port = free_port()
    argv = shlex.split(command.format(python=shlex.quote(sys.executable), model=shlex.quote(str(folder)), port=port))
    log = io.StringIO()
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                assert process.stdout is not None
                log.write(process.stdout.read())
                raise RuntimeError(f"it ended (exit {process.returncode}) before serving:\n{log.getvalue()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{base}/v1/models", timeout=5) as reply:
                    if reply.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"it did not serve within {timeout:.0f} s")
            time.sleep(1)
        request = urllib.request.Request(f"{base}/v1/chat/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return json.loads(reply.read())
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def compare(engine: str, reply: dict, ours: str, our_logps: list[float]) -> ServedAnswer:
    choice = reply["choices"][0]
    answer = choice["message"]["content"] or ""
    content = (choice.get("logprobs") or {}).get("content")
    if not content:
        return ServedAnswer(engine, answer, ours, None, "the engine gave no log-probabilities")
    theirs = [float(token["logprob"]) for token in content]
    if len(theirs) == len(our_logps) + 1:  # the end-of-sentence token listed too, as it was sampled
        theirs = theirs[:-1]
    if len(theirs) != len(our_logps):
        return ServedAnswer(engine, answer, ours, None, f"{len(theirs)} answer tokens there, {len(our_logps)} here")
    difference = float(np.abs(np.subtract(theirs, our_logps)).max()) if theirs else 0.0
    return ServedAnswer(engine, answer, ours, difference)


def check_serving(folder, engines: list[str], image: np.ndarray, command: str | None = None,
                  timeout: float = 1200.0, max_tokens: int = 32) -> list[ServedAnswer]:
    """Each engine's (or ``command``'s) answer to the question about ``image`` beside this package's; the
    save-time check's problems printed first."""
    for report in check_folder(folder):
        for problem in report.problems:
            print(f"{report.name}: {problem}")
    body = question_body(image, max_tokens)
    ours, logps = our_answer(folder, body)
    runs = [("command", command)] if command else [(e, COMMANDS[e][1]) for e in engines]
    results = []
    for engine, template in runs:
        name = ENGINES.get(engine, command or engine)
        try:
            reply = ask_engine(template, Path(folder).resolve(), body, timeout)
        except (RuntimeError, OSError, urllib.error.URLError, json.JSONDecodeError) as err:
            results.append(ServedAnswer(name, "", ours, None, f"no answer: {err}", answered=False))
            continue
        results.append(compare(name, reply, ours, logps))
    return results
