"""What the package writes never lands where it must not: through a symbolic link, into a FIFO (which would block
the run for good), over a file or model the command reads, or over a model an earlier run left; and
``training.overwrite_output_dir`` removes only what earlier runs of this package wrote."""

import json
import os

import pytest
from support.lora import trainer

from ernie_moe import compare, evaluate
from ernie_moe.config import ConfigError
from ernie_moe.paths import Unwritable, open_output, write_output

VICTIM = "a file the user keeps\n"


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "precious.txt"
    path.write_text(VICTIM)
    return path


def test_an_output_follows_no_link_and_never_waits_on_a_fifo(tmp_path, victim):
    (tmp_path / "link").symlink_to(victim)
    with pytest.raises(Unwritable, match="is a symbolic link"):
        write_output(tmp_path / "link", "results")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(Unwritable, match="not a regular file"):
        write_output(tmp_path / "fifo", "results")  # returns at once: opened without blocking, then refused
    with pytest.raises(Unwritable, match="not a regular file"):
        open_output(tmp_path, "a")
    assert victim.read_text() == VICTIM
    write_output(tmp_path / "plain.json", "{}")
    with open_output(tmp_path / "plain.json", "a") as file:
        file.write("\n")
    assert (tmp_path / "plain.json").read_text() == "{}\n"


@pytest.mark.parametrize("name", ["metrics.jsonl", "rollouts.jsonl", "summary.json", "run_config.yaml"])
def test_a_run_refuses_run_files_that_are_links_or_fifos_before_it_builds_anything(tmp_path, victim, name):
    out = tmp_path / "run"
    out.mkdir()
    (out / name).symlink_to(victim)
    with pytest.raises(ConfigError, match="is a symbolic link"):
        trainer(out)
    (out / name).unlink()
    os.mkfifo(out / name)
    with pytest.raises(ConfigError, match="not a regular file"):
        trainer(out)
    assert victim.read_text() == VICTIM


def test_a_run_never_replaces_the_model_it_starts_from_nor_an_earlier_runs_model(tmp_path, base):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(base, out / "final_model")  # an earlier run's model, its checkpoints cleaned up
    with pytest.raises(ConfigError, match="already holds the model of an earlier run \\(final_model\\)"):
        trainer(out)
    for overwrite in ("false", "true"):  # not even when told to overwrite: it is the model the run reads
        with pytest.raises(ConfigError, match="would replace the model it starts from"):
            trainer(out, f"training.model_name_or_path={out / 'final_model'}",
                    f"training.overwrite_output_dir={overwrite}")
    assert trainer(out, "training.overwrite_output_dir=true").cfg.training.overwrite_output_dir
    assert (out / "final_model" / "config.json").is_file()  # replaced only when the run ends


def test_overwrite_output_dir_removes_only_this_packages_checkpoints(tmp_path):
    out = tmp_path / "run"
    for name in ("checkpoint-3", "checkpoint-7.tmp", "checkpoint-notes"):
        (out / name).mkdir(parents=True)
        (out / name / "kept.txt").write_text("x")
    (out / "checkpoint-readme.md").write_text("the user's notes")
    trainer(out, "training.overwrite_output_dir=true")
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == [
        "checkpoint-notes", "checkpoint-readme.md"]


def test_a_users_folder_named_like_a_checkpoint_is_no_earlier_run(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoint-notes").mkdir(parents=True)
    trainer(out)  # nothing of an earlier run here: a fresh run starts


def test_evaluate_and_compare_write_over_none_of_their_inputs(tmp_path, base, capsys):
    bench = tmp_path / "bench.tsv"
    bench.write_text("index\tquestion\tA\tB\tanswer\n0\tWhich?\tred\tgreen\tA\n")
    kept = bench.read_text(), (base / "config.json").read_text()
    for out in (bench, base / "config.json", base / "scores.json"):
        assert evaluate.main(["--model", str(base), "--benchmark", f"mcq:{bench}", "--out", str(out)]) == 2
        assert "this command reads; write it elsewhere" in capsys.readouterr().err
    assert (bench.read_text(), (base / "config.json").read_text()) == kept
    assert not (base / "scores.json").exists()

    report = tmp_path / "report"
    report.mkdir()
    sides = {}
    for name, score in (("before.json", 1.0), ("after.json", 0.0)):
        sides[name] = json.dumps({"benchmarks": {"b": {"kind": "mcq", "items": [
            {"unit": "0", "score": score, "category": "", "l2_category": ""}]}}})
        (report / name).write_text(sides[name])
    # the report's before.json / after.json are this comparison's inputs, swapped: nothing is written
    assert compare.main(["--before", str(report / "after.json"), "--after", str(report / "before.json"),
                         "--out", str(report)]) == 2
    assert "--out's" in capsys.readouterr().err
    assert {name: (report / name).read_text() for name in sides} == sides
