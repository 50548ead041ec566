"""The OpenAI chat-completions request and response shapes: a request checked and turned into a conversation,
its images and sampling; the answers (whole, or as server-sent chunks); errors in the API's own shape."""

from __future__ import annotations

import base64
import binascii
import io
import math
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..data.encoding.packing import BadSample
from ..data.formats.chat import Conversation
from ..data.formats.jsonl import decode_image, load_image, parse_messages
from .chat_model import Reply, Sampling, TokenLogprob

MAX_STOP_STRINGS = 4  # as the API
MAX_TOP_LOGPROBS = 20  # as the API


@dataclass(frozen=True)
class Limits:
    max_request_bytes: int = 20 * 2 ** 20
    max_images: int = 8  # per request
    max_tokens: int = 1024  # the most a request may ask for (its max_tokens); also the default
    max_queue: int = 256  # requests waiting for the model (as vLLM queues a harness's 32 at once); more: 503


class ApiError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class ChatRequest:
    model: str
    conversation: Conversation
    images: list[np.ndarray]  # the image parts' pixels, in order
    sampling: Sampling
    stream: bool
    return_token_ids: bool = False  # the answer's sampled token ids beside its text (vLLM's extension)


def _number(body: dict, key: str, default: float, low: float, high: float, low_included: bool = True) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not (
            (value >= low if low_included else value > low) and value <= high):
        raise ApiError(400, f"{key} must be a number {'from' if low_included else 'above'} {low:g} "
                            f"{'to' if low_included else 'and at most'} {high:g}, not {value!r}", key)
    return value


def _flag(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"{key} must be true or false", key)
    return value


def _int(body: dict, key: str, default: int, low: int, high: int) -> int:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ApiError(400, f"{key} must be a whole number from {low} to {high}, not {value!r}", key)
    return value


def read_image(source: str, image_root: Path | None, max_pixels: int) -> np.ndarray:
    """A ``data:image/...;base64,`` URL (as large as the request's size limit lets it be), or a local path
    (plain or ``file://``) under ``image_root``; the pixels bounded by ``max_pixels`` before decoding."""
    if source.startswith("data:"):
        header, _, payload = source.partition(",")
        if not header.endswith(";base64") or not header[5:].startswith("image/"):
            raise ApiError(400, "an image data URL must be data:image/<type>;base64,<data>", "messages",
                           "invalid_image")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, "an image data URL holds no valid base64", "messages", "invalid_image") from None
        return decode_image(io.BytesIO(data), "data URL", max_pixels)
    if "\x00" in source:
        raise ApiError(400, "an image path holds a NUL byte", "messages", "invalid_image")
    if "://" in source and not source.startswith("file://"):
        raise ApiError(400, f"image '{source[:200]}': only data URLs and local paths are read (no downloads)",
                       "messages", "invalid_image")
    if image_root is None:
        raise ApiError(400, "local image paths are not read by this server (start it with --image-root)",
                       "messages", "invalid_image")
    path = (image_root / source.removeprefix("file://")).resolve()
    if not path.is_relative_to(image_root):
        raise ApiError(400, f"image '{source[:200]}' is outside the server's --image-root", "messages",
                       "invalid_image")
    return load_image(path, max_pixels)


