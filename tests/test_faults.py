"""Faults injected on purpose: crafted files, kill -9 during a save, flipped bytes, a full disk, runs of non-finite
steps, resumes that branch or change the schedule, bad configs and bad records. Each ends in a clear line and a
known exit code, a counted skip, or a resume that continues exactly; none runs code from a file it reads.

Crashes are placed with ``ERNIE_MOE_FAULT`` (``ernie_moe/checkpoint/faults.py``), so no test waits on timing.
"""

import json
import os
import pickle
import random
import signal
import struct
import subprocess
import sys
import zlib
from collections import Counter

import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import load_file, save_file
from support.runs import CONFIG, QUIET, ROOT, losses, records, train

import run_trainer
from ernie_moe.checkpoint import lineage
from ernie_moe.checkpoint.lineage import MARKER, Run, marker_text, prune, read, resolve, scan
from ernie_moe.config import load_config
from ernie_moe.data import RowStream, build_tokenizer
from ernie_moe.data.formats.jsonl import JsonlDataset


class TouchesAFile:
    """A pickle payload: unpickling it would create ``path``."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


# ---------------------------------------------------------------------------------------- loading runs no code

@pytest.mark.slow
def test_a_crafted_pdparams_is_refused_and_never_executed(tmp_path):
    touched = tmp_path / "pwned"
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "ernie4_5", "hidden_size": 64, "num_hidden_layers": 2,
                                                   "num_attention_heads": 4, "vocab_size": 128,
                                                   "intermediate_size": 128}))
    (model / "model_state.pdparams").write_bytes(pickle.dumps({"model.embed_tokens.weight": TouchesAFile(touched)}))

    exported = subprocess.run([sys.executable, "-m", "ernie_moe.export", str(model), str(tmp_path / "out")],
                              capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert exported.returncode == 2, exported.stderr[-2000:]
    assert "refusing to read" in exported.stderr and "model_state.pdparams" in exported.stderr
    assert "posix.system" in exported.stderr and "Traceback" not in exported.stderr

    trained = train(tmp_path / "run", f"training.model_name_or_path={model}", "model.moe_num_experts=[]",
                    "model.moe_intermediate_size=[]", check=False)
    assert trained.returncode == 2 and "refusing to read" in trained.stderr, trained.stderr[-2000:]
    assert not touched.exists()


@pytest.mark.parametrize("protocol", [2, 3, 4])
def test_a_real_pdparams_reads_as_paddle_load_reads_it(tmp_path, protocol):
    """Every pickle protocol ``paddle.save`` writes; its bookkeeping entry and a bare tensor's (name, array) pair
    are read past, bfloat16 is widened."""
    import paddle

    from ernie_moe.checkpoint.pdparams import load_pdparams

    state = {"w": paddle.randn([3, 4]), "half": paddle.randn([5]).astype("float16"),
             "bf16": paddle.randn([2, 3]).astype("bfloat16"), "ids": paddle.to_tensor([[1, -2]], dtype="int64"),
             "mask": paddle.to_tensor([True, False]), "empty": paddle.zeros([0, 4])}
    paddle.save(state, str(tmp_path / "model_state.pdparams"), protocol=protocol)
    loaded = load_pdparams(tmp_path / "model_state.pdparams")
    assert set(loaded) == set(state)
    for name, tensor in state.items():
        expected = tensor.astype("float32") if tensor.dtype == paddle.bfloat16 else tensor
        np.testing.assert_array_equal(loaded[name], expected.numpy(), err_msg=name)
        assert loaded[name].dtype == expected.numpy().dtype, name
    reference = paddle.load(str(tmp_path / "model_state.pdparams"))  # the test's own file: paddle.load may read it
    np.testing.assert_array_equal(loaded["w"], reference["w"].numpy())


class Stateful:
    def __init__(self):
        self.touched = True


@pytest.mark.parametrize("payload, why", [
    ({"w": TouchesAFile("/nonexistent/pwned")}, "it names posix.system"),
    ({"w": np.array([TouchesAFile("/nonexistent/pwned")], dtype=object)}, "dtype object"),
    ({"w": np.array([1, 2], dtype=object)}, "dtype object"),
    ({"w": np.zeros(2, dtype=[("a", "f4"), ("b", "i4")])}, "structured dtype"),
    ({"w": np.array(["text"])}, "dtype <U4"),
    ({"w": {1, 2}}, "opcode"),
    ({"w": Stateful()}, "it names test_faults.Stateful"),
    (b"not a pickle", "opcode"),
    ([np.ones(2)], "it holds a list, not a state dict"),
], ids=["call", "objects calling", "objects", "records", "strings", "set", "instance", "garbage", "list"])
def test_a_pdparams_of_anything_but_plain_arrays_is_refused_by_name(tmp_path, payload, why):
    from ernie_moe.checkpoint.errors import CheckpointError
    from ernie_moe.checkpoint.pdparams import load_pdparams

    path = tmp_path / "model_state.pdparams"
    path.write_bytes(payload if isinstance(payload, bytes) else pickle.dumps(payload, protocol=4))
    with pytest.raises(CheckpointError, match="refusing to read .*model_state.pdparams: ") as refused:
        load_pdparams(path)
    assert why in str(refused.value)


def test_a_cut_or_altered_pdparams_is_refused(tmp_path):
    """Cut anywhere, or with an array's length byte changed, a real file is an error, never a wrong tensor."""
    from ernie_moe.checkpoint.errors import CheckpointError
    from ernie_moe.checkpoint.pdparams import load_pdparams

    data = pickle.dumps({"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, protocol=4)
    path = tmp_path / "model_state.pdparams"
    refused = 0
    for end in range(len(data)):
        path.write_bytes(data[:end])
        with pytest.raises(CheckpointError, match="refusing to read"):
            load_pdparams(path)
        refused += 1
    assert refused == len(data)
    raw = np.arange(6, dtype=np.float32).tobytes()
    at = data.index(raw)
    assert data[at - 1] == len(raw)  # SHORT_BINBYTES' length byte
    path.write_bytes(data[:at - 1] + bytes([len(raw) - 4]) + data[at:at + len(raw) - 4] + data[at + len(raw):])
    with pytest.raises(CheckpointError, match="an array of shape .2, 3. and dtype float32 holds 20 bytes"):
        load_pdparams(path)
    code = b"\x8c\x02f4"  # the dtype's type code, which NumPy would parse as an expression if it were one
    assert data.count(code) == 1
    path.write_bytes(data.replace(code, b"\x8c\x04f4,("))
    with pytest.raises(CheckpointError, match="it holds a dtype written 'f4,\\(', not a type code"):
        load_pdparams(path)


@pytest.mark.parametrize("protocol", [2, 4])
def test_a_pdparams_with_bytes_changed_anywhere_is_read_or_refused(tmp_path, protocol):
    """A real file with one to four bytes changed, cut out or slipped in, 2,000 times (a fixed seed): each reads
    as a state dict of arrays or is refused with a CheckpointError; no other error escapes the reader."""
    import paddle

    from ernie_moe.checkpoint.errors import CheckpointError
    from ernie_moe.checkpoint.pdparams import load_pdparams

    path = tmp_path / "model_state.pdparams"
    state = {"w": paddle.randn([3, 4]), "ids": paddle.zeros([2], dtype="int64"),
             "bf16": paddle.randn([2, 2]).astype("bfloat16"), "empty": paddle.zeros([0, 3])}
    paddle.save(state, str(path), protocol=protocol)
    data = path.read_bytes()
    rng = random.Random(protocol)
    outcomes = Counter()
    for _ in range(2000):
        changed = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            at, how = rng.randrange(len(changed)), rng.random()
            if how < 0.6:
                changed[at] = rng.randrange(256)
            elif how < 0.8:
                del changed[at:at + rng.randint(1, 8)]
            else:
                changed[at:at] = rng.randbytes(rng.randint(1, 8))
        path.write_bytes(bytes(changed))
        try:
            loaded = load_pdparams(path)
        except CheckpointError:
            outcomes["refused"] += 1
        else:
            assert all(isinstance(value, np.ndarray) for value in loaded.values())
            outcomes["read"] += 1
    assert outcomes["refused"] + outcomes["read"] == 2000 and outcomes["refused"] > 1000, outcomes


@pytest.mark.parametrize("config, index, why", [
    ([{"model_type": "ernie4_5_moe_vl"}], None, "config.json holds a JSON list, not an object"),
    ({"model_type": "ernie4_5_moe_vl"}, [1], "cannot read .*model.safetensors.index.json: list indices"),
    ({"model_type": "ernie4_5_moe_vl"}, {"weight_map": ["a"]}, "weight_map must map each tensor name to a file"),
    ({"model_type": "ernie4_5_moe_vl"}, {"weight_map": {"w": 3}}, "weight_map must map each tensor name to a file"),
], ids=["config list", "index list", "map list", "file number"])
def test_a_model_folder_with_json_of_the_wrong_shape_is_refused(tmp_path, config, index, why):
    from ernie_moe.checkpoint.errors import CheckpointError
    from ernie_moe.checkpoint.formats import SourceCheckpoint

    (tmp_path / "config.json").write_text(json.dumps(config))
    if index is not None:
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=why):
        SourceCheckpoint(tmp_path)


def test_no_module_of_the_package_imports_pickle():
    for module in (ROOT / "ernie_moe").rglob("*.py"):
        source = module.read_text()
        assert "import pickle" not in source and "from pickle" not in source, module


@pytest.mark.slow
def test_checkpoints_keep_random_states_as_json_and_never_unpickle(tmp_path):
    out = tmp_path / "run"
    train(out, "training.max_steps=2", "training.save_steps=1")
    checkpoint = out / "checkpoint-1"
    state = json.loads((checkpoint / "rng_state-00000.json").read_text())
    assert set(state) == {"python", "numpy", "paddle"}
    touched = tmp_path / "pwned"
    (checkpoint / "rng_state-00000.pkl").write_bytes(pickle.dumps(TouchesAFile(touched)))  # the old file name
    train(tmp_path / "resumed", "training.max_steps=2", f"training.resume_from_checkpoint={checkpoint}")
    assert not touched.exists()
    assert losses(tmp_path / "resumed") == {2: losses(out)[2]}


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
        tr = trainer(runs[mode], "training.max_steps=5", "training.save_steps=2", "training.save_total_limit=2",
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


# ------------------------------------------------------------------------------------------ non-finite steps

def trainer(tmp_path, *overrides):
    from ernie_moe.training import Trainer

    return Trainer(load_config(CONFIG, [*QUIET, f"training.output_dir={tmp_path}", *overrides]))


@pytest.mark.parametrize("async_save", [False, True])
def test_a_streak_of_skipped_steps_saves_nothing_and_names_the_checkpoint_before_it(tmp_path, async_save):
    """Also with saves written in the background: the one being written when the run stops is completed first."""
    from support.runs import poison_gradients

    from ernie_moe.training.precision import NonFiniteGradients

    tr = trainer(tmp_path, "training.max_steps=8", "training.save_steps=1", "training.save_total_limit=1",
                 "training.max_skipped_steps=3", f"training.async_save={async_save}")
    poison_gradients(tr, {3, 4, 5})
    with pytest.raises(NonFiniteGradients) as err:
        tr.train()
    assert f"saved before these steps, is {tmp_path / 'checkpoint-2'}" in str(err.value)
    assert [c.step for c in scan(tmp_path)] == [2]

    resumed = trainer(tmp_path, "training.max_steps=8", "training.resume_from_checkpoint=auto")
    assert resumed.step == 2 and resumed.parts.precision.skipped_in_a_row == 0


@pytest.mark.slow
def test_a_run_whose_every_step_is_non_finite_fails(tmp_path):
    """A weight that turned nan in training (a folder holding one is refused as it loads, naming the tensor):
    every step is skipped, the log says so (null and the reason: strict JSON), the run stops."""
    from ernie_moe.training import Trainer
    from ernie_moe.training.precision import NonFiniteGradients

    out = tmp_path / "run"
    trainer = Trainer(load_config(CONFIG, [*QUIET, "training.max_steps=3", "training.max_skipped_steps=0",
                                           f"training.output_dir={out}", "logging.visualdl=false"]))
    embedding = trainer.parts.model.model.embed_tokens.weight
    embedding.set_value(np.full(embedding.shape, np.nan, np.float32))
    with pytest.raises(NonFiniteGradients, match="3 of the 3 steps of this run were skipped"):
        trainer.train()
    # strict JSON (NaN is not JSON): null, the reason beside it
    strict = {"parse_constant": lambda word: pytest.fail(f"{word} in a file that must be strict JSON")}
    logged = [json.loads(line, **strict) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in logged if "loss" in r]
    assert logged and all(r["loss"] is None and r["loss_nonfinite"] == "nan" and r["grad_norm"] is None
                          and r["skipped_steps"] == 1 for r in logged)
    summary = json.loads((out / "summary.json").read_text(), **strict)
    assert summary["status"] == "failed" and summary["skipped_steps"] == 3
    assert summary["run_steps"] == 3 and summary["trained_steps"] == 0  # a skipped step trains nothing
    assert not (out / "final_model").exists()


def test_nan_logits_give_a_nan_loss():
    import paddle

    from ernie_moe.parallel.plan import SingleDevicePlan

    logits = paddle.zeros([1, 3, 8])
    logits[0, 1, 2] = float("nan")
    loss = SingleDevicePlan.cross_entropy_sum(None, logits, paddle.to_tensor([[1, 2, -100]]))
    assert np.isnan(float(loss))


# ---------------------------------------------------------------------------------------------- bad configs

@pytest.mark.parametrize("override, words", [
    ("training.seed=-1", "training.seed (-1)"),
    ("training.seed=4294967296", "training.seed (4294967296)"),
    ("model.initializer_range=0", "model.initializer_range must be positive"),
    ("training.adam_epsilon=0", "training.adam_epsilon must be positive"),
    ("model.rms_norm_eps=-1e-6", "model.rms_norm_eps must be positive"),
    ("model.rope_theta=0", "model.rope_theta must be positive"),
    ("model.vision_config.rope_theta=0", "model.vision_config.rope_theta must be positive"),
    ("model.vision_config.mlp_ratio=0", "model.vision_config.mlp_ratio must be positive"),
    ("model.vision_config.depth=0", "vision_config depth, embed_dim, num_heads, patch_size and spatial_merge_size"),
    ("model.vision_config.in_channels=1", "RGB (3 channels)"),
    ("training.save_steps=-1", "training.save_steps cannot be negative"),
    ("training.save_total_limit=-2", "training.save_total_limit cannot be negative"),
    ("training.device_memory_gb=-4", "training.device_memory_gb cannot be negative"),
])
def test_bad_config_values_are_one_line_errors(override, words, capsys):
    assert run_trainer.main(["--config", CONFIG, *QUIET, "training.max_steps=1", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: ") and words in err and len(err.strip().splitlines()) == 1


def test_bad_config_files_are_one_line_errors(tmp_path, capsys):
    (tmp_path / "empty.yaml").write_text("# nothing here\n")
    (tmp_path / "twice.yaml").write_text("training:\n  max_steps: 3\n  max_steps: 4\n")
    (tmp_path / "a_file").write_text("")
    cases = {str(tmp_path / "empty.yaml"): [], str(tmp_path / "twice.yaml"): [],
             CONFIG: [*QUIET, "training.max_steps=1", f"training.output_dir={tmp_path / 'a_file' / 'out'}"]}
    words = ["is empty", "key 'max_steps' is given twice", "is a file"]
    for (config, overrides), expected in zip(cases.items(), words):
        assert run_trainer.main(["--config", config, *overrides]) == 2
        err = capsys.readouterr().err
        assert err.startswith("config error: ") and expected in err and "Traceback" not in err, err


def test_garbage_tokenizer_and_model_files_are_clear_errors(tmp_path, capsys):
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.model").write_bytes(b"\x00garbage" * 50)
    assert run_trainer.main(["--config", CONFIG, *QUIET, f"training.output_dir={tmp_path / 'a'}",
                             f"data.tokenizer_path={tmp_path / 'tok'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("data error: ") and "is not a SentencePiece model" in err and len(err.splitlines()) == 1

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "ernie4_5", "hidden_size": 64,
                                                   "num_hidden_layers": 2, "num_attention_heads": 4,
                                                   "vocab_size": 128, "intermediate_size": 128}))
    def header(**offsets) -> bytes:  # float32 [4] tensors at the given byte ranges, over 24 bytes of data
        encoded = json.dumps({name: {"dtype": "F32", "shape": [4], "data_offsets": at}
                              for name, at in offsets.items()}).encode()
        return struct.pack("<Q", len(encoded)) + encoded + bytes(24)

    garbage = b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": garbage"
    overlapping, aliased = header(a=[0, 16], b=[8, 24]), header(a=[0, 16], b=[0, 16])
    past_the_end = header(a=[0, 16], b=[16, 32])
    for content in (garbage, b"x" * 3, overlapping, aliased, past_the_end):
        (model / "model.safetensors").write_bytes(content)
        assert run_trainer.main(["--config", CONFIG, *QUIET, f"training.output_dir={tmp_path / 'b'}",
                                 f"training.model_name_or_path={model}", "model.moe_num_experts=[]",
                                 "model.moe_intermediate_size=[]"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("checkpoint error: cannot read ") and "model.safetensors" in err, err
        assert len(err.strip().splitlines()) == 1

    assert run_trainer.main(["--config", CONFIG, "training.max_steps=1",
                             f"training.model_name_or_path={tmp_path / 'nothing'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("training.model_name_or_path") == 1 and "has no config.json" in err


@pytest.mark.slow
def test_resuming_past_max_steps_says_nothing_was_trained(tmp_path):
    out = tmp_path / "run"
    train(out, "training.max_steps=2")
    again = train(out, "training.max_steps=2", "training.resume_from_checkpoint=auto")
    assert "nothing to train: the checkpoint is at step 2 and training.max_steps is 2" in again.stdout
    assert "done: nothing trained" in again.stdout


# ---------------------------------------------------------------------------------------------- bad records

def png_claiming(path, width, height):
    """A small PNG whose header claims ``width`` x ``height`` pixels (a decompression bomb's first bytes)."""
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(path)
    data = bytearray(path.read_bytes())
    ihdr = data.index(b"IHDR")
    data[ihdr + 4: ihdr + 12] = struct.pack(">II", width, height)
    data[ihdr + 17: ihdr + 21] = struct.pack(">I", zlib.crc32(bytes(data[ihdr: ihdr + 17])))
    path.write_bytes(bytes(data))


@pytest.fixture
def bad_records(tmp_path):
    Image.fromarray(np.full((40, 60, 3), 200, np.uint8)).save(tmp_path / "ok.png")
    png_claiming(tmp_path / "bomb.png", 100_000, 100_000)
    Image.fromarray(np.zeros((300, 300, 3), np.uint8)).save(tmp_path / "big.png")
    lines = [
        {"image": "ok.png", "text": "a grey picture"},
        {"images": None, "text": "null images"},
        {"images": 7, "text": "a number"},
        {"images": ["ok.png", 3], "text": "a number in the list"},
        {"image": "bomb.png", "text": "a decompression bomb"},
        {"image": "big.png", "text": "over the cap"},
        {"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "x"}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": {"text": "x"}}]},
        {"messages": [{"role": "robot", "content": "hi"}]},
        {"image": "ok.png", "text": "word " * 200},
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_bad_records_are_skipped_and_counted_once(bad_records):
    cfg = load_config(None, ["data.dataset=jsonl", f"data.train_path={bad_records}", "model.vocab_size=300",
                             "data.max_seq_len=128", "data.overlong=skip", "data.max_image_pixels=50000"])
    reads = Counter()

    class Counting(JsonlDataset):
        def __getitem__(self, index):
            reads[index] += 1
            return super().__getitem__(index)

    dataset = Counting(str(bad_records), cfg.data.max_image_pixels)
    stats = Counter()
    rows = iter(RowStream(dataset, build_tokenizer(cfg), cfg, stats, shuffle=True))
    for _ in range(6):  # several epochs of the one usable sample
        next(rows)
    assert dict(stats) == {"bad_images": 3, "image_too_large": 2, "bad_message": 3, "overlong_skipped": 1}
    assert reads[9] == 1 and reads[0] >= 3  # the overlong one was encoded once, the good one every epoch


@pytest.mark.slow
def test_an_eval_file_without_usable_records_warns(bad_records, tmp_path):
    bad_only = tmp_path / "eval.jsonl"
    bad_only.write_text("".join(bad_records.read_text().splitlines(keepends=True)[1:4]))
    out = tmp_path / "run"
    result = train(out, "data.dataset=jsonl", f"data.train_path={bad_records}", f"data.eval_path={bad_only}",
                   "model.vocab_size=300", "data.max_seq_len=128", "training.max_steps=1")
    assert "WARNING the held-out data gave nothing to evaluate (skipped samples: {'bad_images': 3})" in result.stdout


# ------------------------------------------------------------------------------- one writer per output folder

HOLD = ("import sys\nfrom ernie_moe.checkpoint.output_lock import lock_output_dir\nlock_output_dir(sys.argv[1])\n"
        "print('locked', flush=True)\nsys.stdin.read()\n")


def hold_lock(folder):
    """Another job holding ``folder``'s lock; returned once it holds it (it says so), until its stdin closes."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_a_lock_file_that_is_a_link_or_a_fifo_is_refused_and_nothing_it_names_is_written(tmp_path, capsys):
    """A .run.lock that is a symbolic link to a user's file: the run follows no link, writes nothing into that
    file and stops with one line; a FIFO in its place is named, not an 'Invalid argument'."""
    users = tmp_path / "users_file.txt"
    users.write_text("precious\n")
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / ".run.lock").symlink_to(users)
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / ".run.lock")
    for out, words in ((linked, "is a symbolic link"), (fifo, "is not a regular file")):
        assert run_trainer.main(["--config", CONFIG, *QUIET, "training.max_steps=1",
                                 f"training.output_dir={out}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("config error: ") and words in err and ".run.lock" in err, err
        assert len(err.strip().splitlines()) == 1
    assert users.read_text() == "precious\n"


@pytest.mark.slow
def test_a_second_run_a_resume_or_an_overwrite_beside_a_running_job_stops_naming_it(tmp_path):
    """While another job holds the output folder, a fresh run, a resume and an overwrite each stop with a line
    naming it before touching anything; once that job is gone (ended, or killed with -9), runs go ahead."""
    out = tmp_path / "run"
    train(out, "training.max_steps=2")
    before = {p.name: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    holder = hold_lock(out)
    try:
        for extra in ([], ["training.resume_from_checkpoint=auto", "training.max_steps=4"],
                      ["training.overwrite_output_dir=true"]):
            done = train(out, "training.max_steps=2", *extra, check=False)
            assert done.returncode == 2, done.stderr[-2000:]
            assert f"is in use by a running job (host {os.uname().nodename}, process {holder.pid}" in done.stderr
        after = {p.name: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name != ".run.lock"}
        assert after == {k: v for k, v in before.items() if k != ".run.lock"}
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    train(out, "training.resume_from_checkpoint=auto", "training.max_steps=3")
    killed = hold_lock(out)
    killed.kill()  # kill -9: the kernel lets go of the lock with the process
    killed.wait(timeout=60)
    train(out, "training.resume_from_checkpoint=auto", "training.max_steps=4")
    assert max(losses(out)) == 4


def test_export_into_the_folder_it_reads_is_refused_before_any_write(tmp_path):
    from ernie_moe.export import main as export_main

    out = tmp_path / "run"
    from ernie_moe.training import Trainer

    Trainer(load_config(CONFIG, [f"training.output_dir={out}", *QUIET, "training.max_steps=1"])).train()
    checkpoint = out / "checkpoint-1"
    files = {p: p.read_bytes() for p in checkpoint.rglob("*") if p.is_file()}
    for target in (checkpoint, checkpoint / "exported"):
        assert export_main([str(checkpoint), str(target)]) == 2
    assert {p: p.read_bytes() for p in checkpoint.rglob("*") if p.is_file()} == files


# ------------------------------------------------------------------------------------------------ preemption

@pytest.mark.slow
@pytest.mark.parametrize("fault", ["sigterm_in_step@3@1", "sigterm_during_save@2@1"])
def test_sigterm_to_one_rank_saves_stops_every_rank_and_resumes_exactly(tmp_path, fault):
    """SIGTERM to rank 1 of 2, mid-step or mid-save: both ranks finish the step, the step is saved, the run exits
    with code 4 naming the checkpoint, and a resume ends with the losses of a run never interrupted."""
    steps = ["training.max_steps=6", "training.save_steps=2"]
    whole = train(tmp_path / "whole", *steps, nproc=2)
    assert whole.returncode == 0
    out = tmp_path / "stopped"
    done = train(out, *steps, fault=fault, nproc=2, check=False)
    stop_step = int(fault.split("@")[1])
    assert done.returncode == 4, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["steps"] == stop_step
    assert summary["reason"] == "another rank was told to stop" or "SIGTERM" in summary["reason"]
    assert (out / f"checkpoint-{stop_step}").is_dir() and not list(out.glob("*.tmp"))
    train(out, *steps, "training.resume_from_checkpoint=auto", nproc=2)
    assert losses(out) == losses(tmp_path / "whole")


@pytest.mark.slow
def test_workers_whose_launcher_is_killed_stop_instead_of_training_on(tmp_path):
    """kill -9 of the launcher at step 3 of 20: its workers notice, save the step they finish and exit, so no
    process trains on beside a restarted job."""
    out = tmp_path / "orphaned"
    done = train(out, "training.max_steps=20", "training.save_steps=10", fault="launcher_killed@3@0", nproc=2,
                 check=False)
    assert done.returncode == -signal.SIGKILL
    # the workers outlive their launcher until they have saved and written the summary; wait for them to exit
    # (the pattern goes in the environment, so the waiter's own command line does not hold it)
    env = dict(os.environ, PYTHONPATH=str(ROOT), WORKERS_OF=f"training.output_dir={out}")
    waiter = ("import os, subprocess, time\n"
              "while subprocess.run(['pgrep', '-f', os.environ['WORKERS_OF']], capture_output=True).returncode == 0:\n"
              "    time.sleep(0.2)\n")
    subprocess.run([sys.executable, "-c", waiter], env=env, timeout=300, check=True)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["reason"] == "the process that started this one is gone"
    saved = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    assert saved == [summary["steps"]] and summary["steps"] < 10


def test_a_torn_blank_or_undecodable_metrics_line_does_not_stop_a_resume(tmp_path):
    """A crash mid-write leaves metrics.jsonl with a torn last line; blank lines and a stray byte are no records
    either. The resume keeps every whole record up to its step, drops the rest, and goes on."""
    from ernie_moe.training import Trainer

    out = tmp_path / "run"
    steps = [f"training.output_dir={out}", *QUIET, "training.save_steps=2"]
    Trainer(load_config(CONFIG, [*steps, "training.max_steps=2"])).train()
    whole = (out / "metrics.jsonl").read_bytes()
    (out / "metrics.jsonl").write_bytes(whole + b"\n\n\xff\xfe\n" + b'{"step": 3, "loss": 0.')
    Trainer(load_config(CONFIG, [*steps, "training.max_steps=4", "training.resume_from_checkpoint=auto"])).train()
    text = (out / "metrics.jsonl").read_text()
    assert text.startswith(whole.decode())
    assert [r["step"] for r in map(json.loads, text.splitlines()) if "loss" in r] == [1, 2, 3, 4]


def test_a_resume_with_other_model_settings_or_a_hand_edited_state_is_refused_naming_it(tmp_path):
    """A resume whose model settings differ from the checkpoint's (they change what its weights compute) stops
    naming each; a trainer_state.json edited by hand (a field gone, of the wrong kind), its digest in COMPLETE
    edited to match, is a checkpoint error naming the field."""
    import hashlib

    from ernie_moe.checkpoint import CheckpointError
    from ernie_moe.training import Trainer

    out = tmp_path / "run"
    steps = [f"training.output_dir={out}", *QUIET, "training.save_steps=2"]
    Trainer(load_config(CONFIG, [*steps, "training.max_steps=2"])).train()
    resume = [*steps, "training.max_steps=4", "training.resume_from_checkpoint=auto"]
    with pytest.raises(CheckpointError, match=r"model\.moe_k: 2 in the checkpoint, 1 now"):
        Trainer(load_config(CONFIG, [*resume, "model.moe_k=1"]))
    Trainer(load_config(CONFIG, [*resume, "model.moe_aux_loss_lambda=0.5"]))  # how training weighs a loss may change
    state_file = out / "checkpoint-2" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    for edited, message in (({k: v for k, v in state.items() if k != "scheduler"}, "'scheduler' must be an object"),
                            ({**state, "data": {**state["data"], "position": 10 ** 12}},
                             "'position' must be a place in an epoch of 20000 samples .0 to 20000., not 1000000000000"),
                            ({**state, "data": {**state["data"], "open_row": [10 ** 12]}},
                             "'open_row' must be a list of at most 48 sample indices below 20000"),
                            ({**state, "data": {**state["data"], "rows_read": -1}},
                             "'rows_read' must be a whole number of 0 or more"),
                            ({**state, "data": {**state["data"], "open_row": [0] * 40}},
                             r"open row \(40 samples, 520 tokens\) is no row the plan fills"),
                            ({**state, "data": {**state["data"], "epoch": 10 ** 12}},
                             r"'epoch' \(1000000000000\) is past the last one its 4 rows read could reach "
                             r"\(epoch 240\)"),
                            ([state], "not an object"), (DEEP, "nested too deep")):
        state_file.write_text(edited if isinstance(edited, str) else json.dumps(edited))
        marker = json.loads((out / "checkpoint-2" / "COMPLETE").read_text())
        marker["files"]["trainer_state.json"] = hashlib.sha256(state_file.read_bytes()).hexdigest()
        (out / "checkpoint-2" / "COMPLETE").write_text(json.dumps(marker))
        with pytest.raises(CheckpointError, match=message):
            Trainer(load_config(CONFIG, [*resume, "training.resume_from_checkpoint=" + str(out / "checkpoint-2")]))


DEEP = "[" * 100_000 + "]" * 100_000  # deeper than the JSON decoder's recursion


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json", "vocab.json",
                                  "preprocessor_config.json"])
@pytest.mark.parametrize("content, why", [(DEEP.encode(), "nested too deep"), (b'{"a": "\xff"}', "not UTF-8"),
                                          (b'{"a": ', "Expecting value")], ids=["deep", "latin-1", "cut"])
def test_every_json_file_of_a_model_folder_read_by_generate_is_a_clear_error(tmp_path, capsys, name, content, why):
    """Each JSON file generate reads from a model folder, nested deeper than the decoder survives, not UTF-8 or
    cut short: exit 2 and one line naming the file and why, never a traceback."""
    from ernie_moe.checkpoint import save_model
    from ernie_moe.generate import main as generate_main
    from ernie_moe.model.ernie_vl import ErnieMoEForConditionalGeneration

    cfg = load_config(CONFIG, ["data.image_size=56"])
    folder = tmp_path / "model"
    save_model(ErnieMoEForConditionalGeneration(cfg.model), cfg.model, str(folder), build_tokenizer(cfg),
               hf_layout=True)
    (folder / name).write_bytes(content)
    assert generate_main(["--model", str(folder), "--prompt", "a"]) == 2
    err = capsys.readouterr().err.strip()
    assert name in err and why in err and len(err.splitlines()) == 1, err


def test_a_chat_template_file_too_large_or_not_text_is_refused_before_it_is_read(tmp_path):
    from ernie_moe.data.encoding.tokenizer import MAX_TEMPLATE_BYTES, chat_template_in

    template = tmp_path / "chat_template.jinja"
    template.write_bytes(b"{{ messages }}")
    assert chat_template_in(tmp_path) == "{{ messages }}"
    for content, why in ((b" " * (MAX_TEMPLATE_BYTES + 1), "not a chat template"), (b"\xff{{ x }}", "not UTF-8")):
        template.write_bytes(content)
        with pytest.raises(ValueError, match=why):
            chat_template_in(tmp_path)


def test_silent_cases_speak(tmp_path, monkeypatch, capsys):
    """An unreadable COMPLETE marker is passed over with a warning; integer bytes where a weight belongs are
    refused; skipped held-out samples are reported beside the evaluation; an export that cannot write is an export
    error, not safetensors' traceback."""
    from safetensors import SafetensorError

    import ernie_moe.export as export_module
    from ernie_moe.checkpoint import CheckpointError
    from ernie_moe.checkpoint.pretrained import load_pretrained
    from ernie_moe.training import Trainer

    out, held_out = tmp_path / "run", tmp_path / "eval.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a red dot"}]}
    held_out.write_text(json.dumps(good) + "\n{broken\n")
    tr = Trainer(load_config(CONFIG, [f"training.output_dir={out}", *QUIET, "training.save_steps=1",
                                      "training.max_steps=2", f"data.eval_path={held_out}", "data.dataset=jsonl",
                                      f"data.train_path={held_out}", "model.vocab_size=300"]))
    summary = tr.train()
    assert summary["eval_skipped_bad_json"] == 1
    (out / "checkpoint-2" / MARKER).write_text("{not json")
    warnings = []
    assert resolve("auto", str(out), warn=warnings.append).step == 1
    assert any("checkpoint-2 has no readable COMPLETE marker" in w for w in warnings)
    # resumed from step 1, the run saves step 2 again: beside the damaged folder, whose files stay
    intact = sorted(p.name for p in (out / "checkpoint-2").iterdir())
    resumed = Trainer(load_config(CONFIG, [f"training.output_dir={out}", *QUIET, "training.save_steps=1",
                                           "training.max_steps=2", "data.dataset=jsonl", f"data.train_path={held_out}",
                                           "model.vocab_size=300", "training.resume_from_checkpoint=auto"]))
    resumed.train()
    assert sorted(p.name for p in (out / "checkpoint-2").iterdir()) == intact
    assert read(out / f"checkpoint-2-{resumed.run.run_id}").step == 2
    final = out / "final_model"
    shard = next(final.glob("model-*.safetensors"))
    tensors = load_file(str(shard))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].view(np.int32)
    save_file(tensors, str(shard))
    with pytest.raises(CheckpointError, match="model.norm.weight.*is stored as int32"):
        load_pretrained(tr.parts.model, final)
    monkeypatch.setattr(export_module, "save_file", lambda *a, **k: (_ for _ in ()).throw(
        SafetensorError("No space left on device (os error 28)")))
    assert export_module.main([str(out / "checkpoint-1"), str(tmp_path / "exported")]) == 2
    assert "export error: cannot write" in capsys.readouterr().err


def test_a_data_file_rewritten_during_a_run_or_a_fifo_for_a_shard_stops_with_a_line(tmp_path):
    """A training file changed under a running job is a data error (its offsets would read garbage as bad_json),
    with or without workers; a FIFO where a shard belongs is refused instead of blocking the reader."""
    from ernie_moe.checkpoint import CheckpointError
    from ernie_moe.checkpoint.pretrained import load_pretrained
    from ernie_moe.data import DataError
    from ernie_moe.training import Trainer

    data = tmp_path / "train.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a red dot"}]}
    data.write_text((json.dumps(good) + "\n") * 8)
    for workers in (0, 2):
        out = tmp_path / f"run{workers}"
        tr = Trainer(load_config(CONFIG, [f"training.output_dir={out}", *QUIET, "training.max_steps=50",
                                          "data.dataset=jsonl", f"data.train_path={data}", "model.vocab_size=300",
                                          f"data.num_workers={workers}"]))
        tr.train_step()
        data.write_text((json.dumps(good) + " \n") * 9)  # another file under the same name
        with pytest.raises(DataError, match="changed while this run reads it"):
            for _ in range(4):
                tr.train_step()
        tr.parts.feed.close()
    model = tmp_path / "model"
    tr.step = 50
    tr._finish({})
    (out / "final_model").rename(model)
    shard = next(model.glob("model-*.safetensors"))
    shard.unlink()
    os.mkfifo(shard)
    with pytest.raises(CheckpointError, match="is not a regular file"):
        load_pretrained(tr.parts.model, model)


