"""Which checkpoints belong together, which one a resume takes, which ones pruning may remove.

Every run has an id and a start time; every checkpoint's completion marker (``COMPLETE``, written last, as
JSON) names its run, its step, its parent (the run's previous checkpoint, or the one the run resumed from)
and the SHA-256 of each of its files. Following parents from a checkpoint gives its lineage.

- ``auto`` resumes the newest checkpoint of the newest run, checked against its digests; a damaged one is
  skipped, with a warning, for its parent.
- ``save_total_limit`` keeps the newest checkpoints of the saving run's lineage and removes only older ones of
  that lineage: the branch a run left when it resumed from an older checkpoint is never touched.
- Folders ending in ``.tmp`` are saves under way or interrupted; nothing here reads them.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import shutil
import time
from pathlib import Path

import paddle.distributed as dist

from ..config.errors import ConfigError
from ..config.schema import TrainingConfig
from ..elastic.job import Attempt, JobRecord
from ..json_files import UnreadableJSON, read_json
from ..parallel.env import DistEnv
from ..paths import check_output
from .errors import CheckpointError
from .files import sha256_of
from .output_lock import lock_output_dir, note_attempt

MARKER = "COMPLETE"
PREFIX = "checkpoint-"
OWN_CHECKPOINT = re.compile(r"checkpoint-\d+(\.tmp)?")  # what this package names a checkpoint (or one being saved)
MODEL_FOLDERS = ("final_model", "best_model")  # the models a run writes into its output folder


@dataclasses.dataclass(frozen=True)
class Run:
    """One launch of the trainer: the checkpoints it writes carry this identity."""

    run_id: str
    started: float

    @classmethod
    def begin(cls, env: DistEnv) -> Run:
        """A new run id, the same on every rank."""
        mine = (time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3), time.time())
        return cls(*env.all_gather_object(mine)[0])


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    run_id: str
    run_started: float
    parent: tuple[str, int] | None
    files: dict  # file name -> SHA-256 (empty for checkpoints written before digests were recorded)

    @property
    def key(self) -> tuple[str, int]:
        return (self.run_id, self.step)


def marker_text(step: int, run: Run, parent: tuple[str, int] | None, files: dict) -> str:
    return json.dumps({"step": step, "run_id": run.run_id, "run_started": run.started,
                       "parent": list(parent) if parent else None, "files": dict(sorted(files.items()))}, indent=1)


def read(path: Path) -> Checkpoint | None:
    """The checkpoint in ``path``, or None when it is not a complete one."""
    path = Path(path)
    if not path.is_dir() or path.name.endswith(".tmp"):
        return None
    try:
        marker = read_json(path / MARKER)
    except UnreadableJSON:
        return None
    if isinstance(marker, int):  # the plain step number of earlier releases
        return Checkpoint(path, marker, "", 0.0, None, {})
    try:
        parent = tuple(marker["parent"]) if marker.get("parent") else None
        return Checkpoint(path, int(marker["step"]), str(marker["run_id"]), float(marker["run_started"]),
                          parent, dict(marker["files"]))
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def scan(root) -> list[Checkpoint]:
    """The complete checkpoints in ``root``, oldest run first, then by step."""
    root = Path(root)
    found = [read(p) for p in root.glob(PREFIX + "*")] if root.is_dir() else []
    return sorted((c for c in found if c is not None), key=lambda c: (c.run_started, c.step))


def lineage(checkpoints: list[Checkpoint], head: Checkpoint) -> list[Checkpoint]:
    """``head`` and its ancestors still on disk, newest first."""
    by_key = {c.key: c for c in checkpoints}
    chain = [head]
    while chain[-1].parent is not None and chain[-1].parent in by_key and len(chain) <= len(checkpoints):
        chain.append(by_key[chain[-1].parent])
    return chain


def folder_for(root: Path, step: int, run: Run) -> Path:
    """``checkpoint-<step>``; when a folder of another run has that name (this run branched off before it), or
    one whose marker cannot be read (a damaged marker in front of intact files), ``checkpoint-<step>-<run id>``,
    so that nothing this run did not write is overwritten."""
    plain = Path(root) / f"{PREFIX}{step}"
    if not plain.exists():
        return plain
    other = read(plain)
    if other is not None and other.run_id == run.run_id:
        return plain
    return Path(root) / f"{PREFIX}{step}-{run.run_id}"


def prune(root: Path, head: Checkpoint, limit: int) -> list[Path]:
    """Remove the checkpoints of ``head``'s lineage beyond the newest ``limit``; returns what was removed."""
    if limit <= 0:
        return []
    removed = [c.path for c in lineage(scan(root), head)[limit:]]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def verify(checkpoint: Checkpoint, env: DistEnv | None = None) -> str | None:
    """Check the files against the digests in the marker, the files shared out over the ranks; returns the
    first problem (the same on every rank), or None."""
    rank, world = (env.rank, env.world_size) if env is not None else (0, 1)
    problem = None
    for i, (name, digest) in enumerate(sorted(checkpoint.files.items())):
        if i % world != rank or problem:
            continue
        path = checkpoint.path / name
        try:
            if sha256_of(path) != digest:
                problem = f"{path} does not match the checksum recorded when it was saved (its bytes changed)"
        except OSError as err:
            problem = f"{path} cannot be read: {err.strerror or err}"
    if env is not None:
        problem = next((p for p in env.all_gather_object(problem) if p), None)
    return problem


