"""Jobs that restart themselves: Paddle's elastic launcher with a real etcd on the loopback address, started through
``python -m ernie_moe.elastic``. A worker killed, a node joining and a node lost each restart the job, which resumes
from its own newest checkpoint with the global batch it started with; etcd going away ends the command with a line
naming it; the output folder refuses another job while a restart of the same one takes it over. The waits are on
conditions the package writes (a fault's marker, a process's end), each with a bound."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from support.runs import CONFIG, QUIET, ROOT, losses, train

from ernie_moe import faults
from ernie_moe.checkpoint.output_lock import lock_output_dir, note_attempt, release_output_dir
from ernie_moe.config import ConfigError, load_config
from ernie_moe.elastic import launch
from ernie_moe.elastic.job import JOB_VARIABLE, RECORD, Attempt, JobRecord, restart_history, why_restarted
from ernie_moe.parallel.global_batch import for_world, global_batch
from ernie_moe.training.stop import EXIT_CODE

# 7 steps of a global batch of 4 rows: 2 accumulation steps on one process, 1 on two
JOB = ["training.max_steps=7", "training.global_batch_size=4", "training.save_steps=1"]
BOUND_S = 420  # the most any one wait below may take on a loaded 2-core machine


# ----------------------------------------------------------------------------------------- the job's record

def test_the_record_keeps_each_attempt_of_its_own_job_and_says_why_each_restart_happened(tmp_path):
    record, other = JobRecord(tmp_path, "j"), JobRecord(tmp_path, "k")
    first = Attempt(0, 1, 4, 0, "run-a")
    record.begin(first)
    other.begin(Attempt(0, 8, 64, 0, "run-x"))
    record.end(first, "stopped", 2, "SIGTERM received")
    second = Attempt(1, 2, 4, 2, "run-b")
    record.begin(second)  # no end: killed
    third = Attempt(2, 1, 4, 5, "run-c")
    record.begin(third)
    with open(tmp_path / RECORD, "a") as f:
        f.write('{"job": "j", "event": "start", "attempt": "torn\n\x00\xff not json\n')
    attempts = record.attempts()
    assert [(a.number, a.world_size, a.step, a.run_id, a.ended) for a in attempts] == [
        (0, 1, 0, "run-a", "stopped"), (1, 2, 2, "run-b", None), (2, 1, 5, "run-c", None)]
    assert record.first_global_batch() == 4 and other.first_global_batch() == 64
    assert JobRecord(tmp_path, "none").attempts() == [] and JobRecord(tmp_path / "absent", "j").attempts() == []
    history = restart_history(attempts)
    assert [(h["attempt"], h["step"], h["world_size"]) for h in history] == [(1, 2, 2), (2, 5, 1)]
    assert history[0]["why"] == "attempt 0 stopped at step 2: SIGTERM received; world size 1 -> 2"
    assert history[1]["why"].startswith("attempt 1 wrote no end (a process was killed, or its node lost")
    assert history[1]["why"].endswith("; world size 2 -> 1")
    assert why_restarted(Attempt(0, 2, 4, 0, "r", ended="failed", end_step=3), 2) == "attempt 0 failed at step 3"


def test_a_record_with_impossible_counts_or_not_a_regular_file_is_never_trusted(tmp_path):
    """A start line no attempt could have written (a global batch of -8, world size 0) is passed over as an
    unreadable one; a record that is a FIFO or a link is one error naming it, not a start blocked forever."""
    with open(tmp_path / RECORD, "w") as f:
        for attempt, world, batch in ((0, 1, -8), (1, 0, 4), (2, 2, 4)):
            f.write(json.dumps({"job": "j", "event": "start", "attempt": attempt, "world_size": world,
                                "global_batch": batch, "step": 0, "run_id": "r"}) + "\n")
    assert [a.number for a in JobRecord(tmp_path, "j").attempts()] == [2]
    assert JobRecord(tmp_path, "j").first_global_batch() == 4
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / RECORD)
    (tmp_path / "link").mkdir()
    (tmp_path / "link" / RECORD).symlink_to(tmp_path / RECORD)
    for folder in ("fifo", "link"):
        with pytest.raises(OSError, match="the elastic job's record\\) is not a regular file"):
            JobRecord(tmp_path / folder, "j").attempts()
        with pytest.raises(OSError, match="is not a regular file"):
            JobRecord(tmp_path / folder, "j").begin(Attempt(0, 1, 4, 0, "r"))


def test_the_record_is_read_from_its_end_only(tmp_path, monkeypatch):
    monkeypatch.setattr("ernie_moe.elastic.job.MAX_READ_BYTES", 400)
    record = JobRecord(tmp_path, "j")
    for n in range(20):
        record.begin(Attempt(n, 2, 4, n, f"run-{n}"))
    kept = record.attempts()
    assert kept and kept[-1].number == 19 and len(kept) < 20  # the oldest lines, past the bound, are not read


@pytest.mark.parametrize("world, accumulation", [(1, 4), (2, 2), (4, 1)])
def test_the_global_batch_sets_the_accumulation_steps_for_the_world_size(world, accumulation):
    cfg = load_config(CONFIG, ["training.per_device_train_batch_size=2", "training.global_batch_size=8"])
    resolved = for_world(cfg, world)
    assert resolved.training.gradient_accumulation_steps == accumulation and global_batch(resolved, world) == 8
    plain = load_config(CONFIG, ["training.per_device_train_batch_size=2", "training.gradient_accumulation_steps=3"])
    assert for_world(plain, world) is plain  # no global batch asked for: the config as it is
    assert for_world(plain, world, kept=8).training.gradient_accumulation_steps == accumulation  # a restart's


def test_the_memory_planner_counts_the_accumulation_steps_the_global_batch_gives():
    from ernie_moe.memory.report import planned

    derived = load_config(CONFIG, ["training.per_device_train_batch_size=2", "training.global_batch_size=16"])
    written = load_config(CONFIG, ["training.per_device_train_batch_size=2", "training.gradient_accumulation_steps=8"])
    assert planned(derived, 1)[0] == planned(written, 1)[0] != planned(load_config(CONFIG, [
        "training.per_device_train_batch_size=2"]), 1)[0]


def test_a_global_batch_the_world_cannot_make_is_a_config_error():
    cfg = load_config(CONFIG, ["training.per_device_train_batch_size=2", "training.global_batch_size=6"])
    with pytest.raises(ConfigError, match=r"global batch of 6 rows \(training.global_batch_size\) cannot be made by "
                                          r"2 data rank\(s\).*multiple of 4"):
        for_world(cfg, 2)
    with pytest.raises(ConfigError, match="first attempt, kept across its restarts"):
        for_world(load_config(CONFIG, ["training.per_device_train_batch_size=4"]), 1, kept=6)
    with pytest.raises(ConfigError, match="global_batch_size cannot be negative"):
        load_config(CONFIG, ["training.global_batch_size=-1"])


# ------------------------------------------------------------------------------------------ the output lock

HOLD_AS = ("import signal, sys\nfrom ernie_moe.checkpoint.output_lock import lock_output_dir\n"
           "if sys.argv[3] == 'deaf': signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
           "lock_output_dir(sys.argv[1], sys.argv[2])\nprint('locked', flush=True)\nsys.stdin.read()\n")


def hold_as(folder, job, deaf=False, environment=None):
    """A process holding ``folder``'s lock as an attempt of ``job`` (ignoring SIGTERM when ``deaf``), with
    ``PADDLE_JOB_ID=<environment>`` (default: ``job``) in its environment."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD_AS, str(folder), job, "deaf" if deaf else "-"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(ROOT), **{JOB_VARIABLE: environment or job}))
    assert holder.stdout.readline().strip() == "locked"
    return holder


