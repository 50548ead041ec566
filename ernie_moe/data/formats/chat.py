"""Conversations as the model reads them: messages of text, image and video parts -> chunks to encode.

A message is ``{"role": "system" | "user" | "assistant", "content": [parts]}``; parts are ``{"type": "text",
"text": ...}``, ``{"type": "image"}`` and ``{"type": "video"}``, the images and videos numbered in order
over the conversation. Two formats:

- :class:`TemplateChat`, for tokenizers with ERNIE-4.5's special tokens: the tokenizer folder's chat template
  (Jinja, rendered in a sandbox, so a template cannot run code), or :data:`ERNIE_VL_TEMPLATE`, which writes
  ERNIE-4.5-VL's chat format. The rendered text marks each image and video with ERNIE's slot strings, which
  become the image chunks; the assistant's text, and the end-of-sentence token closing each answer, is what the
  model trains on, found by rendering the conversation one message at a time. With thinking on (the
  ERNIE-4.5-VL-Thinking form), the template gets ``enable_thinking`` and an answer without ``<think>`` ...
  ``</think>`` is written after the empty think block, which is template and not trained on.
- :class:`PlainChat`, for the other tokenizers: ``System: `` / ``User: `` / ``Assistant: `` lines.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Protocol

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from .erniekit import (
    BEGIN_OF_SENTENCE,
    CALL,
    EMPTY_THINK,
    END_OF_SENTENCE,
    TOOL_LIST,
    TOOL_OUTPUT,
    check_think,
    tool_calls,
)
from .sample import BadSample, Chunk

IMAGE_SLOT = "<|IMAGE_START|><|image@placeholder|><|IMAGE_END|>"
VIDEO_SLOT = "<|VIDEO_START|><|video@placeholder|><|VIDEO_END|>"
ROLES = ("system", "user", "assistant", "tool")


def _literal(text: str) -> str:
    """``text`` as a Jinja string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


# ERNIE-4.5-VL's chat format: <|begin_of_sentence|> (then ERNIEKit's tool list, with tools), the system text and a
# newline, each user turn as
# "User: " + its parts (an image as "Picture N:" + its slot, a video as "Video N:" + its slot) + a newline,
# each answer as "Assistant: " + text + <|end_of_sentence|>, and "Assistant: " to generate from. With
# enable_thinking, an answer without a think block gets the empty one; with enable_thinking false (the Thinking
# model asked not to think), so does the turn opened to generate. Tool calls and outputs are ERNIEKit's: an
# answer's calls as <tool_call> lines before its text, a run of tool messages as one user turn of <tool_output>s.
ERNIE_VL_TEMPLATE = (
    "{%- set images = namespace(n=0) -%}{%- set videos = namespace(n=0) -%}"
    "{{- '<|begin_of_sentence|>' -}}"
    "{%- if tools -%}{{- " + _literal(TOOL_LIST[0]) + " ~ (tools if tools is string else tools | json) ~ "
    + _literal(TOOL_LIST[1]) + " -}}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{- message['content'] ~ '\n' -}}"
    "{%- elif message['role'] == 'user' -%}{{- 'User: ' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{%- set images.n = images.n + 1 -%}"
    "{{- 'Picture ' ~ images.n ~ ':" + IMAGE_SLOT + "' -}}"
    "{%- elif part['type'] == 'video' -%}{%- set videos.n = videos.n + 1 -%}"
    "{{- 'Video ' ~ videos.n ~ ':" + VIDEO_SLOT + "' -}}"
    "{%- else -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}{{- '\n' -}}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.previtem is not defined or loop.previtem['role'] != 'tool' -%}{{- 'User: ' -}}{%- endif -%}"
    "{{- " + _literal(TOOL_OUTPUT[0]) + " ~ message['content'] ~ " + _literal(TOOL_OUTPUT[1]) + " -}}"
    "{%- if loop.nextitem is not defined or loop.nextitem['role'] != 'tool' -%}{{- '\n' -}}{%- endif -%}"
    "{%- else -%}{{- 'Assistant: ' -}}"
    "{%- if enable_thinking is defined and enable_thinking and '</think>' not in message['content'] -%}"
    "{{- " + _literal(EMPTY_THINK) + " -}}{%- endif -%}"
    "{%- for call in message['tool_calls'] or [] -%}"
    "{{- " + _literal(CALL[0]) + " ~ call['function']['name'] ~ " + _literal(CALL[1]) + " ~ "
    "call['function']['arguments'] ~ " + _literal(CALL[2]) + " -}}"
    "{%- endfor -%}"
    "{{- message['content'] ~ '<|end_of_sentence|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'Assistant: ' -}}"
    "{%- if enable_thinking is defined and not enable_thinking -%}"
    "{{- " + _literal(EMPTY_THINK) + " -}}{%- endif -%}{%- endif -%}"
)