def test_a_peer_lost_in_a_collective_is_one_line_naming_the_ranks(monkeypatch, capsys):
    """gloo's error for a rank that died (as rank 0's all_gather_object read it when rank 1 was killed with -9),
    or did not answer in time, ends the run with one line naming this rank and the peer, exit 1 (the launcher's
    cue to restart an elastic job), not gloo's trace; any other RuntimeError is not taken for one."""
    from ernie_moe.parallel.env import peer_lost
    from ernie_moe.training import trainer

    reset = RuntimeError("[/paddle/third_party/gloo/gloo/transport/tcp/pair.cc:576] Read error [127.0.0.1]:18320: "
                         "Connection reset by peer")
    timeout = RuntimeError("[/paddle/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
                           "1800000ms for recv operation to complete: TIMEOUT self_rank = 0 pair_rank = 1")
    monkeypatch.setenv("PADDLE_TRAINER_ID", "0")
    assert peer_lost(reset).startswith("rank 0 lost a peer: another rank of the job stopped answering")
    assert "Connection reset by peer" in peer_lost(reset)
    assert peer_lost(timeout).startswith("rank 0 lost a peer: rank 1 of the job stopped answering")
    assert peer_lost(RuntimeError("out of memory")) is None and peer_lost(ValueError(str(reset))) is None

    def lose_the_peer(self, cfg):
        raise timeout

    monkeypatch.setattr(trainer.Trainer, "__init__", lose_the_peer)
    assert run_trainer.main(["--config", CONFIG, *QUIET, "training.max_steps=1"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("distributed error: rank 0 lost a peer: rank 1") and len(err.splitlines()) == 1, err