def parse_request(body, served: str, limits: Limits, image_root: Path | None, max_pixels: int,
                  thinking: bool | None = None) -> ChatRequest:
    """Raises ApiError for anything the API answers as an error. ``thinking``: the chat template's
    ``enable_thinking`` unless the request sets it in ``chat_template_kwargs`` (as vLLM takes it)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is None or model == "":
        raise ApiError(400, "model is required", "model")
    if not isinstance(model, str):
        raise ApiError(400, f"model must be a string, the served model's name, not {str(model)[:100]}", "model")
    if model != served:
        raise ApiError(404, f"The model '{model[:200]}' does not exist (this server has '{served}')", "model",
                       "model_not_found")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    for message in messages:
        if message.get("role") not in ("system", "user", "assistant"):
            raise ApiError(400, f"unknown role {str(message.get('role'))[:50]!r} (system, user or assistant)",
                           "messages")
    if _int(body, "n", 1, 1, 1) != 1:
        raise ApiError(400, "n must be 1", "n")
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or len(stop) > MAX_STOP_STRINGS or not all(
            isinstance(s, str) and s for s in stop):
        raise ApiError(400, f"stop must be a string or a list of at most {MAX_STOP_STRINGS} non-empty strings",
                       "stop")
    logprobs, return_ids, routes = (_flag(body, key) for key in ("logprobs", "return_token_ids",
                                                                  "return_routed_experts"))
    top = _int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    if top and not logprobs:
        raise ApiError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    sampling = Sampling(max_new_tokens=_int(body, key, limits.max_tokens, 1, limits.max_tokens),
                        temperature=_number(body, "temperature", 0.0, 0, 2),
                        top_p=_number(body, "top_p", 1.0, 0, 1, low_included=False),
                        seed=_int(body, "seed", 0, 0, 2 ** 32 - 1), stop=tuple(stop),
                        logprobs=top if logprobs else None, routes=routes)
    stream = _flag(body, "stream")
    asked = [key for key, on in (("logprobs", logprobs), ("return_token_ids", return_ids),
                                 ("return_routed_experts", routes)) if on]
    if stream and asked:
        raise ApiError(400, f"{asked[0]} comes with whole answers: ask without stream", asked[0])
    template_kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(template_kwargs, dict) or set(template_kwargs) - {"enable_thinking"} or not isinstance(
            template_kwargs.get("enable_thinking", False), bool):
        raise ApiError(400, "chat_template_kwargs takes only enable_thinking, true or false", "chat_template_kwargs")
    thinking = template_kwargs.get("enable_thinking", thinking)
    try:  # image parts: {"type": "image_url", "image_url": {"url": ...}}
        conversation, sources, videos = parse_messages(messages, [], [])
    except BadSample as err:
        raise ApiError(400, str(err), "messages") from None
    conversation.enable_thinking = thinking
    if len(sources) > limits.max_images:
        raise ApiError(400, f"{len(sources)} images: at most {limits.max_images} per request", "messages",
                       "too_many_images")
    if videos:
        raise ApiError(400, "video parts are not taken: send a video's frames as images", "messages")
    decoded = {}
    for source in sources:
        try:
            if source not in decoded:
                decoded[source] = read_image(source, image_root, max_pixels)
        except BadSample as err:
            raise ApiError(400, str(err), "messages", "invalid_image") from None
    return ChatRequest(model, conversation, [decoded[s] for s in sources], sampling, stream, return_ids)


class Completion:
    """One answer's identity, and its shapes: whole (``chat.completion``) or streamed (``chat.completion.chunk``)."""

    def __init__(self, model: str, pools: dict[str, list[int]] | None = None):
        """``pools``: each modality's expert ids as ``[first, end)`` (text first, then vision)."""
        self.id, self.created, self.model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model
        self.pools = pools or {}

    def whole(self, reply: Reply, token_ids: bool = False) -> dict:
        """``token_ids``: the sampled tokens' ids in the choice (``return_token_ids``)."""
        choice = {"index": 0, "message": {"role": "assistant", "content": reply.text},
                  "finish_reason": reply.finish_reason, "logprobs": logprobs(reply.logprobs)}
        if token_ids:
            choice["token_ids"] = reply.token_ids
        if reply.routes is not None:
            choice["routed_experts"] = routed_experts(reply.routes, self.pools)
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [choice], "usage": usage(reply), "policy_version": reply.policy_version}

    def chunk(self, delta: dict, finish_reason: str | None = None, reply: Reply | None = None) -> dict:
        out = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]}
        return {**out, "usage": usage(reply), "policy_version": reply.policy_version} if reply is not None else out


def logprobs(tokens: list[TokenLogprob] | None) -> dict | None:
    """OpenAI's ``choices[].logprobs``: each sampled token with its log-probability, its UTF-8 bytes and its
    alternatives (``top_logprobs``)."""
    if tokens is None:
        return None

    def one(token: TokenLogprob) -> dict:
        return {"token": token.text, "logprob": token.logprob, "bytes": list(token.text.encode("utf-8"))}

    return {"content": [{**one(t), "top_logprobs": [one(a) for a in t.top]} for t in tokens], "refusal": None}


def routed_experts(routes: np.ndarray, pools: dict[str, list[int]]) -> dict:
    """``[moe layers, positions, k]`` expert ids as int16, little-endian, base64: the prompt's positions then the
    answer's, each a global expert id of the pool its modality routes in, -1 a choice capacity dropped, -2 a position
    no forward read (the answer's last token)."""
    data = np.ascontiguousarray(routes, dtype="<i2")
    return {"shape": list(data.shape), "dtype": "int16", "data": base64.b64encode(data.tobytes()).decode(),
            "pools": pools}


def usage(reply: Reply) -> dict:
    """OpenAI's usage; speculative decoding's drafts as its predicted-output counts (kept and rejected)."""
    out: dict = {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
           "total_tokens": reply.prompt_tokens + reply.completion_tokens}
    if reply.drafted:
        out["completion_tokens_details"] = {"accepted_prediction_tokens": reply.accepted,
                                            "rejected_prediction_tokens": reply.drafted - reply.accepted}
    return out


def models_list(served: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": served, "object": "model", "created": created, "owned_by": "ernie_moe"}]}