@dataclass
class Conversation:
    messages: list[dict]  # {"role", "content": [parts]}, an answer's "tool_calls" in OpenAI's form
    # the Thinking model's form: trained answers open with a think block; a prompt passes it on as it is (None: not
    # at all, False: the turn opened to generate holds the empty block)
    enable_thinking: bool | None = None
    tools: list | str | None = None  # the tools the conversation may call, as the record gives them

    def count(self, kind: str) -> int:
        return sum(part["type"] == kind for m in self.messages for part in m["content"])


def check_messages(messages) -> Conversation:
    """Validated messages in the parts form; BadSample (``bad_message``, ``empty_text``) otherwise."""
    if not isinstance(messages, list) or not messages:
        raise BadSample("empty_text", "messages is empty")
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise BadSample("bad_message", f"message {message!r} needs a role of {', '.join(ROLES)}")
        parts = message.get("content")
        if not isinstance(parts, list) or not all(isinstance(p, dict) and p.get("type") in ("text", "image", "video")
                                                  for p in parts):
            raise BadSample("bad_message", f"the content of message {message!r} is not a list of parts")
        if message["role"] != "user" and any(p["type"] != "text" for p in parts):
            raise BadSample("bad_message", f"only user messages may hold images or videos, not {message['role']}")
        if message.get("tool_calls") and message["role"] != "assistant":
            raise BadSample("bad_message", f"only assistant messages make tool calls, not {message['role']}")
        if message["role"] == "assistant":
            check_think("".join(p["text"] for p in parts), "an answer")
            if message.get("tool_calls"):
                message["tool_calls"] = [{"type": "function", "function": call}
                                         for call in tool_calls(message["tool_calls"], "an answer")]
    return Conversation(messages)


class Vocabulary(Protocol):
    """What the chat format asks of a tokenizer (``data.encoding.tokenizer``): whether it has a piece."""

    def token_id(self, token: str) -> int | None: ...


def chat_format(tokenizer: Vocabulary):
    """The chat format of ``tokenizer``: its template when it has ERNIE's special tokens, plain lines otherwise."""
    if tokenizer.token_id(BEGIN_OF_SENTENCE) is not None and tokenizer.token_id(END_OF_SENTENCE) is not None:
        return TemplateChat(getattr(tokenizer, "chat_template", None) or ERNIE_VL_TEMPLATE)
    return PlainChat()


class PlainChat:
    """``User: ...`` lines; the encoder adds the begin and end tokens."""

    closed = False  # the chunks hold no begin or end token
    prefix = {"system": "System: ", "user": "User: ", "assistant": "Assistant: ", "tool": "Tool: "}

    def chunks(self, conversation: Conversation, open_turn: bool = False) -> list[Chunk]:
        chunks: list[Chunk] = []
        image = video = 0
        for message in conversation.messages:
            trained = message["role"] == "assistant"
            chunks.append(Chunk(text=("\n" if chunks else "") + self.prefix[message["role"]]))
            for part in message["content"]:
                if part["type"] == "image":
                    chunks.append(Chunk(image=image))
                    image += 1
                elif part["type"] == "video":
                    chunks.append(Chunk(video=video))
                    video += 1
                elif part["text"]:
                    chunks.append(Chunk(text=part["text"], loss=trained))
            for call in message.get("tool_calls") or []:
                chunks.append(Chunk(text=" " + json.dumps(call["function"]), loss=True))
        if open_turn:
            return chunks + [Chunk(text="\n" + self.prefix["assistant"])]
        if not any(c.loss and c.text.strip() for c in chunks):
            raise BadSample("empty_text", "no assistant text to train on")
        return chunks


MAX_RENDERED = 16 << 20  # characters a template may write for one conversation
MAX_VALUE = 1 << 20  # elements or characters a template's own '*' may make, digits its '**' may make


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's sandbox, with '*' and '**' bounded: ``'a' * 2e8`` or ``n ** 1e8`` would run for minutes."""

    intercepted_binops = frozenset(["*", "**"])

    def __init__(self, **options):
        super().__init__(**options)
        self.filters["json"] = json.dumps  # Python's JSON text, as ERNIEKit writes a tool list

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(count, int) and len(seq) * count > MAX_VALUE:
                    raise SecurityError(f"the template makes a value of {len(seq) * count} items")
        if operator == "**" and isinstance(left, (int, float)) and isinstance(right, (int, float)):
            if abs(right) * math.log2(max(abs(left), 2)) > MAX_VALUE:
                raise SecurityError(f"the template raises {left} to the power {right}")
        return super().call_binop(context, operator, left, right)


