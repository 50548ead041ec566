"""Where metrics go: ``metrics.jsonl`` (one object per logging step) and VisualDL, rank 0 only; in the GRPO stage
a few sampled answers of each window too, in ``rollouts.jsonl`` and VisualDL's text page.

VisualDL draws the runs that share a tag in one chart, so each rank's figures (``memory/rank{r}/<name>`` in
``metrics.jsonl``) go to a run of their own, ``visualdl/rank{r}``, under the tag ``memory/<name>``: one chart per
quantity with a line per rank, on one y axis. Everything else is the run ``run`` in ``visualdl/`` itself.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, TextIO

import yaml

from .. import json_files
from ..paths import check_output, open_output

PER_RANK = re.compile(r"memory/rank(\d+)/(.+)")


class MetricsLogger:
    def __init__(self, output_dir: str, visualdl: bool, enabled: bool, resumed_at: int = 0):
        """``resumed_at``: the step a resumed run continues from; the records up to it are kept."""
        self.enabled, self.output_dir, self.resumed_at = enabled, Path(output_dir), resumed_at
        self.writer: Any = None  # VisualDL's LogWriter, when logging.visualdl
        self.rank_writers: dict[int, Any] = {}
        self.file: TextIO | None = None  # metrics.jsonl, on the rank that logs
        self.rollouts: TextIO | None = None  # rollouts.jsonl, opened at the first answers logged
        if not enabled:
            return
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        path = Path(output_dir) / "metrics.jsonl"
        self.file = _reopened(path, resumed_at)
        if visualdl:
            self.logdir = Path(output_dir) / "visualdl"
            if not resumed_at:  # an earlier run's curves would mix with this one's
                for stale in [*self.logdir.glob("vdlrecords.*.log"), *self.logdir.glob("rank*/vdlrecords.*.log")]:
                    stale.unlink()
            self.writer = _writer(self.logdir, "run")

    def log(self, step: int, metrics: dict, prefix: str = "train") -> None:
        if not self.enabled or self.file is None:
            return
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self.file.write(json_files.dumps(record) + "\n")
        self.file.flush()
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    writer, tag = self._route(key, prefix)
                    writer.add_scalar(tag=tag, value=value, step=step)

    def _route(self, key: str, prefix: str):
        per_rank = PER_RANK.fullmatch(key)
        if per_rank is None:
            return self.writer, key if "/" in key else f"{prefix}/{key}"
        rank = int(per_rank.group(1))
        if rank not in self.rank_writers:
            self.rank_writers[rank] = _writer(self.logdir / f"rank{rank}", f"rank{rank}")
        return self.rank_writers[rank], f"memory/{per_rank.group(2)}"

    def answers(self, step: int, groups: list[dict]) -> None:
        """A window's sampled answers (``groups``: a prompt, its reference and its answers with their rewards and
        advantages), a line each in ``rollouts.jsonl`` and one text entry per group."""
        if not self.enabled or not groups:
            return
        if self.rollouts is None:
            self.rollouts = _reopened(self.output_dir / "rollouts.jsonl", self.resumed_at)
        rollouts = self.rollouts
        for group in groups:
            rollouts.write(json_files.dumps({"step": step, **group}) + "\n")
            shown = " | ".join(f"{a['reward']:.3f} ({a['advantage']:+.2f}): {a['text']}" for a in group["answers"])
            self.text("rollouts/answers", f"{group['prompt']} -> reference: {group['reference']} || {shown}", step)
        rollouts.flush()

    def image(self, tag: str, image, step: int) -> None:
        if self.writer is not None:
            self.writer.add_image(tag=tag, img=image, step=step)

    def text(self, tag: str, text: str, step: int) -> None:
        if self.writer is not None:
            self.writer.add_text(tag=tag, text_string=text, step=step)

    def config(self, sections: dict) -> None:
        """The run's config, one text entry per section (``config/model``, ``config/training``, ...) in YAML's
        one-line form: VisualDL's text page joins lines, so block YAML would read as one run-on paragraph."""
        for name, section in sections.items():
            self.text(f"config/{name}", config_line(section), 0)

    def close(self) -> None:
        for file in (self.file, self.rollouts):
            if file:
                file.close()
        for writer in [self.writer, *self.rank_writers.values()]:
            if writer is not None:
                writer.close()


def config_line(section) -> str:
    return yaml.safe_dump(section, default_flow_style=True, sort_keys=False, width=float("inf")).strip()


def _writer(logdir: Path, name: str):
    """``name``: the run's name on the dashboard (VisualDL would show the folder's path)."""
    from visualdl import LogWriter

    return LogWriter(logdir=str(logdir), display_name=name)


def _plain(value):
    if hasattr(value, "item"):
        value = value.item()
    return round(value, 8) if isinstance(value, float) else value


def _reopened(path: Path, resumed_at: int) -> TextIO:
    """``path`` opened for writing, holding its records up to step ``resumed_at`` when a run resumes there."""
    check_output(path)  # before reading it: a FIFO there would block the read for good
    kept = _records_up_to(path, resumed_at) if resumed_at and path.exists() else []
    file = open_output(path)
    file.writelines(line + "\n" for line in kept)
    return file


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
