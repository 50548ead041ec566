"""ERNIEKit's SFT records, encoded as ERNIEKit encodes them.

Two shapes::

    {"image_info": [{"image_url": "a.jpg", "matched_text_index": 0}],                      # VL SFT
     "text_info": [{"text": "What is this?", "tag": "mask"}, {"text": "A cat.", "tag": "no_mask"}]}
    {"system": "Be brief.", "src": ["Hi", "And?"], "tgt": ["Hello.", "Bye."], "label": [0, 1]}   # text SFT

``text_info`` alternates runs of ``mask`` texts (the user's turn) and ``no_mask`` texts (the answer); an answer
text with ``"label": 0`` is not trained on; each image goes before the text ``matched_text_index`` names (an
image that names an answer's first text closes the question before it). Frames with ``"image_type": "video"``
sharing a ``video_uid`` are one video. ``"is_system": 1`` makes the first question the system text (and drops
its answer). ``tools``, an answer text's ``tool_calls`` and a ``"tool_response": true`` text are ERNIEKit's
tool conversation.

ERNIEKit's chat layout, each piece tokenized on its own as ERNIEKit does: ``<|begin_of_sentence|>`` (the
tokenizer's cls token), the tool list, then per turn ``User: `` + ``Picture N:`` and each image + the texts +
``\\nAssistant: ``, the answer's texts and ``<|end_of_sentence|>`` (its sep token), trained with the answer. With
thinking on, a conversation whose answers hold no ``<think>`` ... ``</think>`` gets the empty think block before
its last answer, and then only that last answer trains (ERNIEKit's rule: a non-thinking conversation teaches
its final turn).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .sample import BadSample, Chunk

# ERNIE-4.5's sentence markers: the chat template opens a conversation and closes each answer with them
BEGIN_OF_SENTENCE, END_OF_SENTENCE = "<|begin_of_sentence|>", "<|end_of_sentence|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
EMPTY_THINK = "<think>\n\n</think>\n\n"
TAGS = ("mask", "no_mask")
# ERNIEKit's tool text, which the built-in chat template writes too: the tool list's and an output's brackets,
# and a call's three pieces around its name and its arguments
TOOL_LIST = ("\n<tool_list>\n", "\n</tool_list>\n")
TOOL_OUTPUT = ("\n<tool_output>\n", "\n</tool_output>\n")
CALL = ('<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>\n")


def is_erniekit(record: dict) -> bool:
    return "text_info" in record or ("src" in record and "tgt" in record)


@dataclass
class Layout:
    """A record as chunks (begin and end tokens included), with the files its images and videos name."""

    chunks: list[Chunk]
    images: list[str] = field(default_factory=list)
    videos: list[list[str]] = field(default_factory=list)
    video_times: list[list[float] | None] = field(default_factory=list)  # each frame's time_stamp, where given


def check_think(text: str, where: str) -> bool:
    """Whether ``text`` holds a whole think block; BadSample (``unclosed_think``) for tags that do not pair up."""
    opened, closed = text.count(THINK_OPEN), text.count(THINK_CLOSE)
    if opened != closed or (opened and text.index(THINK_OPEN) > text.index(THINK_CLOSE)):
        raise BadSample("unclosed_think", f"{where}: {THINK_OPEN} and {THINK_CLOSE} do not pair up in {text[:80]!r}")
    return opened > 0


def record_thinking(record: dict, where: str, default: bool | None) -> bool | None:
    """The record's own ``enable_thinking``, else ``default``; BadSample (``bad_record``) for a value that is not
    true or false."""
    thinking = record.get("enable_thinking", default)
    if thinking is not None and not isinstance(thinking, bool):
        raise BadSample("bad_record", f"{where}: enable_thinking must be true or false, not {thinking!r}")
    return thinking


def lay_out(record: dict, where: str, enable_thinking: bool) -> Layout:
    """An ERNIEKit record (either shape) as chunks; BadSample for records ERNIEKit would refuse or misread."""
    thinking = record_thinking(record, where, enable_thinking)
    if "text_info" in record:
        texts, media, system = _vl_texts(record, where)
    else:
        texts, media = _text_sft_texts(record, where), {}
        given = record.get("system") or ""
        if not isinstance(given, str):
            raise BadSample("bad_record", f"{where}: system must be text, not {given!r}")
        system = [given.strip()] if given.strip() else []
    turns = _turns(texts, media, where)
    answers = "".join(t["text"] for t in texts if t["tag"] == "no_mask")
    if thinking and not check_think(answers, where):
        # ERNIEKit's rule for a non-thinking conversation: the empty block opens the last turn, which alone trains
        turns[-1].insert(0, {"text": EMPTY_THINK, "tag": "mask"})
        for n, turn in enumerate(turns):
            for part in turn:
                if isinstance(part, dict):
                    part["label"] = int(n == len(turns) - 1)
    return _layout(turns, record.get("tools"), system, where)


def _text(item, where: str, index: int) -> dict:
    if not isinstance(item, dict) or not isinstance(item.get("text"), str):
        raise BadSample("bad_record", f"{where}: text_info[{index}] must be an object with a text")
    if item.get("tag") not in TAGS:
        raise BadSample("bad_tag", f"{where}: text_info[{index}] has tag {item.get('tag')!r}, not mask or no_mask")
    label = item.get("label", 1)
    if label not in (0, 1):
        raise BadSample("bad_record", f"{where}: text_info[{index}] has label {label!r}, not 0 or 1")
    check_think(item["text"], where)
    return {**item, "text": item["text"].strip(), "label": label}


def _vl_texts(record: dict, where: str) -> tuple[list[dict], dict[int, list[dict]], list[str]]:
    """(the texts, stripped as ERNIEKit strips them; the images and video frames by the text they precede;
    the system texts: the first question's with ``is_system``)."""
    text_info, image_info = record["text_info"], record.get("image_info") or []
    if not isinstance(text_info, list) or not text_info:
        raise BadSample("empty_text", f"{where}: text_info is empty")
    if not isinstance(image_info, list):
        raise BadSample("bad_images", f"{where}: image_info must be a list, not {image_info!r}")
    texts = [_text(item, where, i) for i, item in enumerate(text_info)]
    media: dict[int, list[dict]] = {}
    for i, image in enumerate(image_info):
        url = image.get("image_url") if isinstance(image, dict) else None
        if not isinstance(url, str) or not url:
            raise BadSample("bad_images", f"{where}: image_info[{i}] names no image_url")
        index = image.get("matched_text_index", 0)
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(texts):
            raise BadSample("image_index_past_text", f"{where}: image_info[{i}] has matched_text_index {index!r}, "
                                                     f"but text_info has {len(texts)} texts")
        if image.get("image_type", "image") not in ("image", "video"):
            raise BadSample("bad_images", f"{where}: image_info[{i}] has image_type {image.get('image_type')!r}")
        stamp = image.get("time_stamp", 0.0)
        if isinstance(stamp, bool) or not isinstance(stamp, (int, float)) or not 0 <= stamp < float("inf"):
            raise BadSample("bad_images", f"{where}: image_info[{i}] has time_stamp {stamp!r}, not seconds")
        media.setdefault(index, []).append(image)
    system = []
    if record.get("is_system"):
        first_answer = next((n for n, t in enumerate(texts) if t["tag"] == "no_mask"), len(texts))
        if any(index < first_answer for index in media):
            raise BadSample("bad_images", f"{where}: an image in the system text")
        system = [t["text"] for t in texts[:first_answer]]
        rest = next((n for n in range(first_answer, len(texts)) if texts[n]["tag"] == "mask"), len(texts))
        if rest < len(texts) and any(first_answer <= index < rest for index in media):
            raise BadSample("bad_images", f"{where}: an image in the answer to the system text")
        media = {index - rest: images for index, images in media.items() if index >= rest}
        texts = texts[rest:]
        if not texts:
            raise BadSample("empty_text", f"{where}: nothing after the system text")
    return texts, media, system


def _text_sft_texts(record: dict, where: str) -> list[dict]:
    """``src`` / ``tgt`` / ``label`` as question and answer texts, with ERNIEKit's reader's checks."""
    src, tgt = ([v] if isinstance(v, str) else v for v in (record["src"], record["tgt"]))
    label = record.get("label", [1] * len(src) if isinstance(src, list) else None)
    if not all(isinstance(v, list) and all(isinstance(s, str) for s in v) for v in (src, tgt)):
        raise BadSample("bad_record", f"{where}: src and tgt must be texts or lists of texts")
    if len(src) != len(tgt) or not src:
        raise BadSample("bad_turns", f"{where}: {len(src)} src texts but {len(tgt)} tgt texts")
    if not isinstance(label, list) or len(label) != len(src) or any(v not in (0, 1) for v in label):
        raise BadSample("bad_turns", f"{where}: label must be one 0 or 1 per turn, not {label!r}")
    if any(not t.strip() for t in tgt):
        raise BadSample("empty_text", f"{where}: an empty tgt text")
    texts = []
    for n, (question, answer, trained) in enumerate(zip(src, tgt, label)):
        texts += [_text({"text": question, "tag": "mask"}, where, 2 * n),
                  _text({"text": answer, "tag": "no_mask", "label": trained}, where, 2 * n + 1)]
    return texts


def _turns(texts: list[dict], media: dict[int, list[dict]], where: str) -> list[list]:
    """The texts as alternating turns (question, answer, ...), each a list of texts and lists of images."""
    if texts[0]["tag"] != "mask":
        raise BadSample("bad_turns", f"{where}: the first text is an answer (tag no_mask); it must be a question")
    turns: list[list] = []
    for index, text in enumerate(texts):
        starts = not turns or turns[-1][-1]["tag"] != text["tag"]
        if starts:
            turns.append([])
        if index in media:
            if text["tag"] == "no_mask" and not starts:
                raise BadSample("image_in_answer", f"{where}: an image inside an answer (before text_info[{index}])")
            turns[-2 if text["tag"] == "no_mask" else -1].append(media[index])
        turns[-1].append(text)
    return turns


def tool_calls(calls, where: str) -> list[dict]:
    """A record's tool calls (a list, one call, or JSON text of either; OpenAI's ``{"type": "function",
    "function": ...}`` form too) as ``{"name", "arguments"}`` each, the arguments as JSON text; BadSample
    (``bad_tool_call``) for text that is not JSON or a call without a name and arguments."""
    if isinstance(calls, str):
        try:
            calls = json.loads(calls)
        except json.JSONDecodeError as err:
            raise BadSample("bad_tool_call", f"{where}: tool_calls is not JSON: {err}") from None
    out = []
    for call in calls if isinstance(calls, list) else [calls]:
        if isinstance(call, dict) and call.get("type") == "function":
            call = call.get("function")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or "arguments" not in call:
            raise BadSample("bad_tool_call", f"{where}: a tool call needs a name and arguments, not {call!r}")
        arguments = call["arguments"]
        if isinstance(arguments, str):
            try:
                json.loads(arguments)
            except json.JSONDecodeError as err:
                raise BadSample("bad_tool_call", f"{where}: the arguments of {call['name']!r} are not JSON: "
                                                 f"{err}") from None
        else:
            arguments = json.dumps(arguments)
        out.append({"name": call["name"], "arguments": arguments})
    return out


def _call_pieces(calls, where: str) -> list[str]:
    """ERNIEKit's text of each call: ``<tool_call>\\n{"name": "...", "arguments": ...}\\n</tool_call>\\n``, in
    the five pieces it tokenizes one by one."""
    return [piece for call in tool_calls(calls, where)
            for piece in (CALL[0], call["name"], CALL[1], call["arguments"], CALL[2])]


def _layout(turns: list[list], tools, system: list[str], where: str) -> Layout:
    out = Layout([Chunk(text=BEGIN_OF_SENTENCE)])

    def text(value: str, trained: bool = False):
        if value:
            out.chunks.append(Chunk(text=value, loss=trained))

    if tools:
        text(TOOL_LIST[0])
        text(tools if isinstance(tools, str) else json.dumps(tools))
        text(TOOL_LIST[1])
    if system:
        for piece in system:
            text(piece)
        text("\n")
    for n, turn in enumerate(turns):
        asks = n % 2 == 0
        if asks:
            text("User: ")
        label = 1
        for k, part in enumerate(turn):
            if isinstance(part, list):
                if k + 1 < len(turn) and _is_tool_output(turn[k + 1]):
                    text(TOOL_OUTPUT[0])
                _add_visuals(out, part, where)
                continue
            trained = not asks and part["tag"] == "no_mask"
            if not asks:
                label = part["label"]
                trained = trained and label == 1
            if part.get("tool_calls"):
                for piece in _call_pieces(part["tool_calls"], where):
                    text(piece, trained)
            if _is_tool_output(part):
                if k == 0 or not isinstance(turn[k - 1], list):
                    text(TOOL_OUTPUT[0])
                text(part["text"], trained)
                text(TOOL_OUTPUT[1])
            else:
                text(part["text"], trained)
        if asks:
            text("\nAssistant: ")
        else:
            text(END_OF_SENTENCE, label == 1)
    if not any(c.loss for c in out.chunks):
        raise BadSample("empty_text", f"{where}: no answer text to train on")
    return out


def _add_visuals(out: Layout, images: list[dict], where: str) -> None:
    """A run of images and video frames into ``out``: ``Picture N:`` and each image, ``Video N:`` and each
    video's frames (with their times, where every frame has one)."""
    for kind, files in _visuals(images):
        if kind == "image":
            out.chunks += [Chunk(text=f"Picture {len(out.images) + 1}:"), Chunk(image=len(out.images))]
            out.images.append(files[0]["image_url"])
            continue
        out.chunks += [Chunk(text=f"Video {len(out.videos) + 1}:"), Chunk(video=len(out.videos))]
        out.videos.append([f["image_url"] for f in files])
        times = [f.get("time_stamp") for f in files]
        if any(t is not None for t in times) and None in times:
            raise BadSample("bad_video", f"{where}: some frames of video {len(out.videos)} have a time_stamp and "
                                         "some do not")
        out.video_times.append(None if None in times else [float(t) for t in times if t is not None])


def _is_tool_output(part) -> bool:
    return isinstance(part, dict) and part.get("tool_response") is True


def _visuals(images: list[dict]) -> list[tuple[str, list[dict]]]:
    """Images one by one, and each run of video frames sharing a ``video_uid`` as one video."""
    out: list[tuple[str, list[dict]]] = []
    last_uid = None
    for image in images:
        if image.get("image_type", "image") == "image":
            out.append(("image", [image]))
            last_uid = None
            continue
        uid = image.get("video_uid", "")
        if out and out[-1][0] == "video" and uid == last_uid:
            out[-1][1].append(image)
        else:
            out.append(("video", [image]))
        last_uid = uid
    return out
