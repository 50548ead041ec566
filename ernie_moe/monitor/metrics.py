"""Where metrics go: ``metrics.jsonl`` (one object per logging step) and VisualDL scalars, rank 0 only."""

from __future__ import annotations

import json
import math
from pathlib import Path

from .. import json_files


class MetricsLogger:
    def __init__(self, output_dir: str, visualdl: bool, enabled: bool, resumed_at: int = 0):
        """``resumed_at``: the step a resumed run continues from; the records up to it are kept."""
        self.enabled = enabled
        self.writer = None
        self.file = None
        if not enabled:
            return
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        path = Path(output_dir) / "metrics.jsonl"
        kept = _records_up_to(path, resumed_at) if resumed_at and path.exists() else []
        self.file = open(path, "w")
        self.file.writelines(line + "\n" for line in kept)
        if visualdl:
            from visualdl import LogWriter

            logdir = Path(output_dir) / "visualdl"
            if not resumed_at:
                for stale in logdir.glob("vdlrecords.*.log"):  # an earlier run's curves would mix with this one's
                    stale.unlink()
            self.writer = LogWriter(logdir=str(logdir))

    def log(self, step: int, metrics: dict, prefix: str = "train") -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self.file.write(json_files.dumps(record) + "\n")
        self.file.flush()
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    tag = key if "/" in key else f"{prefix}/{key}"
                    self.writer.add_scalar(tag=tag, value=value, step=step)

    def histogram(self, tag: str, values, step: int) -> None:
        if self.writer is not None:
            self.writer.add_histogram(tag=tag, values=values, step=step, buckets=min(len(values), 10))

    def image(self, tag: str, image, step: int) -> None:
        if self.writer is not None:
            self.writer.add_image(tag=tag, img=image, step=step)

    def text(self, tag: str, text: str) -> None:
        if self.writer is not None:
            self.writer.add_text(tag=tag, text_string=text, step=0)

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.writer is not None:
            self.writer.close()


def _plain(value):
    if hasattr(value, "item"):
        value = value.item()
    return round(value, 8) if isinstance(value, float) else value


def _records_up_to(path: Path, step: int) -> list[str]:
    """The lines of an earlier ``metrics.jsonl`` up to ``step``, to keep on resume. A line that is no record (torn
    by a crash mid-write, blank, not UTF-8, not an object with a step) is dropped: it was never a whole window."""
    kept = []
    for raw in path.read_bytes().splitlines():
        try:
            line = raw.decode("utf-8")
            record = json.loads(line)
        except (UnicodeDecodeError, ValueError, RecursionError):
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            kept.append(line)
    return kept
