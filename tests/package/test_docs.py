"""Every command in README.md and docs/ is one this version accepts: each ``python -m ernie_moe...``,
``run_trainer.py`` (under the launcher or not) and ``benchmarks/`` command of a code block is parsed by its own
argument parser, and a training command's config file and overrides load, so a renamed flag, key or config file
fails here instead of for a reader. What the commands do is run by the journey tests (``test_e2e.py`` and each
feature's own)."""

import argparse
import json
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest
import yaml
from support.runs import ROOT

from ernie_moe.config import load_config

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LAUNCHER = "paddle.distributed.launch"


def commands(page: Path) -> list[str]:
    """The ``python`` commands of ``page``'s code blocks: continuation lines joined, ``$`` prompts and trailing
    comments left out, ``a && b`` as two."""
    found = []
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", page.read_text(), re.S | re.M):
        text = re.sub(r"\\\n\s*", " ", block)
        for line in text.splitlines():
            line = line.strip().removeprefix("$ ")
            for part in re.split(r"\s&&\s", line):
                if not part.startswith("python "):
                    continue  # output, a shell's own command
                words = shlex.split(part, comments=True)
                # CI runs these itself; the serving engines' own commands need GPUs (doctor --serve runs them there)
                tools = (["-m", "pip"], ["-m", "pytest"], ["-m", "ruff"], ["-m", "mypy"],
                         ["-m", "sglang.launch_server"], ["-m", "fastdeploy.entrypoints.openai.api_server"])
                if words[:1] == ["python"] and words[1:3] not in tools:
                    found.append(part.strip())
    return found


ALL = [(page.name, command) for page in PAGES for command in commands(page)]


def test_the_pages_hold_the_commands_a_reader_starts_with():
    said = [command for _, command in ALL]
    assert len(said) >= 40
    assert "python -m paddle.distributed.launch run_trainer.py --config configs/vl_moe.yaml" in said
    assert any(c.startswith("python -m ernie_moe.export") for c in said)


class _Parsed(Exception):
    def __init__(self, namespace):
        self.namespace = namespace


def _parse_only(monkeypatch) -> None:
    """Every argument parser stops the program once it has read its arguments (a bad one still exits 2)."""
    for method in ("parse_args", "parse_known_args"):
        original = getattr(argparse.ArgumentParser, method)

        def parsed(self, args=None, namespace=None, _original=original):
            raise _Parsed(_original(self, args, namespace))

        monkeypatch.setattr(argparse.ArgumentParser, method, parsed)


def stand_in(folder: str, tmp_path: Path) -> Path:
    """A model folder the docs name but this machine lacks: its config.json alone, of the architecture the name
    says (ERNIE-4.5-VL-28B-A3B, else the default config's model)."""
    config = "ernie45_vl_28b_a3b.yaml" if "28B" in folder else "vl_moe.yaml"
    model = yaml.safe_load((ROOT / "configs" / config).read_text())["model"]
    made = tmp_path / "stand_in" / Path(folder).name
    made.mkdir(parents=True, exist_ok=True)
    (made / "config.json").write_text(json.dumps({"model_type": "ernie4_5_moe_vl", **model}))
    return made


@pytest.mark.filterwarnings("ignore:.*found in sys.modules after import of package:RuntimeWarning")  # runpy's
@pytest.mark.parametrize("page, command", ALL, ids=[f"{page}:{command[:60]}" for page, command in ALL])
def test_a_documented_command_is_one_this_version_accepts(page, command, monkeypatch, capsys, tmp_path):
    words = shlex.split(command, comments=True)[1:]
    if words[:2] == ["-m", "ernie_moe.elastic"]:  # its checks of the launcher's counts and its own options
        from ernie_moe.elastic import launch

        assert launch._counts_problem(words[2:]) is None and launch._option(words[2:], "--job_id")
        assert launch._address(launch._option(words[2:], "--master"))[1] is not None
    if words[:2] in (["-m", LAUNCHER], ["-m", "ernie_moe.elastic"]):  # the launcher's options, then the script
        words = words[next(i for i, w in enumerate(words) if w.endswith(".py")):]
    for at, word in enumerate(words):
        key, _, folder = word.partition("=")
        if key == "training.model_name_or_path" and not (ROOT / folder).exists():
            words[at] = f"{key}={stand_in(folder, tmp_path)}"
    _parse_only(monkeypatch)
    monkeypatch.chdir(ROOT)
    if words[0] == "-m":
        target, argv = words[1], words[2:]
        monkeypatch.setattr(sys, "argv", [target, *argv])
        run = lambda: runpy.run_module(target, run_name="__main__", alter_sys=True)  # noqa: E731
    else:
        script, argv = ROOT / words[0], words[1:]
        assert script.is_file(), f"{page}: {words[0]} does not exist"
        monkeypatch.setattr(sys, "argv", [str(script), *argv])
        run = lambda: runpy.run_path(str(script), run_name="__main__")  # noqa: E731
    with pytest.raises(_Parsed) as parsed:
        try:
            run()
        except SystemExit as stop:
            pytest.fail(f"{page}: `{command}` is refused: {capsys.readouterr().err.strip()[-500:]} ({stop})")
    namespace = parsed.value.namespace
    namespace = namespace[0] if isinstance(namespace, tuple) else namespace
    if Path(words[0]).name == "run_trainer.py" or getattr(namespace, "config", None):
        config = ROOT / namespace.config
        assert config.is_file(), f"{page}: {namespace.config} does not exist"
        overrides = getattr(namespace, "overrides", None) or []
        load_config(config, overrides, check_paths=False)  # every key of the command, as the trainer reads it