class TemplateChat:
    """A Jinja chat template that writes ERNIE's image and video slots; the rendered text holds the begin and
    end tokens itself."""

    closed = True

    def __init__(self, template: str):
        try:
            self.template = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True).from_string(template)
        except TemplateError as err:
            raise ValueError(f"the chat template cannot be read: {err}") from None

    def render(self, messages: list[dict], add_generation_prompt: bool, enable_thinking: bool | None = None,
               tools=None) -> str:
        """As chat templates expect it: a message of text alone has a string content, one with images or
        videos the list of parts. ``enable_thinking`` reaches the template unless None, so that a template
        testing whether it is defined renders as it would without it."""
        shown = [{"role": m["role"], "content": _text_only(m["content"]),
                  **({"tool_calls": m["tool_calls"]} if m.get("tool_calls") else {})} for m in messages]
        extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        if tools:
            extra["tools"] = tools
        written, size = [], 0
        try:
            for piece in self.template.generate(messages=shown, add_generation_prompt=add_generation_prompt,
                                                bos_token=BEGIN_OF_SENTENCE, eos_token=END_OF_SENTENCE,
                                                **extra):
                size += len(piece)
                if size > MAX_RENDERED:
                    raise SecurityError(f"the template writes more than {MAX_RENDERED} characters")
                written.append(piece)
        except Exception as err:  # whatever a template raises (1/0, a runaway macro, a range too big): its failure
            raise BadSample("chat_template_error", f"the chat template failed on this conversation: "
                                                   f"{type(err).__name__}: {err}") from None
        return "".join(written)

    def chunks(self, conversation: Conversation, open_turn: bool = False) -> list[Chunk]:
        messages, tools = conversation.messages, conversation.tools
        # the same options for the whole text and for each answer's rendering; training passes thinking on only:
        # its off is the plain form, where no turn opens with the empty block
        thinking = conversation.enable_thinking if open_turn else (True if conversation.enable_thinking else None)
        options: dict[str, Any] = {"enable_thinking": thinking, "tools": tools}
        text = self.render(messages, add_generation_prompt=open_turn, **options)
        trained = [] if open_turn else self._answers(messages, text, options)
        if not open_turn and not trained:
            raise BadSample("empty_text", "no assistant text to train on")
        pieces = re.split(f"({re.escape(IMAGE_SLOT)}|{re.escape(VIDEO_SLOT)})", text)
        slots = [p for p in pieces if p in (IMAGE_SLOT, VIDEO_SLOT)]
        if slots.count(IMAGE_SLOT) != conversation.count("image") or \
                slots.count(VIDEO_SLOT) != conversation.count("video"):
            raise BadSample("chat_template_error", f"the chat template wrote {len(slots)} image and video slots for "
                                                   f"{conversation.count('image')} images and "
                                                   f"{conversation.count('video')} videos")
        chunks, start, image, video = [], 0, 0, 0
        for piece in pieces:
            size = len(piece.encode("utf-8"))
            if piece == IMAGE_SLOT:
                chunks.append(Chunk(image=image))
                image += 1
            elif piece == VIDEO_SLOT:
                chunks.append(Chunk(video=video))
                video += 1
            elif piece:
                spans = [(max(b, start) - start, min(e, start + size) - start) for b, e in trained
                         if b < start + size and e > start]
                chunks.append(Chunk(text=piece, trained_bytes=spans))
            start += size
        return chunks

    def _answers(self, messages: list[dict], text: str, options: dict) -> list[tuple[int, int]]:
        """Byte spans of ``text`` that are assistant answers: what rendering each answer adds to the
        conversation before it with the generation prompt, less an empty think block opening it."""
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True, **options)
            through = self.render(messages[: i + 1], add_generation_prompt=False, **options)
            if not (text.startswith(through) and through.startswith(before)):
                raise BadSample("chat_template_error", "the chat template does not render a conversation as "
                                                       "the conversation before each answer plus the answer")
            answer = through[len(before):]
            if answer.startswith(EMPTY_THINK):
                before += EMPTY_THINK
            if through[len(before):].strip():
                spans.append((len(before.encode("utf-8")), len(through.encode("utf-8"))))
        return spans


def _text_only(parts: list[dict]):
    return "".join(p["text"] for p in parts) if all(p["type"] == "text" for p in parts) else parts