@pytest.mark.parametrize("deaf", [False, True])
def test_a_restart_of_the_same_job_takes_the_lock_over_and_any_other_job_is_refused(tmp_path, monkeypatch, deaf):
    """An earlier attempt of job j still holding the folder (an orphan) is stopped (SIGTERM; SIGKILL when it does
    not listen) and the restart holds the folder; job k, and a run with no job, are refused at once."""
    monkeypatch.setattr("ernie_moe.checkpoint.output_lock.STOP_GRACE_S", 2.0)
    holder = hold_as(tmp_path, "j", deaf)
    try:
        for job in ("k", ""):
            with pytest.raises(ConfigError, match=f"in use by a running job \\(job j, host .*process {holder.pid}"):
                lock_output_dir(tmp_path, job)
        said = []
        lock_output_dir(tmp_path, "j", say=lambda line, **_: said.append(line))
        assert holder.wait(timeout=60) == (-signal.SIGKILL if deaf else -signal.SIGTERM)
        assert said and said[0].startswith(f"taking over training.output_dir '{tmp_path}' from an earlier attempt "
                                           f"of job j (job j, host ")
        assert json.loads((tmp_path / ".run.lock").read_text())["pid"] == os.getpid()
        note_attempt(tmp_path, 3)  # what a restart adds once it has read the job's record
        assert json.loads((tmp_path / ".run.lock").read_text())["attempt"] == 3
        refused = subprocess.run([sys.executable, "-c", HOLD_AS, str(tmp_path), "k", "-"], text=True,
                                 capture_output=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
        assert refused.returncode == 1 and "in use by a running job (job j, attempt 3, host" in refused.stderr
    finally:
        holder.kill()
        release_output_dir(tmp_path)


def test_a_holder_whose_environment_is_not_the_job_s_is_waited_for_never_signalled(tmp_path, monkeypatch):
    """The lock's line names job j, but the process of that number is no worker of j (a process number reused):
    the restart waits for the lock (here 1 s) instead of signalling it, then stops naming the holder."""
    monkeypatch.setattr("ernie_moe.checkpoint.output_lock.REMOTE_WAIT_S", 1.0)
    holder = hold_as(tmp_path, "j", environment="another")
    try:
        with pytest.raises(ConfigError, match=f"in use by a running job \\(job j, host .*process {holder.pid}"):
            lock_output_dir(tmp_path, "j", say=lambda *_, **__: None)
        assert holder.poll() is None
    finally:
        holder.kill()


# ---------------------------------------------------------------------------------- the command, before Paddle

def test_the_command_refuses_what_the_launcher_cannot_restart_with_one_line(capsys):
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # a port nothing listens on
    script = ["run_trainer.py", "--config", CONFIG]
    cases = [([*script], "needs --master etcd://HOST:PORT"),
             (["--master", "127.0.0.1:1234", "--job_id", "j", *script], "needs --master etcd://HOST:PORT"),
             ([f"--master=etcd://127.0.0.1:{port}", *script], "needs --job_id NAME"),
             (["--master", "etcd://127.0.0.1", "--job_id", "j", *script], "names no port"),
             (["--master", f"etcd://127.0.0.1:{port}", "--job_id", "j", *script],
              f"cannot reach etcd at 127.0.0.1:{port}: start it")]
    # counts the launcher would wait on forever (no node), fail on with a traceback, or never name
    master = ["--master", f"etcd://127.0.0.1:{port}", "--job_id", "j"]
    cases += [([*master, "--nnodes", "0", *script], "--nnodes 0 must be at least 1"),
              ([*master, "--nnodes", "abc", *script], "--nnodes 'abc' must be a node count N or a range"),
              ([*master, "--nnodes=3:2", *script], "the range's minimum 3 is above its maximum 2"),
              ([*master, "--nproc_per_node", "-1", *script], "--nproc_per_node '-1' must be a whole number"),
              ([*master, "--max_restart", "x", *script], "--max_restart 'x' must be a whole number")]
    for args, expected in cases:
        assert launch.main(args) == launch.USAGE
        err = capsys.readouterr().err
        assert err.startswith("elastic: ") and expected in err and len(err.strip().splitlines()) == 1, err


def test_the_command_passes_the_job_id_to_the_workers_and_leaves_the_script_s_own_options_alone():
    args = ["--job_id", "j", "--nnodes=1:2", "run_trainer.py", "--job_id", "x", "--config", "c.yaml"]
    assert launch._option(args, "--job_id") == "j" and launch._option(args, "--nnodes") == "1:2"
    assert launch._option(["run_trainer.py", "--master", "m"], "--master") is None
    assert launch._without(args, "--job_id") == ["--nnodes=1:2", "run_trainer.py", "--job_id", "x", "--config",
                                                 "c.yaml"]
    assert launch._address("etcd://10.0.0.2:2379/") == ("10.0.0.2", 2379)
    assert launch.STOPPED == EXIT_CODE  # a worker that saved and stopped, as the trainer exits


def test_the_launcher_is_started_again_while_restarts_remain_unless_a_worker_cannot_start(monkeypatch, capsys):
    """Paddle's launcher exiting with an error code is started again, up to --max_restart times; not when a worker
    stopped on its config, data or checkpoint (run_trainer marks it), which every restart would meet again."""
    started = []

    class Launcher:
        def __init__(self, cmd, env):
            started.append(cmd)
            self.env = env

        def wait(self):
            if self.env.get("UNFIXABLE"):
                with monkeypatch.context() as m:
                    m.setenv(launch.FINISHED_VARIABLE, self.env[launch.FINISHED_VARIABLE])
                    launch.mark_finished(unfixable=True)
            return 1

    monkeypatch.setattr(launch, "_problem", lambda *a: None)
    monkeypatch.setattr(launch, "_answers", lambda host, port: True)
    monkeypatch.setattr(launch, "_become_subreaper", lambda: None)
    monkeypatch.setattr(launch, "_wait_for_orphans", lambda: [])
    monkeypatch.setattr(launch.subprocess, "Popen", Launcher)
    command = ["--master", "etcd://127.0.0.1:1", "--job_id", "j", "--max_restart", "2", "run_trainer.py"]
    assert launch.main(command) == 1 and len(started) == 3
    said = capsys.readouterr().err
    assert said.count("starting it again") == 2 and "(2 of --max_restart 2)" in said
    monkeypatch.setenv("UNFIXABLE", "1")
    started.clear()
    assert launch.main(command) == 1 and len(started) == 1
    assert "starting it again" not in capsys.readouterr().err


def test_a_fault_strikes_once_in_a_job_and_several_can_be_named(tmp_path, monkeypatch):
    monkeypatch.setenv(faults.VARIABLE, "hold_in_step@2, kill_in_step@4@1")
    monkeypatch.setenv(faults.ONCE_VARIABLE, str(tmp_path))
    assert not faults.at("kill_in_step", 4, 0) and not faults.at("hold_in_step", 3, 0)
    assert faults.at("kill_in_step", 4, 1) and not faults.at("kill_in_step", 4, 1)  # a restart meets it no more
    assert faults.at("hold_in_step", 2, 1) and not faults.at("hold_in_step", 2, 0)
    assert not faults.released()
    (tmp_path / "release").touch()
    assert faults.released()


# ------------------------------------------------------------------------------------- real launchers and etcd

class Etcd:
    """etcd on free loopback ports, with its data in a folder of the test's."""

    def __init__(self, folder):
        self.port, peer = free_port(), free_port()
        self.log = open(folder / "etcd.log", "w")
        url, peer_url = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{peer}"
        self.process = subprocess.Popen(
            ["etcd", "--name", "e", "--data-dir", str(folder / "etcd"), "--listen-client-urls", url,
             "--advertise-client-urls", url, "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls",
             peer_url, "--initial-cluster", f"e={peer_url}"], stdout=self.log, stderr=subprocess.STDOUT)
        wait_for(lambda: launch._answers("127.0.0.1", self.port, timeout=1), [self.process], 60, "etcd to answer")

    def stop(self):
        self.process.kill()
        self.process.wait(timeout=60)
        self.log.close()


@pytest.fixture
def etcd(tmp_path):
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed (Debian's etcd-server; .ci/run installs it)")
    server = Etcd(tmp_path)
    yield server
    server.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition, processes, bound_s, what):
    """Poll ``condition`` until it holds; fail when a process in ``processes`` ends first or ``bound_s`` passes."""
    deadline = time.monotonic() + bound_s
    while not condition():
        ended = [p for p in processes if p.poll() is not None]
        assert not ended, f"a process ended (codes {[p.returncode for p in ended]}) while waiting for {what}"
        assert time.monotonic() < deadline, f"no {what} in {bound_s} s"
        time.sleep(0.2)


def start_elastic(tmp_path, name, etcd, *launcher, fault=""):
    """``python -m ernie_moe.elastic`` for job ``j`` writing into tmp_path/out; its output goes to tmp_path/<name>."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **{faults.VARIABLE: fault,
                                                                        faults.ONCE_VARIABLE: str(tmp_path)})
    env.pop(JOB_VARIABLE, None)
    cmd = [sys.executable, "-m", "ernie_moe.elastic", "--master", f"etcd://127.0.0.1:{etcd.port}", "--job_id", "j",
           "--host", "127.0.0.1", "--log_dir", str(tmp_path / f"{name}_log"), *launcher,
           str(ROOT / "run_trainer.py"), "--config", CONFIG, f"training.output_dir={tmp_path / 'out'}", *QUIET, *JOB]
    output = open(tmp_path / name, "w")
    return subprocess.Popen(cmd, stdout=output, stderr=subprocess.STDOUT, cwd=tmp_path, env=env)


def said(tmp_path, name) -> str:
    logs = sorted((tmp_path / f"{name}_log").glob("workerlog.*"))
    return (tmp_path / name).read_text() + "".join(log.read_text() for log in logs)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The job's losses in one process that nothing stops (2 accumulation steps of 2 rows a step)."""
    out = tmp_path_factory.mktemp("uninterrupted") / "out"
    train(out, *JOB)
    return losses(out)


def assert_same_losses(out, uninterrupted):
    resumed = losses(out)  # a step trained again after a restart: its later record counts
    assert sorted(resumed) == sorted(uninterrupted) == list(range(1, 8))
    np.testing.assert_allclose([resumed[s] for s in range(1, 8)], [uninterrupted[s] for s in range(1, 8)],
                               rtol=1e-4)


@pytest.mark.slow
def test_a_worker_killed_mid_run_restarts_the_job_which_ends_with_the_uninterrupted_losses(tmp_path, etcd,
                                                                                          uninterrupted):
    """Two workers on one node; while the job is held at step 2 another job is refused the output folder; then
    rank 1 is killed with -9 in step 4: the launcher restarts both, the restart takes the folder over, resumes from
    the job's newest checkpoint at world size 2 and finishes with the losses of the uninterrupted run."""
    job = start_elastic(tmp_path, "node", etcd, "--nnodes", "1", "--nproc_per_node", "2", "--max_restart", "2",
                        fault="hold_in_step@2,kill_in_step@4@1")
    try:
        wait_for(lambda: (tmp_path / "hold_in_step").exists(), [job], BOUND_S, "the job to reach step 2")
        other = train(tmp_path / "out", *JOB, check=False)
        assert other.returncode == 2 and "is in use by a running job (job j, attempt 0, host" in other.stderr, \
            other.stderr
        (tmp_path / "release").touch()
        assert job.wait(timeout=BOUND_S) == 0, said(tmp_path, "node")[-4000:]
    finally:
        job.kill()
    assert (tmp_path / "kill_in_step").exists()
    attempts = JobRecord(tmp_path / "out", "j").attempts()
    assert len(attempts) >= 2 and {(a.world_size, a.global_batch) for a in attempts} == {(2, 4)}
    assert attempts[0].ended is None and attempts[-1].ended == "done" and 1 <= attempts[1].step <= 4
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["status"] == "done" and summary["restarts"] == len(attempts) - 1
    assert summary["restart_history"][0]["why"].startswith("attempt 0 wrote no end")
    assert f"restart 1 of job j: step {attempts[1].step} on 2 process(es)" in said(tmp_path, "node")
    metrics = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert {(r["job/restarts"], r["job/world_size"]) for r in metrics if "loss" in r} >= {(0, 2), (1, 2)}
    assert_same_losses(tmp_path / "out", uninterrupted)


@pytest.mark.slow
def test_a_launcher_that_gives_up_is_started_again_and_the_job_finishes(tmp_path, etcd, uninterrupted):
    """Paddle's launcher with --max_restart 1 restarts the worker killed in step 3 and again when it is killed
    while saving step 5 (it restarts once more than the option says), then gives up when it is killed before its
    checkpoint of step 6 is renamed (as it gives up on a restart that meets a slow or vanished peer): the command
    starts the launcher again, the job resumes from its newest whole checkpoint and ends with the uninterrupted
    run's losses."""
    job = start_elastic(tmp_path, "node", etcd, "--nnodes", "1", "--nproc_per_node", "1", "--max_restart", "1",
                        fault="kill_in_step@3,kill_during_save@5,kill_before_rename@6")
    try:
        code = job.wait(timeout=BOUND_S * 2)
    finally:
        job.kill()
    output = said(tmp_path, "node")
    assert code == 0, output[-6000:]
    assert re.search(r"elastic: job j: Paddle's launcher ended with code \d+ before the job finished; starting it "
                     r"again \(1 of --max_restart 1\)", output), output[-6000:]
    assert all((tmp_path / point).exists() for point in ("kill_in_step", "kill_during_save", "kill_before_rename"))
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["status"] == "done"
    assert_same_losses(tmp_path / "out", uninterrupted)


@pytest.mark.slow
def test_a_node_joining_and_a_node_lost_resize_the_job_which_keeps_its_global_batch(tmp_path, etcd, uninterrupted):
    """``--nnodes 1:2``: node a trains alone (world size 1, 2 accumulation steps) and is held at step 2; node b
    joins and both restart at world size 2 (1 accumulation step); in step 5 rank 1's node is lost (its launcher and
    worker killed with -9) and the survivor finishes alone at world size 1, with the uninterrupted run's losses."""
    nodes = ["--nnodes", "1:2", "--nproc_per_node", "1", "--max_restart", "3", "--elastic_timeout", "10"]
    a = start_elastic(tmp_path, "a", etcd, *nodes, fault="hold_in_step@2,node_lost@5@1")
    b = None
    try:
        wait_for(lambda: (tmp_path / "hold_in_step").exists(), [a], BOUND_S, "node a to reach step 2")
        b = start_elastic(tmp_path, "b", etcd, *nodes, fault="hold_in_step@2,node_lost@5@1")
        codes = [a.wait(timeout=BOUND_S), b.wait(timeout=BOUND_S)]
    finally:
        for node in (a, b):
            if node is not None:
                node.kill()
    record = (tmp_path / "out" / RECORD).read_text() if (tmp_path / "out" / RECORD).exists() else ""
    with_logs(lambda: check_resized(tmp_path, codes, uninterrupted),
              f"{record}\n--- a\n{said(tmp_path, 'a')[-6000:]}\n--- b\n{said(tmp_path, 'b')[-6000:]}")


def with_logs(check, logs):
    """``check()``, its failure shown with the logs that explain it."""
    try:
        check()
    except AssertionError as err:
        raise AssertionError(f"{err}\n{logs}") from None


def check_resized(tmp_path, codes, uninterrupted):
    # the lost node's command says its launcher was killed; the survivor's finished the job
    assert sorted(codes) == [0, 128 + signal.SIGKILL]
    lost = said(tmp_path, "ab"[codes.index(128 + signal.SIGKILL)])
    assert "elastic: job j failed: the launcher was killed by signal 9" in lost
    # world sizes 1, 2, 1 (the launcher may restart a size twice: its heartbeats decide), one global batch
    attempts = JobRecord(tmp_path / "out", "j").attempts()
    sizes = [a.world_size for a in attempts]
    assert [n for i, n in enumerate(sizes) if i == 0 or n != sizes[i - 1]] == [1, 2, 1]
    assert {a.global_batch for a in attempts} == {4}
    joined, lost = sizes.index(2), len(sizes) - sizes[::-1].index(2)  # the first at 2, the first at 1 after
    assert attempts[joined].step == 2 and attempts[lost].step >= 3  # 2: the checkpoint saved when told to stop
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["restarts"] == len(attempts) - 1 and summary["status"] == "done"
    whys = [h["why"] for h in summary["restart_history"]]
    assert whys[joined - 1].startswith(f"attempt {joined - 1} stopped at step 2: ")
    assert whys[joined - 1].endswith("world size 1 -> 2") and whys[lost - 1].endswith("world size 2 -> 1")
    assert_same_losses(tmp_path / "out", uninterrupted)


@pytest.mark.slow
def test_etcd_going_away_ends_the_command_with_a_line_naming_it_after_the_workers_saved(tmp_path, etcd):
    """Paddle's launcher exits with code 0 (or 1) when etcd dies under it, leaving its worker running; the command
    says what happened, exits with a code of its own, and returns only after that worker saved its step and
    stopped."""
    job = start_elastic(tmp_path, "node", etcd, "--nnodes", "1", "--nproc_per_node", "1", fault="hold_in_step@2")
    try:
        wait_for(lambda: (tmp_path / "hold_in_step").exists(), [job], BOUND_S, "the job to reach step 2")
        etcd.stop()
        code = job.wait(timeout=BOUND_S)
    finally:
        job.kill()
    output = said(tmp_path, "node")
    assert code == launch.ETCD_LOST, output[-4000:]
    assert (f"elastic: job j did not finish: etcd at 127.0.0.1:{etcd.port} stopped answering and Paddle's launcher "
            "gave up (exit code ") in output and "the 1 worker(s) it left saved a checkpoint and stopped" in output
    assert (tmp_path / "out" / "checkpoint-2" / "COMPLETE").is_file()
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["status"] == "stopped"



@pytest.mark.slow
def test_sigterm_to_the_command_stops_the_job_with_its_step_saved(tmp_path, etcd):
    """A scheduler's preemption reaches the command: the launcher stops its worker, which saves its step; the
    command exits 4, as the trainer does when it stops on a signal."""
    job = start_elastic(tmp_path, "node", etcd, "--nnodes", "1", "--nproc_per_node", "1", fault="hold_in_step@2")
    try:
        wait_for(lambda: (tmp_path / "hold_in_step").exists(), [job], BOUND_S, "the job to reach step 2")
        job.send_signal(signal.SIGTERM)
        code = job.wait(timeout=BOUND_S)
    finally:
        job.kill()
    output = said(tmp_path, "node")
    assert code == EXIT_CODE, output[-4000:]
    assert "elastic: job j stopped on SIGTERM: the launcher stopped its workers, which save their step" in output
    assert (tmp_path / "out" / "checkpoint-2" / "COMPLETE").is_file()
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["status"] == "stopped"
