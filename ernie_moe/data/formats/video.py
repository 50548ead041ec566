"""Video files as frames, sampled and time-stamped as ERNIE-4.5-VL's processor does it.

Decoding needs PyAV (``pip install av``, the ``video`` extra); without it a video file is a counted skip
(``video_decoder_missing``) and videos can still be given as lists of frame files. ERNIE's processor draws each
decoded frame's time into its top-left corner with a TrueType font (Roboto-Regular); given a font, this reader
draws it the same way, and without one leaves the frames as decoded.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from ...config.schema import VideoReading
from ...paths import not_a_file
from .sample import BadSample, is_unread, unread

ERNIE_VIDEO_READING = VideoReading()  # ERNIE-4.5-VL's processor's defaults


def frame_indices(num_frames: int, duration_s: float, sampling: VideoReading) -> list[int]:
    """ERNIE's choice: ``duration x fps`` frames, clamped to [min, max] and to the video's length, the middle
    frame of each of that many equal intervals."""
    wanted = int(duration_s * sampling.fps)
    wanted = min(max(wanted, sampling.min_frames), sampling.max_frames)
    count = min(wanted, num_frames)
    bounds = np.linspace(0, num_frames, count + 1).astype(int)
    return [int((start + end - 1) // 2) for start, end in zip(bounds[:-1], bounds[1:])]


def clock(seconds: float) -> str:
    """``HH:MM:SS.ss``, as ERNIE's processor writes a frame's time."""
    hours, rest = divmod(seconds, 3600)
    minutes, rest = divmod(rest, 60)
    return f"{int(hours):02d}:{int(minutes):02d}:{rest:05.02f}"


def draw_timestamp(frame: np.ndarray, seconds: float, font_path: str) -> np.ndarray:
    """ERNIE's mark: ``time: HH:MM:SS.ss`` at the top-left corner, black with a white outline, the font a tenth of
    the shorter side high and the outline a tenth of that."""
    from PIL import Image, ImageDraw

    image = Image.fromarray(frame)
    size = int(min(image.size) * 0.1)
    if size < 1:  # a frame under 10 pixels has no room for it
        return frame
    ImageDraw.Draw(image).text((0, 0), "time: " + clock(seconds), font=_font(font_path, size), fill=(0, 0, 0),
                               stroke_width=int(size * 0.1), stroke_fill=(255, 255, 255))
    return np.asarray(image)


@functools.lru_cache(maxsize=8)
def _font(path: str, size: int):
    """A video's frames share one size: the font file is read once, not once per frame."""
    from PIL import ImageFont

    return ImageFont.truetype(path, size)


def read_video(path: Path, reading: VideoReading, max_pixels: int) -> np.ndarray:
    """The sampled frames of a video file, ``[T, H, W, 3]`` uint8, each with its time drawn on it when
    ``reading`` names a font (frame i of a video at r frames per second is at i / r seconds). A video whose
    frames have more than ``max_pixels`` pixels is refused before a frame is converted."""
    try:
        import av
    except ImportError:
        raise BadSample("video_decoder_missing", f"video '{path}': reading video files needs PyAV (pip install av); "
                                                 "or give the video as a list of frame files") from None
    problem = not_a_file(path)
    if problem is not None:
        raise BadSample("missing_video", f"video '{str(path)[:300]}' {problem}")
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            if stream.codec_context is None:
                raise BadSample("corrupt_video", f"video '{path}' names no codec PyAV can decode")
            _check_size(path, stream.codec_context.width, stream.codec_context.height, max_pixels)
            rate = float(stream.average_rate or 0)
            total = stream.frames or sum(1 for _ in container.decode(stream))  # a container may not say
            if not total or rate <= 0:
                raise BadSample("corrupt_video", f"video '{path}' has no frames or no frame rate")
            wanted = set(frame_indices(total, total / rate, reading))
            container.seek(0)
            # only the sampled frames are converted and kept: a long video is not held whole
            frames = []
            for i, frame in enumerate(container.decode(stream)):
                if i in wanted:
                    _check_size(path, frame.width, frame.height, max_pixels)  # a frame may differ from the header
                    frames.append(frame.to_ndarray(format="rgb24"))
    except (av.error.FFmpegError, IndexError, ValueError, OSError) as err:
        raise BadSample("corrupt_video", f"video '{path}' cannot be decoded: {err}") from None
    if len(frames) != len(wanted):
        raise BadSample("corrupt_video", f"video '{path}': {len(frames)} of the {len(wanted)} sampled frames decode")
    stacked = stack_frames(frames, f"'{path}'")
    if reading.timestamp_font:  # every sampled frame decoded, in order
        stacked = stamp_frames(stacked, [i / rate for i in sorted(wanted)], reading.timestamp_font)
    return stacked


def stamp_frames(frames: np.ndarray, seconds: list[float], font_path: str) -> np.ndarray:
    """Each frame with its time drawn on it (:func:`draw_timestamp`)."""
    return np.stack([draw_timestamp(frame, t, font_path) for frame, t in zip(frames, seconds)])


def stack_frames(frames: list[np.ndarray], video: str) -> np.ndarray:
    """A video's frames as one ``[T, H, W, 3]`` array; BadSample (``bad_video``) when they differ in size."""
    if len({f.shape for f in frames}) != 1:
        raise BadSample("bad_video", f"the frames of video {video} differ in size")
    if is_unread(frames[0]):
        return unread((len(frames), *frames[0].shape))
    return np.stack(frames)


def _check_size(path: Path, width: int, height: int, max_pixels: int) -> None:
    if width * height > max_pixels:
        raise BadSample("video_too_large", f"video '{path}' has frames of {width} x {height} pixels, more than "
                                           f"data.max_image_pixels ({max_pixels})")
