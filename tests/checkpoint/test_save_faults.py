"""Faults around saving: kill -9 during a save, a full disk, flipped bytes, branches of a lineage, background
writes that fail; a resume continues exactly or falls back to the last good checkpoint.

Crashes are placed with ``ERNIE_MOE_FAULT`` (``ernie_moe/faults.py``), so no test waits on timing.
"""

import signal

import numpy as np
import pytest
from safetensors.numpy import load_file
from support.runs import CONFIG, losses, quiet_trainer, records, train

from ernie_moe.checkpoint import lineage
from ernie_moe.checkpoint.lineage import MARKER, Run, marker_text, prune, read, resolve, scan
from ernie_moe.config import load_config

# ------------------------------------------------------------------------------------------ kill -9 and disk

@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("whole") / "run"
    train(out, "training.max_steps=10", "training.save_steps=1", "training.save_total_limit=3")
    return out


@pytest.mark.parametrize("point", ["kill_during_save", "kill_before_rename", "kill_during_background_write"])
@pytest.mark.slow
def test_kill_9_during_a_save_resumes_exactly(tmp_path, uninterrupted, point):
    """SIGKILL half-way through the save of step 6 (or with its marker written and the rename not done, or on the
    thread writing it in the background, ``training.async_save``): ``auto`` takes checkpoint-5 and the run ends
    as if never interrupted."""
    out = tmp_path / "run"
    args = ["training.max_steps=10", "training.save_steps=1", "training.save_total_limit=3"]
    if point == "kill_during_background_write":
        args.append("training.async_save=true")
    killed = train(out, *args, fault=f"{point}@6", check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert (out / "checkpoint-6.tmp").is_dir() and not (out / "checkpoint-6").exists()
    assert ((out / "checkpoint-6.tmp" / MARKER).is_file()) == (point == "kill_before_rename")
    assert resolve("auto", str(out)).path == out / "checkpoint-5"

    resumed = train(out, *args, "training.resume_from_checkpoint=auto")
    assert f"resumed from {out / 'checkpoint-5'} at step 5" in resumed.stdout
    assert losses(out) == losses(uninterrupted)
    assert [c.path.name for c in scan(out)] == ["checkpoint-8", "checkpoint-9", "checkpoint-10"]
    final, whole = load_file(str(out / "checkpoint-10" / "model-00001-of-00001.safetensors")), \
        load_file(str(uninterrupted / "checkpoint-10" / "model-00001-of-00001.safetensors"))
    for name in whole:
        np.testing.assert_array_equal(final[name], whole[name], err_msg=name)


@pytest.mark.slow
def test_a_full_disk_on_one_rank_fails_the_save_cleanly_on_every_rank(tmp_path):
    out = tmp_path / "run"
    result = train(out, "training.max_steps=3", "training.save_steps=1", "parallel.expert_parallel_degree=2",
                   fault="disk_full@2@1", nproc=2, check=False)
    assert result.returncode != 0
    assert "checkpoint error: saving checkpoint-2 failed on rank 1: [Errno 28] No space left on device" in result.stdout
    assert f"the previous checkpoint {out / 'checkpoint-1'} is intact" in result.stdout
    assert "Traceback" not in result.stdout
    assert not (out / "checkpoint-2.tmp").exists() and not (out / "checkpoint-2").exists()
    assert lineage.verify(read(out / "checkpoint-1")) is None

    single = train(tmp_path / "one", "training.max_steps=2", "training.save_steps=1", fault="disk_full@2", check=False)
    assert single.returncode == 2 and "No space left on device" in single.stderr, single.stderr[-2000:]
    assert "Traceback" not in single.stderr and not (tmp_path / "one" / "checkpoint-2.tmp").exists()


# ------------------------------------------------------------------------------------ flipped bytes, lineage

@pytest.mark.slow
def test_flipped_bytes_are_caught_and_auto_falls_back(tmp_path):
    out = tmp_path / "run"
    train(out, "training.max_steps=2", "training.save_steps=1")
    shard = out / "checkpoint-2" / "optimizer-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x10  # one bit of a tensor, the file still parses
    shard.write_bytes(bytes(data))

    named = train(tmp_path / "again", "training.max_steps=3", f"training.resume_from_checkpoint={out / 'checkpoint-2'}",
                  check=False)
    assert named.returncode == 2 and "Traceback" not in named.stderr
    assert f"{shard} does not match the checksum" in named.stderr
    assert f"training.resume_from_checkpoint={out / 'checkpoint-1'}" in named.stderr

    auto = train(out, "training.max_steps=3", "training.resume_from_checkpoint=auto")
    assert f"checkpoint {out / 'checkpoint-2'} is damaged" in auto.stdout
    assert f"falling back to {out / 'checkpoint-1'}" in auto.stdout and "at step 1" in auto.stdout


@pytest.mark.slow
def test_a_branch_keeps_its_lineage_and_leaves_the_other_alone(tmp_path):
    """Resume checkpoint-4 of an 8-step run with save_total_limit=2: the new run's checkpoints are kept, the
    first run's later ones are neither overwritten nor pruned, and ``auto`` continues the new run."""
    out = tmp_path / "run"
    train(out, "training.max_steps=8", "training.save_steps=2")
    first = {c.step: c.run_id for c in scan(out)}
    train(out, "training.max_steps=7", "training.save_steps=1", "training.save_total_limit=2",
          f"training.resume_from_checkpoint={out / 'checkpoint-4'}")
    found = scan(out)
    branch = [c for c in found if c.run_id not in first.values()]
    assert [c.step for c in branch] == [6, 7]
    assert branch[0].path.name == f"checkpoint-6-{branch[0].run_id}"  # checkpoint-6 is the first run's
    assert branch[0].parent == (branch[0].run_id, 5) and branch[1].parent == (branch[0].run_id, 6)
    assert {c.step: c.run_id for c in found if c.run_id in first.values()} == {6: first[6], 8: first[8]}
    assert [r["step"] for r in records(out) if "loss" in r] == [1, 2, 3, 4, 5, 6, 7]

    resumed = train(out, "training.max_steps=8", "training.save_steps=1", "training.resume_from_checkpoint=auto")
    assert f"resumed from {branch[1].path} at step 7" in resumed.stdout


def test_lineage_rules_on_folders(tmp_path):
    """``auto`` ignores every .tmp folder, whatever it holds, and takes the newest run; pruning stays inside
    one lineage."""
    old, new = Run("old", 1.0), Run("new", 2.0)

    def make(name, step, run, parent):
        folder = tmp_path / name
        folder.mkdir()
        (folder / MARKER).write_text(marker_text(step, run, parent, {}))

    make("checkpoint-2", 2, old, None)
    make("checkpoint-4", 4, old, ("old", 2))
    make("checkpoint-6", 6, old, ("old", 4))
    make("checkpoint-5", 5, new, ("old", 4))
    make("checkpoint-9.tmp", 9, new, ("new", 5))  # marker in, rename not done
    (tmp_path / "checkpoint-x").mkdir()  # no marker at all
    assert resolve("auto", str(tmp_path)).path == tmp_path / "checkpoint-5"
    assert [c.path.name for c in lineage.lineage(scan(tmp_path), read(tmp_path / "checkpoint-5"))] == \
        ["checkpoint-5", "checkpoint-4", "checkpoint-2"]
    prune(tmp_path, read(tmp_path / "checkpoint-5"), 2)
    assert sorted(c.path.name for c in scan(tmp_path)) == ["checkpoint-4", "checkpoint-5", "checkpoint-6"]
    assert resolve("auto", str(tmp_path / "empty")) is None
    # a step saved again goes beside a folder it did not write: another run's, or one whose marker is unreadable
    (tmp_path / "checkpoint-7").mkdir()
    (tmp_path / "checkpoint-7" / MARKER).write_text("{cut")
    for step, kept in ((6, "checkpoint-6"), (7, "checkpoint-7"), (5, None), (8, None)):
        assert lineage.folder_for(tmp_path, step, new).name == (f"{kept}-new" if kept else f"checkpoint-{step}")
    # the plain step number of earlier releases: resumed, and said to be unverifiable
    (tmp_path / "checkpoint-3").mkdir()
    (tmp_path / "checkpoint-3" / MARKER).write_text("3")
    warnings = []
    assert resolve(str(tmp_path / "checkpoint-3"), str(tmp_path), warn=warnings.append).step == 3
    assert warnings == [f"WARNING {tmp_path / 'checkpoint-3' / MARKER} records no checksums (written by an earlier "
                        "release): its files cannot be verified and are loaded as they are"]


@pytest.mark.slow
def test_a_fresh_run_does_not_mix_with_an_earlier_one(tmp_path):
    out = tmp_path / "run"
    train(out, "training.max_steps=2", "training.save_steps=1")
    again = train(out, "training.max_steps=1", check=False)
    assert again.returncode == 2 and "already holds checkpoints of an earlier run" in again.stderr
    assert "overwrite_output_dir" in again.stderr and "Traceback" not in again.stderr
    assert [r["step"] for r in records(out) if "loss" in r] == [1, 2]

    replaced = train(out, "training.max_steps=1", "training.overwrite_output_dir=true")
    assert "removed 2 checkpoint folder(s)" in replaced.stdout
    assert [c.step for c in scan(out)] == [1] and [r["step"] for r in records(out) if "loss" in r] == [1]


@pytest.mark.slow
def test_a_changed_schedule_continues_from_the_rate_it_had(tmp_path):
    """Resumed at step 4 with max_steps 6 -> 12: the first resumed step uses the rate the first run would have
    used, and the rest decays to min_lr at step 12."""
    out = tmp_path / "run"
    args = ["training.warmup_steps=2", "training.save_steps=4"]
    train(out, *args, "training.max_steps=6")
    first = {r["step"]: r["lr"] for r in records(out) if "lr" in r}
    resumed = train(tmp_path / "longer", *args, "training.max_steps=12",
                    f"training.resume_from_checkpoint={out / 'checkpoint-4'}")
    assert "learning-rate schedule changed since the checkpoint (max_steps 6 -> 12)" in resumed.stdout
    lr = {r["step"]: r["lr"] for r in records(tmp_path / "longer") if "lr" in r}
    assert lr[5] == pytest.approx(first[5], abs=1e-8)  # metrics.jsonl keeps 8 decimals
    cfg = load_config(CONFIG).training
    from ernie_moe.training.schedule import lr_at

    for step in range(5, 13):  # a cosine from the rate at step 5 down to min_lr after step 12
        expected = lr_at(step - 1, first[5], cfg.min_lr, 0, 12, "cosine", 0.1, decay_from=4)
        assert lr[step] == pytest.approx(expected, abs=1e-8), step
    assert all(a > b for a, b in zip(list(lr.values()), list(lr.values())[1:]))


@pytest.mark.slow
def test_a_warm_restart_starts_the_schedule_afresh_from_a_finished_runs_weights(tmp_path):
    """A 6-step run ends at min_lr; resumed from its last checkpoint with max_steps 12 and
    reset_schedule_on_resume, steps 7-12 follow a fresh 6-step schedule (warmup, then cosine), from the finished
    run's weights; resumed again after step 9 (a preemption), the restarted schedule goes on, not again."""
    args = ["training.warmup_steps=2", "training.save_steps=3"]
    out, longer = tmp_path / "run", tmp_path / "longer"
    train(out, *args, "training.max_steps=6")
    fresh = {r["step"]: r["lr"] for r in records(out) if "lr" in r}
    restart = ["training.reset_schedule_on_resume=true", "training.max_steps=12"]
    first = train(longer, *args, *restart, f"training.resume_from_checkpoint={out / 'checkpoint-6'}",
                  fault="sigterm_in_step@9", check=False)
    assert first.returncode == 4, first.stderr[-2000:]
    assert "a fresh learning-rate schedule from step 6" in first.stdout
    again = train(longer, *args, *restart, "training.resume_from_checkpoint=auto")
    assert "fresh learning-rate schedule" not in again.stdout
    lr = {r["step"]: r["lr"] for r in records(longer) if "lr" in r}
    assert [lr[s] for s in range(7, 13)] == pytest.approx([fresh[s] for s in range(1, 7)], abs=1e-8)


def test_a_save_in_the_background_writes_what_a_synchronous_save_writes(tmp_path):
    """``training.async_save``: the model files and random states byte for byte as a synchronous save writes
    them, the optimizer states tensor for tensor (their order in the file follows Paddle's parameter names, which
    a second model in one process numbers on), each checkpoint complete (its files' digests verified against its
    marker) and pruned as the limit says. The memory planner's host copy of the state is the size of the files."""
    from ernie_moe.memory.estimate import estimate, sample_workload

    runs = {}
    for mode in ("false", "true"):
        runs[mode] = tmp_path / mode
        tr = quiet_trainer(runs[mode], "training.max_steps=5", "training.save_steps=2", "training.save_total_limit=2",
                     f"training.async_save={mode}")
        tr.train()
        assert tr.saves.pending is None and tr.saves.last.step == 5
    (planned,) = estimate(tr.cfg, sample_workload(tr.cfg, 1), 1)
    tensors = sum(f.stat().st_size for f in tr.saves.last.path.glob("*.safetensors"))
    assert planned.save_copy == pytest.approx(tensors, rel=0.02)
    assert [c.step for c in scan(runs["true"])] == [c.step for c in scan(runs["false"])] == [4, 5]
    for step in (4, 5):
        sync, background = (read(runs[mode] / f"checkpoint-{step}") for mode in ("false", "true"))
        assert lineage.verify(background) is None
        files = sorted(p.name for p in sync.path.iterdir() if p.suffix == ".safetensors" or p.name.startswith("rng"))
        assert files and files == sorted(p.name for p in background.path.iterdir()
                                         if p.suffix == ".safetensors" or p.name.startswith("rng"))
        for name in files:
            if name.startswith("optimizer"):
                theirs, ours = load_file(str(sync.path / name)), load_file(str(background.path / name))
                assert sorted(ours) == sorted(theirs)
                for key in theirs:
                    np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)
            else:
                assert (background.path / name).read_bytes() == (sync.path / name).read_bytes(), name


def test_a_background_write_that_fails_fails_its_checkpoint_not_the_writer(tmp_path):
    """A write error on the writer's thread (a vanished folder, an unexpected exception) is recorded for the save
    it belongs to, as a synchronous write's is; the thread goes on with the next save's files."""
    from ernie_moe.checkpoint.files import BackgroundWrites, WrittenFiles

    writes = BackgroundWrites()
    failed, broken, fine = WrittenFiles(writes), WrittenFiles(writes), WrittenFiles(writes)
    failed.write(tmp_path / "missing" / "a.json", "{}")
    broken.run(lambda: [][1])
    fine.write(tmp_path / "b.json", "{}")
    writes.wait()
    assert isinstance(failed.error, FileNotFoundError) and not failed.digests
    assert isinstance(broken.error, OSError) and "IndexError" in str(broken.error)
    assert fine.error is None and set(fine.digests) == {"b.json"} and writes.idle()
