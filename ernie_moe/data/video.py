"""Video files as frames, sampled as ERNIE-4.5-VL's processor samples them.

Decoding needs PyAV (``pip install av``, the ``video`` extra); without it a video file is a counted skip
(``video_decoder_missing``) and videos can still be given as lists of frame files. ERNIE's processor also draws
each frame's timestamp into its corner with a font it ships; this reader leaves the frames as decoded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .sample import BadSample


@dataclass(frozen=True)
class FrameSampling:
    fps: float = 2.0  # frames per second of video kept ...
    min_frames: int = 16  # ... but at least this many ...
    max_frames: int = 180  # ... and at most this many


ERNIE_SAMPLING = FrameSampling()  # ERNIE-4.5-VL's processor's defaults


def frame_indices(num_frames: int, duration_s: float, sampling: FrameSampling) -> list[int]:
    """ERNIE's choice: ``duration x fps`` frames, clamped to [min, max] and to the video's length, the middle
    frame of each of that many equal intervals."""
    wanted = int(duration_s * sampling.fps)
    wanted = min(max(wanted, sampling.min_frames), sampling.max_frames)
    count = min(wanted, num_frames)
    bounds = np.linspace(0, num_frames, count + 1).astype(int)
    return [int((start + end - 1) // 2) for start, end in zip(bounds[:-1], bounds[1:])]


def read_video(path: Path, sampling: FrameSampling) -> np.ndarray:
    """The sampled frames of a video file, ``[T, H, W, 3]`` uint8."""
    try:
        import av
    except ImportError:
        raise BadSample("video_decoder_missing", f"video '{path}': reading video files needs PyAV (pip install av); "
                                                 "or give the video as a list of frame files") from None
    if not path.is_file():
        raise BadSample("missing_video", f"video '{path}' does not exist")
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            rate = float(stream.average_rate or 0)
            total = stream.frames or sum(1 for _ in container.decode(stream))  # a container may not say
            if not total or rate <= 0:
                raise BadSample("corrupt_video", f"video '{path}' has no frames or no frame rate")
            wanted = set(frame_indices(total, total / rate, sampling))
            container.seek(0)
            # only the sampled frames are converted and kept: a long video is not held whole
            frames = [f.to_ndarray(format="rgb24") for i, f in enumerate(container.decode(stream)) if i in wanted]
    except (av.error.FFmpegError, IndexError, ValueError, OSError) as err:
        raise BadSample("corrupt_video", f"video '{path}' cannot be decoded: {err}") from None
    if len(frames) != len(wanted):
        raise BadSample("corrupt_video", f"video '{path}': {len(frames)} of the {len(wanted)} sampled frames decode")
    return np.stack(frames)
