"""A model folder ready to answer conversations: what the server and the terminal chat share.

Conversations come as the training JSONL's messages are read (``data.formats.jsonl.parse_messages``), their images and
videos decoded; they are encoded by the folder's training encoder and answered by ``generation.generate_drafting``:
the requests that wait while the model is busy are answered together in its next turn, side by side (one model per
process).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np

from ..checkpoint.errors import CheckpointError
from ..cli import drafts_by_default
from ..data.encoding.packing import Encoded
from ..data.encoding.tokenizer import Tokenizer
from ..data.formats.sample import Sample
from ..generation import (
    Decoding,
    Generated,
    UsageError,
    check_room,
    folder_run_config,
    generate_batch,
    generate_drafting,
    load_model_folder,
    prompt_encoder,
)
from ..moe.replay import moe_layer_ids, recording, rows_of_generation

SIDE_BY_SIDE = 8  # requests answered together in one turn of the model, at most (serve --batch-size)


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token (or one of its alternatives): its id, its text alone, and its log-probability under the
    logits divided by the request's temperature (temperature 0 read as 1), over the whole vocabulary."""

    id: int
    text: str
    logprob: float
    top: tuple[TokenLogprob, ...] = ()  # the most likely tokens at its step, most likely first


@dataclass
class Reply:
    text: str
    finish_reason: str  # "stop" (end of sentence or a stop string) or "length" (max_new_tokens, positions)
    prompt_tokens: int
    completion_tokens: int
    drafted: int = 0  # tokens drafted by the model's multi-token prediction layers (speculative decoding)
    accepted: int = 0  # of them, kept
    token_ids: list[int] | None = None  # the sampled tokens, the end-of-sentence token last where it stopped there
    logprobs: list[TokenLogprob] | None = None  # theirs, where the request asked (``Sampling.logprobs``)
    policy_version: int = 0  # the weights' version its first token was sampled at (``ChatModel.policy_version``)
    # with ``Sampling.routes``: ``[moe layers, prompt and answer positions, k]`` global expert ids each token went to
    # (``moe.replay``: DROPPED, NOT_RECORDED for the answer's last token, which no forward read)
    routes: np.ndarray | None = None


@dataclass(frozen=True)
class Sampling(Decoding):
    """A request's decoding, and the strings its answer ends before."""

    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # the sampled tokens' log-probabilities, with this many alternatives (None: none)
    routes: bool = False  # the experts each token went to in every MoE layer (``Reply.routes``)


