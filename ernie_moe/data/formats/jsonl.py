"""Real data: one JSON object per line, with image and video paths relative to the file.

Each record is a caption, a chat ``messages`` list or one of ERNIEKit's SFT shapes (``data.formats.erniekit``),
recognised by its keys unless ``data.format`` names one::

    {"image": "cat.jpg", "text": "a cat on a mat"}                       # caption (or "images": [...])
    {"images": ["a.jpg"], "messages": [{"role": "user", "content": "<image>\\nWhat is this?"},
                                       {"role": "assistant", "content": "A cat."}]}

Only caption text and assistant turns are trained on. ``<image>`` marks where each image goes in a chat, and
``<video>`` each video of ``"videos"`` (a video is a list of frame files); images without a marker go at the
start of the first user turn. A message's content may also be a list of parts, as PaddleFormers and Hugging Face
chat messages are written: ``{"type": "text", "text": ...}``, ``{"type": "image", "image": "a.jpg"}``,
``{"type": "image_url", "image_url": {"url": "a.jpg"}}`` or ``{"type": "video", "video": ["f0.jpg", ...]}``;
the images and videos are then those of the parts, in order.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from array import array
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from ...paths import is_url, not_a_file
from .chat import check_messages
from .erniekit import is_erniekit, lay_out, record_thinking
from .kept import default_index_dir, keep_array, kept_array
from .sample import BadSample, Chunk, DataError, Sample, is_unread, unread
from .video import ERNIE_VIDEO_READING, VideoReading, read_video, stack_frames, stamp_frames

IMAGE_MARK, VIDEO_MARK = "<image>", "<video>"


def record_format(record: dict) -> str:
    """The shape a record is written in, from its keys."""
    if is_erniekit(record):
        return "erniekit"
    if "messages" in record:
        return "messages"
    return "document" if "texts" in record else "caption"


class JsonlDataset:
    def __init__(self, path: str, max_pixels: int = 50_000_000, reading: VideoReading = ERNIE_VIDEO_READING,
                 record_shape: str = "auto", enable_thinking: bool = False, index_dir: str = ""):
        """``record_shape``: ``auto`` or the one shape kept (``data.format``: a record in another is a counted skip);
        ``enable_thinking``: the Thinking model's conversation form, where a record does not say; ``index_dir``:
        where the file's offsets are kept (``data.index_dir``)."""
        self.path = Path(path)
        self.max_pixels, self.video_reading = max_pixels, reading
        self.record_shape, self.enable_thinking = record_shape, enable_thinking
        self.root = self.path.parent
        self._header_only = False  # set by each sample_of call: whether its images are read or sized
        self._kept: Path | None = None  # the file the offsets are memory-mapped from, if they are kept
        self.offsets = self._open(index_dir)

    def _open(self, index_dir: str) -> np.ndarray:
        """The record offsets, read back memory-mapped from ``index_dir`` when kept there for this file (its path,
        size and modification time), else found by :meth:`_scan` and kept: a later run, each rank and each data
        worker share one copy in the page cache instead of scanning the file and holding their own."""
        try:
            stat = os.stat(self.path)
        except OSError as err:
            raise DataError(f"{self.path} cannot be read: {err.strerror or err}") from None
        name = hashlib.sha256(repr((str(self.path.resolve()), _identity(stat))).encode()).hexdigest()[:32]
        kept = Path(index_dir or default_index_dir()) / "offsets" / f"{name}.npy"
        self._kept = kept
        offsets = kept_array(kept, np.int64, sealed=True)
        if offsets is not None:
            self.identity_stat = _identity(stat)
            return offsets
        offsets = self._scan()
        if self.identity_stat != _identity(stat) or not keep_array(kept, offsets, sealed=True):
            self._kept = None
        return offsets

    def __getstate__(self) -> dict:  # a data worker maps the kept offsets itself instead of receiving a copy
        state = dict(self.__dict__)
        if self._kept is not None:
            state["offsets"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.offsets is None:
            self.offsets = kept_array(self._kept, np.int64, sealed=True, check=False)  # the parent checked it
            if self.offsets is None:
                raise DataError(f"the kept offsets of {self.path} ({self._kept}) cannot be read")

    def _scan(self) -> np.ndarray:
        """The offset of each record's line (blank lines are none), as an array: 8 bytes a record."""
        offsets = array("q")
        with open(self.path, "rb") as f:
            self.identity_stat = _identity(os.fstat(f.fileno()))
            offset = 0
            for line in f:
                if line.strip():
                    offsets.append(offset)
                offset += len(line)
        return np.frombuffer(offsets, np.int64) if offsets else np.zeros(0, np.int64)

    def __len__(self) -> int:
        return len(self.offsets)

    def _open_unchanged(self):
        """The data file, opened; DataError when it is not the file this run indexed, or is gone."""
        try:
            f = open(self.path, "rb")
        except OSError as err:
            raise DataError(f"{self.path} cannot be read now ({err.strerror or err}): a data file was removed or "
                            "became unreadable during the run") from None
        try:
            self._check_unchanged(os.fstat(f.fileno()))
        except DataError:
            f.close()
            raise
        return f

    def _check_unchanged(self, stat=None) -> None:
        """DataError when the file is not the one this run indexed (its offsets would read garbage)."""
        try:
            stat = stat or os.stat(self.path)
        except OSError as err:
            raise DataError(f"{self.path} cannot be read now ({err.strerror or err}): a data file was removed or "
                            "became unreadable during the run") from None
        if _identity(stat) != self.identity_stat:
            raise DataError(f"{self.path} changed while this run reads it (its size or modification time is not what "
                            "it was when the run opened it); leave data files alone during a run")

    def _line(self, index: int) -> bytes:
        with self._open_unchanged() as f:
            f.seek(int(self.offsets[index]))
            return f.readline()

    def _record(self, index: int) -> tuple[dict, str]:
        """Record ``index`` and where it is, for messages."""
        where = f"line {index + 1}"
        return parse_record(self._line(index), where), where

    def __getitem__(self, index: int) -> Sample:
        return self.sample_of(*self._record(index))

    def shapes(self, index: int) -> Sample:
        """Sample ``index`` with only its images' sizes read (their headers), not their pixels (``sample.unread``):
        what its encoded length needs. A video file is decoded whole to count its frames."""
        return self.sample_of(*self._record(index), header_only=True)

    def identity(self) -> dict:
        """What the samples depend on: the file as this run opened it and how its records are read."""
        return {type(self).__name__: str(self.path.resolve()), "size_mtime": list(self.identity_stat),
                "max_pixels": self.max_pixels, "video_reading": repr(self.video_reading), "format": self.record_shape,
                "thinking": self.enable_thinking}

    def sample_of(self, record: dict, where: str, header_only: bool = False) -> Sample:
        """A parsed record as a sample, its images and videos read (``header_only``: their sizes alone)."""
        self._header_only = header_only
        shape = record_format(record)
        if self.record_shape not in ("auto", shape):
            raise BadSample("wrong_format", f"{where} is a {shape} record, but data.format is {self.record_shape}")
        if shape == "erniekit":
            layout = lay_out(record, where, self.enable_thinking)
            return Sample(images=[self._load_image(p) for p in layout.images],
                          videos=[self._load_frames(v, t) for v, t in zip(layout.videos, layout.video_times)],
                          chunks=layout.chunks, closed=True)
        if shape == "document":
            return self._document(record, where)
        images = images_of(record, where)
        if shape == "messages":
            conversation, images, videos = parse_messages(record["messages"], images, record.get("videos", []))
            conversation.enable_thinking = record_thinking(record, where, self.enable_thinking)
            tools = record.get("tools")
            if tools is not None and not isinstance(tools, (list, str)):
                raise BadSample("bad_record", f"{where}: tools must be a list or JSON text, not {tools!r}")
            conversation.tools = tools or None
            return Sample(images=[self._load_image(p) for p in images],
                          videos=[self._load_video(v) for v in videos], conversation=conversation)
        text = record.get("text", "")
        if not isinstance(text, str) or not text.strip():
            raise BadSample("empty_text", f"{where} has no text")
        chunks = [Chunk(image=i) for i in range(len(images))] + [Chunk(text=text.strip(), loss=True)]
        return Sample(images=[self._load_image(p) for p in images], chunks=chunks)

    def _document(self, record: dict, where: str) -> Sample:
        """An interleaved image-text document (OBELICS' shape: ``texts`` and ``images`` side by side, each place
        holding a text or an image): every text token trained on, no chat template."""
        texts, images = record.get("texts"), record.get("images", [])
        if not isinstance(texts, list) or not isinstance(images, list) or len(texts) != len(images) or not all(
                (isinstance(t, str)) != (isinstance(i, (str, bytes))) and (t is None or i is None)
                for t, i in zip(texts, images)):
            raise BadSample("bad_document", f"{where}: a document's texts and images must be lists of one length, "
                                            "each place holding a text or an image (the other null)")
        chunks: list[Chunk] = []
        pictures: list = []
        for text, image in zip(texts, images):
            if image is not None:
                chunks.append(Chunk(image=len(pictures)))
                pictures.append(image)
            elif text.strip():
                chunks.append(Chunk(text=text if not chunks or chunks[-1].image >= 0 else "\n\n" + text, loss=True))
        if not any(c.loss for c in chunks):
            raise BadSample("empty_text", f"{where} has no text")
        return Sample(images=[self._load_image(p) for p in pictures], chunks=chunks)

    def _load_image(self, source) -> np.ndarray:
        """An image named by a record (a path under the file's folder), or its bytes (a shard's member)."""
        if isinstance(source, bytes):
            return decode_image(io.BytesIO(source), f"{self.path.name} member", self.max_pixels, self._header_only)
        return load_image(local(self.root, source, "image"), self.max_pixels, self._header_only)

    def _load_video(self, source) -> np.ndarray:
        return load_video(self.root, source, self.max_pixels, self.video_reading, self._header_only)

    def _load_frames(self, frames: list[str], times: list[float] | None) -> np.ndarray:
        """Frame files as a video, each with its time drawn on it as ERNIE draws it when the frames carry their
        times and ``data.video_timestamp_font`` names a font."""
        video = self._load_video(frames)
        font = self.video_reading.timestamp_font
        return video if times is None or not font or is_unread(video) else stamp_frames(video, times, font)


def _identity(stat) -> tuple[int, int]:
    return stat.st_size, stat.st_mtime_ns


def parse_record(line: bytes | str, where: str) -> dict:
    """One JSONL line as a record; BadSample for text that is not UTF-8 (``bad_utf8``: it would be trained on as
    replacement characters), not JSON or nested past what the parser takes (``bad_json``), or not an object."""
    try:
        text = line.decode("utf-8").removeprefix("\ufeff") if isinstance(line, bytes) else line
    except UnicodeDecodeError as err:
        raise BadSample("bad_utf8", f"{where} is not UTF-8 text: {err}") from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        raise BadSample("bad_json", f"{where}: {err}") from None
    except RecursionError:
        raise BadSample("bad_json", f"{where} is nested too deep to read") from None
    if not isinstance(record, dict):
        raise BadSample("bad_json", f"{where} is not a JSON object")
    try:  # a \\ud800 escape is valid JSON but no text: no tokenizer can take it
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as err:
        raise BadSample("bad_utf8", f"{where} holds a character that is not text: {err.reason}") from None
    return record


def images_of(record: dict, where: str) -> list[str]:
    """The image paths of a record (``"image"``, or ``"images"``: a path or a list of them); BadSample
    (``bad_images``, naming ``where``) when they are something else."""
    images = record.get("images", [record["image"]] if "image" in record else [])
    images = [images] if isinstance(images, str) else images
    if not isinstance(images, list) or not all(isinstance(p, (str, bytes)) for p in images):
        raise BadSample("bad_images", f"{where}: images must be a path or a list of paths, not {images!r}")
    return images


def load_image(path: Path, max_pixels: int, header_only: bool = False) -> np.ndarray:
    """An image file as RGB ``uint8 [H, W, 3]`` (``header_only``: its size alone, ``sample.unread``); BadSample
    when it is missing, too large or undecodable."""
    problem = not_a_file(path)
    if problem is not None:
        raise BadSample("missing_image", f"image '{str(path)[:300]}' {problem}")
    return decode_image(path, str(path), max_pixels, header_only)


def as_ernie_rgb(image: Image.Image) -> Image.Image:
    """RGB as ERNIE-4.5-VL's processor prepares an image: 16-bit grey brought to 8 bits, an image with any
    transparent pixel pasted on white (``convert("RGB")`` alone keeps whatever colour the transparent pixels
    hide), the EXIF orientation left as stored (the processor reads it and does not apply it)."""
    if image.mode == "I;16":
        image = image.point(lambda i: i * (1 / 256)).convert("L")
    if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        if rgba.getchannel("A").getextrema()[0] < 255:  # type: ignore[operator]  # one band's (low, high)
            white = Image.new("RGBA", rgba.size, (255, 255, 255))
            white.paste(rgba, (0, 0), rgba)
            image = white
    return image.convert("RGB")


def decode_image(source, name: str, max_pixels: int, header_only: bool = False) -> np.ndarray:
    """An image file or file object (``name`` in messages) as RGB ``uint8 [H, W, 3]``; BadSample when it is
    too large or undecodable."""
    try:
        with Image.open(source) as image:  # reads the header only: the size is known before decoding
            width, height = image.size
            if width * height > max_pixels:
                raise BadSample("image_too_large", f"image '{name}' has {width} x {height} pixels, more than "
                                                   f"data.max_image_pixels ({max_pixels})")
            return unread((height, width, 3)) if header_only else np.asarray(as_ernie_rgb(image))
    except Image.DecompressionBombError as err:  # Pillow's own cap, met before ours in the header
        raise BadSample("image_too_large", f"image '{name}': {err}") from None
    except UnidentifiedImageError:
        raise BadSample("corrupt_image", f"image '{name}' cannot be decoded: not an image format Pillow reads") \
            from None
    except (OSError, ValueError) as err:
        raise BadSample("corrupt_image", f"image '{name}' cannot be decoded: {err}") from None


def local(root: Path, name, kind: str) -> Path:
    """``name`` (an image, a video or a frame of a record) as a file under ``root``; BadSample for a URL, which
    is not downloaded."""
    if is_url(str(name)):
        raise BadSample(f"missing_{'image' if kind == 'frame' else kind}",
                        f"{kind} '{str(name)[:300]}' is a URL: records name local files (download it first)")
    return root / str(name)


def load_video(root: Path, source, max_pixels: int, reading: VideoReading = ERNIE_VIDEO_READING,
               header_only: bool = False) -> np.ndarray:
    """A video given as its frame files or as a video file (relative to ``root``), ``[T, H, W, 3]`` uint8
    (``header_only``: its size alone)."""
    if isinstance(source, str):
        video = read_video(local(root, source, "video"), reading, max_pixels)
        return unread(video.shape) if header_only else video
    return stack_frames([load_image(local(root, f, "frame"), max_pixels, header_only) for f in source],
                        f"{source[0]}, ...")


def parse_messages(messages, images: list[str], videos) -> tuple:
    """(the conversation in parts form, its image paths, its videos as lists of frame paths), in order.

    String contents place ``images`` and ``videos`` at their ``<image>`` / ``<video>`` markers; content parts
    carry their own files; a video is a list of frame files or a video file. Unknown parts, a ``<video>``
    without a video and images given both ways are counted skips."""
    if messages and not isinstance(messages, list):  # a Parquet column of JSON text, say: not a list
        raise BadSample("bad_message", f"messages must be a list of messages, not a {type(messages).__name__}")
    if not messages:
        raise BadSample("empty_text", "messages is empty")
    parts_given = any(isinstance(m, dict) and isinstance(m.get("content"), list) for m in messages)
    if parts_given and (images or videos):
        raise BadSample("bad_images", "images or videos given both as content parts and as lists")
    if not isinstance(videos, list) or not all(_frame_list(v) for v in videos):
        raise BadSample("bad_video", f"videos must be a list of videos (files or frame-file lists), not {videos!r}")
    out: list[dict] = []
    image_paths: list = []
    video_frames: list = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            parts = _marked_parts(content)
        elif isinstance(content, list):
            parts = [_part(p, image_paths, video_frames) for p in content]
        else:
            raise BadSample("bad_message", f"message {message!r} needs a string content or a list of parts")
        calls = message.get("tool_calls")
        out.append({"role": message.get("role"), "content": parts, **({"tool_calls": calls} if calls else {})})
    marks = [p["type"] for m in out for p in m["content"] if p["type"] != "text"]
    if parts_given and (marks.count("image"), marks.count("video")) != (len(image_paths), len(video_frames)):
        raise BadSample("image_count_mismatch", f"{IMAGE_MARK} or {VIDEO_MARK} markers in a string content beside "
                                                "content parts: only parts name files there")
    if not parts_given:
        if marks.count("video") != len(videos):
            raise BadSample("video_without_frames", f"{marks.count('video')} {VIDEO_MARK} markers but "
                                                    f"{len(videos)} videos")
        unmarked = len(images) - marks.count("image")
        if unmarked < 0:
            raise BadSample("image_count_mismatch", f"{marks.count('image')} {IMAGE_MARK} markers but "
                                                    f"{len(images)} images")
        first_user = next((m for m in out if m["role"] == "user"), None)
        if unmarked and first_user is None:
            raise BadSample("image_count_mismatch", "images without a user turn to show them in")
        if unmarked and first_user is not None:
            first_user["content"][:0] = [{"type": "image"}] * unmarked
        image_paths, video_frames = list(images), list(videos)
    return check_messages(out), image_paths, video_frames


def _marked_parts(text: str) -> list[dict]:
    parts = []
    for piece in re.split(f"({re.escape(IMAGE_MARK)}|{re.escape(VIDEO_MARK)})", text):
        if piece == IMAGE_MARK:
            parts.append({"type": "image"})
        elif piece == VIDEO_MARK:
            parts.append({"type": "video"})
        elif piece:
            parts.append({"type": "text", "text": piece})
    return parts


def _frame_list(value) -> bool:
    """A video file, or a non-empty list of frame files."""
    return (isinstance(value, str) and bool(value)) or (
        isinstance(value, list) and bool(value) and all(isinstance(f, str) for f in value))


def _source(part: dict, kind: str):
    """What an image or video part names, under any of the keys chat formats use (``{"url": ...}`` unwrapped)."""
    source = part.get(kind) or part.get("path") or part.get("url") or part.get(f"{kind}_url")
    return source.get("url") if isinstance(source, dict) else source


def _part(part, image_paths: list[str], video_frames: list[list[str]]) -> dict:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise BadSample("bad_message", f"text part {str(part)[:200]} holds no text (its text must be a string)")
        return {"type": "text", "text": part["text"]}
    if kind in ("image", "image_url"):
        source = _source(part, "image")
        if not isinstance(source, str):
            raise BadSample("bad_message", f"image part {part!r} names no image file")
        image_paths.append(source)
        return {"type": "image"}
    if kind in ("video", "video_url"):
        source = _source(part, "video")
        if not _frame_list(source):
            raise BadSample("video_without_frames", f"video part {part!r} names no video file or frames")
        video_frames.append(source)
        return {"type": "video"}
    raise BadSample("bad_message", f"unknown content part {str(part)[:200]} (text, image, image_url or video)")
