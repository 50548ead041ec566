"""Runs that cannot train as asked: streaks of non-finite steps, bad config values and files, garbage tokenizer
and model files, bad records; each ends in a clear line and a known exit code, or a counted skip."""

import json
import struct
import zlib
from collections import Counter

import numpy as np
import pytest
from PIL import Image
from support.runs import CONFIG, QUIET, quiet_trainer, train

import run_trainer
from ernie_moe.checkpoint.lineage import scan
from ernie_moe.config import load_config
from ernie_moe.data import RowStream, build_tokenizer
from ernie_moe.data.formats.jsonl import JsonlDataset

# ------------------------------------------------------------------------------------------ non-finite steps

@pytest.mark.parametrize("async_save", [False, True])
def test_a_streak_of_skipped_steps_saves_nothing_and_names_the_checkpoint_before_it(tmp_path, async_save):
    """Also with saves written in the background: the one being written when the run stops is completed first."""
    from support.runs import poison_gradients

    from ernie_moe.training.precision import NonFiniteGradients

    tr = quiet_trainer(tmp_path, "training.max_steps=8", "training.save_steps=1", "training.save_total_limit=1",
                 "training.max_skipped_steps=3", f"training.async_save={async_save}")
    poison_gradients(tr, {3, 4, 5})
    with pytest.raises(NonFiniteGradients) as err:
        tr.train()
    assert f"saved before these steps, is {tmp_path / 'checkpoint-2'}" in str(err.value)
    assert [c.step for c in scan(tmp_path)] == [2]

    resumed = quiet_trainer(tmp_path, "training.max_steps=8", "training.resume_from_checkpoint=auto")
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