class TextStream:
    """The text of the tokens decoded so far, handed out as it becomes final: not while it ends inside a
    character (an incomplete byte sequence decodes to U+FFFD) or with what may be the start of a stop string;
    cut before the first stop string."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...], on_text: Callable[[str], None] | None):
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


@dataclass(eq=False)
class _Request:
    prompt: Encoded
    sampling: Sampling
    stream: TextStream
    out: Generated | None = None  # once answered
    error: Exception | None = None  # what its stream raised (a client gone): that request alone ends
    answered: bool = False
    aborted: bool = False  # ended by a pause that aborts what is in flight
    version: int = 0  # the policy version its turn started at
    routes: np.ndarray | None = None  # its routing, where its turn recorded it


class ChatModel:
    """``folder``: a final model, checkpoint, PaddleFormers ERNIE 4.5 folder or LoRA adapter; ``config_path``: a
    training config whose data section overrides the folder's processor settings; ``side_by_side``: the most
    requests one turn of the model answers."""

    def __init__(self, folder, config_path=None, side_by_side: int = SIDE_BY_SIDE, draft_tokens: int | None = None):
        self.data = folder_run_config(folder, config_path).data
        loaded = load_model_folder(folder)
        if loaded.tokenizer is None:  # load_model_folder refuses a folder without one unless told otherwise
            raise CheckpointError(f"{folder} holds no tokenizer")
        self.model, self.tokenizer, self.cfg = loaded.model, loaded.tokenizer, loaded.cfg
        # per step, from the model's multi-token prediction layers where it has them (None: as on this device)
        self.draft_tokens = drafts_by_default() if draft_tokens is None else draft_tokens
        self.sees_images = loaded.sees_images
        self.encoder = prompt_encoder(self.tokenizer, self.cfg, self.data)
        self.lock = threading.Lock()  # held by the model's turn: the requests that come meanwhile wait for the next
        self.queued: list[_Request] = []  # requests no turn has taken yet (under queue_lock)
        self.queue_lock = threading.Lock()
        self.turns: Counter = Counter()  # turns of the model by how many requests they answered
        self.side_by_side = side_by_side
        # pausing (vLLM's modes: wait for the turn in flight, keep it parked between two tokens, or abort it); the
        # fields below are read and changed under ``self.turn``
        self.turn = threading.Condition()
        self.paused: str | None = None  # the pause in force: "wait", "keep" or "abort"; None: serving
        self.turning = False  # a turn of the model is running
        self.parked = False  # the running turn waits between two tokens (paused with keep)
        self.policy_version = 0  # weight updates applied since the folder was loaded

    def encode(self, conversation, images: list[np.ndarray], videos: Sequence[np.ndarray] = ()) -> Encoded:
        """The prompt of ``conversation`` (``data.formats.jsonl.parse_messages``'s, its images and videos decoded in
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
        """Answer ``prompt``; ``on_text`` receives the answer piece by piece as it is generated. The caller that
        gets the model answers every request waiting by then (up to ``side_by_side``, its own first) in one turn;
        each answer is the one its prompt gets alone. What ``on_text`` raises ends this request only."""
        request = _Request(prompt, sampling, TextStream(self.tokenizer, sampling.stop, on_text))
        with self.queue_lock:
            self.queued.append(request)
        while not request.answered:
            with self.turn:  # a turn that answers it while paused (wait, abort) notifies as it ends
                self.turn.wait_for(lambda: self.paused is None or request.answered)
            if request.answered:
                break
            with self.lock:
                with self.turn:
                    if self.paused is not None:  # paused since: wait for the resume
                        continue
                    self.turning = True
                try:
                    with self.queue_lock:
                        if request not in self.queued:  # taken by an earlier turn, which has answered it
                            continue
                        others = [r for r in self.queued if r is not request][: self.side_by_side - 1]
                        turn = [request, *others]
                        self.queued = [r for r in self.queued if r not in turn]
                    self._answer(turn)
                finally:
                    with self.turn:
                        self.turning = False
                        self.turn.notify_all()
        if request.error is not None:
            raise request.error
        text = request.stream.finish()
        out = request.out
        assert out is not None  # its turn answered it, or it raised its error above
        finish = "abort" if request.aborted else "stop" if out.stop in ("eos", "caller") else "length"
        ids = out.ids + ([self.tokenizer.eos_id] if out.stop == "eos" else [])
        return Reply(text, finish, len(prompt.input_ids), len(out.ids), out.drafted, out.accepted, ids,
                     self._logprobs(ids, out, sampling.logprobs), request.version,
                     request.routes if sampling.routes else None)

    def pause(self, mode: str) -> None:
        """Stop starting turns; ``wait``: return once the turn in flight has ended, ``keep``: once it is parked
        between two tokens (it goes on at the resume, with the weights then in force), ``abort``: end the requests
        in flight at their next token (``finish_reason`` "abort"). Requests that come meanwhile wait for the
        resume."""
        with self.turn:
            self.paused = mode
            self.turn.notify_all()
            self.turn.wait_for(lambda: not self.turning or (mode == "keep" and self.parked))

    def resume(self) -> None:
        with self.turn:
            self.paused = None
            self.turn.notify_all()

    def expert_pools(self) -> dict[str, list[int]]:
        """Each modality's routed expert ids, ``[first, end)``: text experts first, then vision (ERNIE's numbering;
        one shared pool is ``text``)."""
        counts = self.cfg.moe_num_experts
        names = ("text", "vision")[: len(counts)]
        return {name: [sum(counts[:i]), sum(counts[: i + 1])] for i, name in enumerate(names)}

    def waiting(self) -> int:
        """Requests waiting for a turn."""
        with self.queue_lock:
            return len(self.queued)

    def _keep_routes(self, turn: list[_Request], outs: list[Generated], records) -> None:
        """Each request's routing, from the records of the turn that answered it side by side."""
        lengths = [len(r.prompt) for r in turn]
        answers = [len(out.ids) + (out.stop == "eos") for out in outs]
        padding = np.array([max(lengths) - n for n in lengths])
        table = rows_of_generation(records, moe_layer_ids(self.cfg), len(turn), padding, answers,
                                   max(n + a for n, a in zip(lengths, answers)))
        for row, request in enumerate(turn):
            request.routes = table[row, :, : lengths[row] + answers[row]]

    def _between_tokens(self) -> bool:
        """Called between two tokens of a turn: parks while paused with keep; whether a pause aborts the turn."""
        with self.turn:
            if self.paused == "keep":
                self.parked = True
                self.turn.notify_all()
                self.turn.wait_for(lambda: self.paused != "keep")
                self.parked = False
            return self.paused == "abort"

    def _logprobs(self, ids: list[int], out: Generated, alternatives: int | None) -> list[TokenLogprob] | None:
        if alternatives is None or out.logps is None or out.top is None:
            return None
        text = self.tokenizer.decode
        return [TokenLogprob(token, text([token]), logp, tuple(TokenLogprob(t, text([t]), p) for t, p in
                                                               top[:alternatives]))
                for token, logp, top in zip(ids, out.logps, out.top)]

    def _answer(self, turn: list[_Request]) -> None:
        def on_token(row: int, ids: list[int]) -> bool:
            request = turn[row]
            if self._between_tokens():
                request.aborted = True
                return True
            try:
                return request.stream(ids)
            except Exception as err:  # noqa: BLE001 - the client's end: its request stops, the others go on
                request.error = err
                return True

        for request in turn:
            request.version = self.policy_version
        never = (self.cfg.im_patch_id,) if self.sees_images else ()
        prompts = [r.prompt for r in turn]
        samplings: list[Decoding] = [r.sampling for r in turn]
        asked = [r.sampling.logprobs for r in turn if r.sampling.logprobs is not None]
        routed = any(r.sampling.routes for r in turn) and bool(self.model.moe_layers())
        try:
            if asked or routed:  # each token's figures come from the step that chose it: no drafts in this turn
                with recording(self.model) if routed else nullcontext() as records:
                    outs = generate_batch(self.model, prompts, samplings, self.tokenizer.eos_id, never=never,
                                          tokens=self.tokenizer.vocab_size, on_token=on_token,
                                          top_logps=max(max(asked), 1) if asked else 0)
                if records is not None:
                    self._keep_routes(turn, outs, records)
            else:
                outs = generate_drafting(self.model, prompts, samplings, self.tokenizer.eos_id, never=never,
                                         tokens=self.tokenizer.vocab_size, on_token=on_token,
                                         draft_tokens=self.draft_tokens)
        except Exception as err:  # noqa: BLE001 - every request of the turn hears of it
            for request in turn:
                request.error, request.answered = request.error or err, True
            return
        self.turns[len(turn)] += 1
        for request, out in zip(turn, outs):
            request.out, request.answered = out, True
