"""Jobs beside and after each other and the signals that stop them: one writer per output folder, SIGTERM to
one rank, a killed launcher, a lost peer, resumes with other settings; each stops every rank after the same step,
saved, or refuses in one line.

Crashes are placed with ``ERNIE_MOE_FAULT`` (``ernie_moe/faults.py``), so no test waits on timing.
"""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from support.runs import CONFIG, QUIET, ROOT, losses, train

import run_trainer
from ernie_moe.checkpoint.lineage import MARKER, read, resolve
from ernie_moe.config import load_config
from ernie_moe.data import build_tokenizer

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
