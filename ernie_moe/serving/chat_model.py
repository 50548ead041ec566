"""A model folder ready to answer conversations: what the server and the terminal chat share.

Conversations come as the training JSONL's messages are read (``data.jsonl.parse_messages``), their images and
videos decoded; they are encoded by the folder's training encoder and answered by ``generation.generate`` one
request at a time (one model per process).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..data.packing import Encoded
from ..data.sample import Sample
from ..generation import UsageError, check_room, folder_run_config, generate, load_model_folder, prompt_encoder


@dataclass
class Reply:
    text: str
    finish_reason: str  # "stop" (end of sentence or a stop string) or "length" (max_new_tokens, positions)
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()


class TextStream:
    """The text of the tokens decoded so far, handed out as it becomes final: not while it ends inside a
    character (an incomplete byte sequence decodes to U+FFFD) or with what may be the start of a stop string;
    cut before the first stop string."""

    def __init__(self, tokenizer, stop: tuple[str, ...], on_text: Callable[[str], None] | None):
        self.tokenizer, self.stop, self.on_text = tokenizer, stop, on_text
        self.sent, self.text = "", ""

    def __call__(self, ids: list[int]) -> bool:
        """Called after each new token; True when a stop string has appeared."""
        text = self.tokenizer.decode(ids)
        found = [text.index(s) for s in self.stop if s in text]
        if found:
            self.text = text[:min(found)]
            self._send(self.text)
            return True
        self.text = text
        if not text.endswith("\ufffd"):
            held = max((n for s in self.stop for n in range(len(s) - 1, 0, -1) if text.endswith(s[:n])), default=0)
            self._send(text[:len(text) - held])
        return False

    def finish(self) -> str:
        self._send(self.text)
        return self.text

    def _send(self, final: str) -> None:
        if len(final) > len(self.sent) and final.startswith(self.sent):
            if self.on_text is not None:
                self.on_text(final[len(self.sent):])
            self.sent = final


class ChatModel:
    """``folder``: a final model, checkpoint, PaddleFormers ERNIE 4.5 folder or LoRA adapter; ``config_path``: a
    training config whose data section overrides the folder's processor settings."""

    def __init__(self, folder, config_path=None):
        self.data = folder_run_config(folder, config_path).data
        loaded = load_model_folder(folder)
        self.model, self.tokenizer, self.cfg = loaded.model, loaded.tokenizer, loaded.cfg
        self.sees_images = loaded.sees_images
        self.encoder = prompt_encoder(self.tokenizer, self.cfg, self.data)
        self.lock = threading.Lock()  # one generation at a time: the others wait their turn

    def encode(self, conversation, images: list[np.ndarray], videos: list[np.ndarray] = ()) -> Encoded:
        """The prompt of ``conversation`` (``data.jsonl.parse_messages``'s, its images and videos decoded in
        order), the assistant's turn opened. Raises UsageError or BadSample saying what is wrong."""
        if (images or videos) and not self.sees_images:
            raise UsageError("this is a text model (its folder holds no vision encoder): it cannot take images")
        if conversation.messages[-1]["role"] != "user":
            raise UsageError("the last message must be the user's")
        prompt = self.encoder.prompt(Sample(list(images), videos=list(videos), conversation=conversation))
        check_room(prompt, self.cfg.max_position_embeddings)
        return prompt

    def reply(self, prompt: Encoded, sampling: Sampling,
              on_text: Callable[[str], None] | None = None) -> Reply:
        """Answer ``prompt``; ``on_text`` receives the answer piece by piece as it is generated."""
        stream = TextStream(self.tokenizer, sampling.stop, on_text)
        with self.lock:
            out = generate(self.model, prompt, sampling.max_new_tokens, self.tokenizer.eos_id, sampling.temperature,
                           sampling.top_p, sampling.seed, never=(self.cfg.im_patch_id,) if self.sees_images else (),
                           tokens=self.tokenizer.vocab_size, on_token=stream)
        text = stream.finish()
        finish = "stop" if out.stop in ("eos", "caller") else "length"
        return Reply(text, finish, len(prompt.input_ids), len(out.ids))