def resolve(resume_from: str, output_dir: str, env: DistEnv | None = None, warn=print,
            runs: set[str] | None = None) -> Checkpoint | None:
    """The checkpoint ``training.resume_from_checkpoint`` names, verified. ``auto``: the newest checkpoint of
    the newest run in ``output_dir`` (None when there is none), or of the newest of ``runs`` where given (an elastic
    job's attempts), falling back along its lineage past damaged ones; a path: that checkpoint, an error naming the
    damaged file (and the older one to use) otherwise."""
    if resume_from == "auto":
        found = scan(output_dir)
        folders = {p for p in Path(output_dir).glob(PREFIX + "*") if p.is_dir() and not p.name.endswith(".tmp")}
        for unread in sorted(folders - {c.path for c in found}):
            # a whole-looking folder whose marker cannot be read: passed over, and said so
            warn(f"WARNING {unread} has no readable {MARKER} marker (damaged, or not a checkpoint): passed over")
        heads = found if runs is None else [c for c in found if c.run_id in runs]
        if not heads:
            return None
        chain = lineage(found, heads[-1])  # scan sorts by run start, then step
        for i, candidate in enumerate(chain):
            problem = verify(candidate, env)
            if problem is None:
                return _unverified_said(candidate, warn)
            older = f"falling back to {chain[i + 1].path}" if i + 1 < len(chain) else "no older checkpoint is left"
            warn(f"WARNING checkpoint {candidate.path} is damaged: {problem}; {older}")
        raise CheckpointError(f"every checkpoint of the newest run in {output_dir} is damaged; start afresh "
                              "(training.resume_from_checkpoint='' with training.overwrite_output_dir=true).")
    path = Path(resume_from)
    checkpoint = read(path)
    if checkpoint is None:
        raise CheckpointError(f"{path} is not a complete checkpoint (no readable {MARKER} marker): it does not exist "
                              "or its save was interrupted.")
    problem = verify(checkpoint, env)
    if problem is not None:
        chain = lineage(scan(path.parent), checkpoint)
        hint = (f" The previous checkpoint of its run is {chain[1].path}: resume from it with "
                f"training.resume_from_checkpoint={chain[1].path}." if len(chain) > 1 else "")
        raise CheckpointError(f"{problem}.{hint}")
    return _unverified_said(checkpoint, warn)


def _unverified_said(checkpoint: Checkpoint, warn) -> Checkpoint:
    """``checkpoint``, after a warning when its marker records no checksums (the plain step number of earlier
    releases): its files are taken as they are."""
    if not checkpoint.files:
        warn(f"WARNING {checkpoint.path / MARKER} records no checksums (written by an earlier release): its files "
             "cannot be verified and are loaded as they are")
    return checkpoint


def claim_output_dir(training_cfg: TrainingConfig, env: DistEnv, job: JobRecord | None = None,
                     outputs: tuple[str, ...] = ()) -> list[Attempt]:
    """Take the output folder's lock (one job at a time, every run: fresh, resumed or overwriting; see
    ``output_lock``), with ``outputs`` (the files the run writes there) each a regular file or absent; then: no run
    replaces the model it starts from, and a fresh run (no resume) may not write into a folder holding another
    run's checkpoints or final model, unless ``training.overwrite_output_dir`` says to replace them. Under the
    elastic launcher (``job``): the earlier attempts of the job, read once the lock is held (a restart when there
    are any, which resumes what its job saved and is no fresh run); [] otherwise."""
    t = training_cfg
    root = Path(t.output_dir)
    refused, earlier = None, []
    if env.is_main:
        try:
            lock_output_dir(root, job.job if job else "")
            for name in outputs:
                check_output(root / name)
            earlier = job.attempts() if job else []
            if job:
                note_attempt(root, len(earlier))
        except ConfigError as err:
            refused = str(err)
        except OSError as err:
            refused = f"training.output_dir '{root}' cannot be written: {err}"
    if env.world_size > 1:  # every rank stops with rank 0's line
        refused, earlier = env.all_gather_object((refused, earlier))[0]
    if refused:
        raise ConfigError(refused)
    if earlier:
        return earlier
    base = Path(t.model_name_or_path).resolve() if t.model_name_or_path else None
    for name in MODEL_FOLDERS:
        folder = (root / name).resolve()
        if base is not None and (base == folder or folder in base.parents):
            raise ConfigError(f"training.model_name_or_path '{t.model_name_or_path}' is the {name} this run writes "
                              f"into training.output_dir '{root}' (it would replace the model it starts from): choose "
                              "another output_dir, or copy the model elsewhere first.")
    if t.resume_from_checkpoint or not root.is_dir():
        return []
    existing = sorted(p for p in root.glob(PREFIX + "*") if OWN_CHECKPOINT.fullmatch(p.name) and p.is_dir())
    models = [name for name in MODEL_FOLDERS if (root / name).is_dir()]
    if not existing and not models:
        return []
    if not t.overwrite_output_dir:
        held = ", ".join([*(p.name for p in existing[:3]), *(["..."] if len(existing) > 3 else []), *models])
        what = "checkpoints of an earlier run" if existing else "the model of an earlier run"
        raise ConfigError(f"training.output_dir '{root}' already holds {what} ({held}). Resume it with "
                          "training.resume_from_checkpoint=auto, choose another output_dir, or set "
                          "training.overwrite_output_dir=true to replace them.")
    if env.is_main:
        for path in existing:
            shutil.rmtree(path, ignore_errors=True)
        print(f"overwrite_output_dir: removed {len(existing)} checkpoint folder(s) of an earlier run from {root}",
              flush=True)
    if env.world_size > 1:
        dist.barrier()
    return []
