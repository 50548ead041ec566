"""A new user's paths, each in one launch from the command its page writes: the commands are read from README.md
and docs/ (``documented``) and run as they stand in a folder laid out as the repository, with the overrides a
test needs to be short appended to the training commands (``SHORT``, the one place they are written). Each
journey starts from what the earlier ones left, as a user's would: the default run's model is the base of the
LoRA, DPO and GRPO runs, of the exports, the chat and the server."""

import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
import urllib.request

import pytest
from PIL import Image
from support.runs import ROOT, start

pytestmark = pytest.mark.slow  # starts processes

# appended to every training command: two steps of small batches, no evaluation, no progress bar
SHORT = ["training.max_steps=2", "training.eval_steps=0", "data.num_eval_samples=16",
         "training.per_device_train_batch_size=8", "logging.progress_bar=false", "training.save_steps=0"]


def documented(page: str, starts: str) -> list[str]:
    """The command of ``page``'s code blocks that begins with ``starts`` (continuation lines joined), split at
    ``&&``; the test fails when the page no longer has it."""
    text = (ROOT / page).read_text()
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = " ".join(line.split())
            if line.startswith(starts):
                return [shlex.split(part, comments=True) for part in re.split(r"\s&&\s", line)]
    raise AssertionError(f"{page} has no command starting {starts!r}")


def run(words: list[str], cwd, *extra: str, stdin: str | None = None) -> str:
    """One documented command, as written (``python`` being this interpreter), with ``extra`` arguments: what it
    printed; the test fails with its last lines when it does not exit 0."""
    assert words[0] == "python"
    done = subprocess.run([sys.executable, *words[1:], *extra], cwd=cwd, capture_output=True, text=True,
                          input=stdin, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)))
    worker = cwd / "log" / "workerlog.0"  # where the launcher keeps its worker's words
    said = worker.read_text()[-3000:] if "paddle.distributed.launch" in words and worker.is_file() else ""
    assert done.returncode == 0, f"{shlex.join(words)}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}\n{said}"
    return done.stdout


def train(page: str, starts: str, cwd) -> str:
    (words,) = documented(page, starts)
    return run(words, cwd, *SHORT)


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """A folder laid out as the repository, where the README's first command has trained the default model."""
    folder = tmp_path_factory.mktemp("journeys")
    for name in ("configs", "run_trainer.py"):
        (folder / name).symlink_to(ROOT / name)
    # the README's first command installs (CI's own step here), then trains
    (words,) = [part for part in documented("README.md", "python -m pip install -e \".[cpu]\"")
                if "run_trainer.py" in part]
    run(words, folder, *SHORT)
    assert (folder / "output" / "vl_moe" / "final_model" / "config.json").is_file()
    return folder


def test_the_default_model_captions_a_held_out_image_and_chats(home):
    held_out, generate = documented("README.md", "python -m ernie_moe.data.held_out")
    run(held_out, home)
    caption = run(generate, home).strip()
    assert caption and "Traceback" not in caption
    (chat,) = documented("docs/serving.md", "python -m ernie_moe.chat")
    said = run(chat, home, stdin="describe\n/quit\n")
    assert "chatting with output/vl_moe/final_model" in said


def test_erniekit_records_train_the_default_model(home):
    Image.new("RGB", (64, 48), (200, 30, 30)).save(home / "cat.jpg")
    records = [{"image_info": [{"image_url": "cat.jpg", "matched_text_index": 0}],
                "text_info": [{"text": "What is this?", "tag": "mask"}, {"text": "A red box.", "tag": "no_mask"}]},
               {"system": "You are brief.", "src": ["Hi", "And a cat?"], "tgt": ["Hello.", "It purrs."],
                "label": [0, 1]}]
    (home / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) * 8)
    said = train("README.md", "python -m paddle.distributed.launch run_trainer.py --config configs/vl_moe.yaml "
                 "data.dataset=jsonl", home)
    assert "skipped: none" in said


def test_ones_own_captions_and_a_folder_of_tar_shards_train_the_default_model(home):
    data = home / "data"
    (data / "laion").mkdir(parents=True)
    Image.new("RGB", (96, 64), (30, 30, 200)).save(data / "blue.png")
    (data / "train.jsonl").write_text(json.dumps({"image": "blue.png", "text": "a blue box"}) + "\n")
    with tarfile.open(data / "laion" / "00000.tar", "w") as shard:
        for key in range(4):
            shard.add(data / "blue.png", f"{key:04d}.png")
            caption = data / "caption.txt"
            caption.write_text(f"a blue box, number {key}")
            shard.add(caption, f"{key:04d}.txt")
    for folder in ("mine", "laion"):
        said = train("docs/data.md", "python -m paddle.distributed.launch run_trainer.py --config configs/vl_moe.yaml "
                     f"data.dataset=jsonl data.train_path=data/{'train.jsonl' if folder == 'mine' else 'laion'} "
                     "data.max_seq_len=256", home)
        assert (home / "output" / folder / "final_model" / "config.json").is_file(), said


def test_lora_dpo_and_grpo_start_from_the_default_model_and_export(home):
    train("docs/fine-tuning.md", "python -m paddle.distributed.launch run_trainer.py --config configs/vl_moe.yaml "
          "training.fine_tuning=lora", home)
    assert (home / "output" / "lora" / "final_model" / "lora_config.json").is_file()
    for stage in ("dpo", "grpo"):
        train("docs/fine-tuning.md", "python -m paddle.distributed.launch run_trainer.py --config "
              f"configs/vl_moe.yaml training.stage={stage}", home)
        assert (home / "output" / f"vl_moe_{stage}" / "final_model" / "config.json").is_file()
    # the export commands name the fine-tuning config's output folder: here, the default run's
    (home / "output" / "finetune").symlink_to(home / "output" / "vl_moe")
    for starts in ("python -m ernie_moe.export output/finetune/final_model", "python -m ernie_moe.export "
                   "output/lora/final_model merged-hf/", "python -m ernie_moe.export output/lora/final_model "
                   "adapter-hf/"):
        (words,) = documented("docs/generation.md", starts)
        run(words, home)
    # and the checkpoint of its step 1000: here, the default run's last
    (home / "output" / "vl_moe" / "checkpoint-1000").symlink_to(home / "output" / "vl_moe" / "checkpoint-2")
    (words,) = documented("docs/checkpoints.md", "python -m ernie_moe.export output/finetune/checkpoint-1000")
    run(words, home)
    assert json.loads((home / "exported" / "config.json").read_text())["model_type"] == "ernie4_5_moe_vl"
    assert json.loads((home / "exported-hf" / "config.json").read_text())["model_type"] == "ernie4_5_vl_moe"
    assert (home / "merged-hf" / "config.json").is_file() and (home / "adapter-hf" / "adapter_config.json").is_file()


def test_the_server_answers_the_openai_api_and_stops_on_sigterm(home):
    (words,) = documented("docs/serving.md", "python -m ernie_moe.serve")
    port = words.index("--port") + 1
    words[port] = "0"  # any free port: the machine's 8000 may be taken
    later: list[str] = []
    process, found = start([sys.executable, *words[1:]], home, r"on (http://\S+) ", later)
    try:
        request = urllib.request.Request(f"{found[1]}/v1/chat/completions", method="POST", data=json.dumps({
            "model": "final_model", "max_tokens": 8, "messages": [{"role": "user", "content": "describe"}]}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            answer = json.loads(response.read())
        assert answer["choices"][0]["message"]["role"] == "assistant"
    finally:
        process.terminate()
    assert process.wait(timeout=120) == 0
