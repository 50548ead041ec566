"""Inputs that once ended in a traceback, a hang, a silent result or lost files, each now a clear line, a counted
skip or the right result: model folders read by generate, evaluate, export and the chat; paths that are not
files; configs whose sizes or text cannot work; the held-out sample writer."""

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from support.runs import CONFIG

from ernie_moe.config import ConfigError, load_config
from ernie_moe.data import build_tokenizer


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A small VL model folder as training writes it (one shard, the Hugging Face layout)."""
    from ernie_moe.checkpoint import save_model
    from ernie_moe.model.ernie_vl import ErnieMoEForConditionalGeneration

    cfg = load_config(CONFIG, ["data.image_size=56"])
    out = tmp_path_factory.mktemp("bad_input") / "model"
    save_model(ErnieMoEForConditionalGeneration(cfg.model), cfg.model, str(out), build_tokenizer(cfg), hf_layout=True)
    return out


def copy_of(folder, tmp_path):
    import shutil

    return shutil.copytree(folder, tmp_path / "copy")


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def shard_of(model):
    return next(model.glob("model-*.safetensors"))


def test_a_vl_folder_without_its_vision_tensors_is_named_incomplete(folder, tmp_path, capsys):
    from ernie_moe.generate import main as generate

    model = copy_of(folder, tmp_path)
    index = json.loads((model / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if "vision_model" not in k
                           and "resampler_model" not in k}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    assert generate(["--model", str(model), "--prompt", "a"]) == 2
    err = one_line(capsys)
    assert "holds no weights for" in err and "not a complete model" in err, err


def test_a_config_json_whose_vocabulary_disagrees_with_its_embedding_is_refused_before_building(folder, tmp_path,
                                                                                                capsys):
    """A vocabulary of 10**10 would allocate (or overflow int32 lookups) before any weight was read; the stored
    embedding's shape, read from the file header, says the folder is inconsistent first."""
    from ernie_moe.export import main as export
    from ernie_moe.generate import main as generate

    model = copy_of(folder, tmp_path)
    config = json.loads((model / "config.json").read_text())
    for vocab, words in ((10 ** 10, "model.vocab_size (10000000000) is above 2,147,483,647"),
                         (10 ** 8, "config.json describes an embedding of [100000000, 64]")):
        (model / "config.json").write_text(json.dumps({**config, "vocab_size": vocab}))
        assert generate(["--model", str(model), "--prompt", "a"]) == 2
        assert words in one_line(capsys)
        assert export([str(model), str(tmp_path / "exported")]) == 2
        assert words in one_line(capsys)
        assert not (tmp_path / "exported").exists()


def test_nan_weights_are_refused_by_generate_evaluate_and_training_naming_the_tensor(folder, tmp_path, capsys):
    import run_trainer
    from ernie_moe.evaluate import main as evaluate
    from ernie_moe.generate import main as generate

    model = copy_of(folder, tmp_path)
    tensors = load_file(str(shard_of(model)))
    tensors["model.norm.weight"][:] = np.nan
    save_file(tensors, str(shard_of(model)), metadata={"format": "pt"})
    assert generate(["--model", str(model), "--prompt", "a"]) == 2
    assert "model.norm.weight holds nan or inf values" in one_line(capsys)
    assert evaluate(["--model", str(model), "--data", "synthetic"]) == 2
    assert "model.norm.weight holds nan or inf values" in capsys.readouterr().err
    assert run_trainer.main(["--config", CONFIG, "training.max_steps=1", f"training.model_name_or_path={model}",
                             f"training.output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()  # not a stop at the first step advising rope_theta and the learning rate
    assert err.startswith("checkpoint error: ") and "model.norm.weight holds nan or inf values" in err, err


@pytest.fixture
def not_files(tmp_path):
    """A FIFO, a device whose read never ends and a folder, each where a file belongs."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "folder").mkdir()
    return [str(fifo), "/dev/zero", str(tmp_path / "folder")]


def test_paths_that_are_not_files_are_named_so(folder, not_files, capsys):
    """data.train_path, --image, --data and --messages given a FIFO, /dev/zero or a folder: 'is not a regular
    file', not 'does not exist', and nothing blocks on the FIFO."""
    from ernie_moe.data import DataError, build_datasets
    from ernie_moe.evaluate import main as evaluate
    from ernie_moe.generate import main as generate

    for path in not_files:
        if path.endswith("folder"):  # a folder of shards, here of none
            with pytest.raises(DataError, match=f"data folder '{path}' holds no shard"):
                build_datasets(load_config(CONFIG, ["data.dataset=jsonl", f"data.train_path={path}"]))
        else:
            with pytest.raises(ConfigError, match=f"data.train_path '{path}' is not a regular file"):
                load_config(CONFIG, ["data.dataset=jsonl", f"data.train_path={path}"])
        assert generate(["--model", str(folder), "--image", path]) == 2
        assert f"image '{path}' is not a regular file" in one_line(capsys)
        assert generate(["--model", str(folder), "--messages", path]) == 2
        assert f"--messages file '{path}' is not a regular file" in one_line(capsys)
        assert evaluate(["--model", str(folder), "--data", path]) == 2
        said = capsys.readouterr().err
        # --data takes what train_path takes: a folder of shards (here none)
        assert (f"data folder '{path}' holds no shard" if path.endswith("folder") else
                f"--data file '{path}' is not a regular file") in said, said


def test_an_image_url_is_named_as_it_was_written(folder, tmp_path, capsys):
    from ernie_moe.data.formats.jsonl import JsonlDataset
    from ernie_moe.data.formats.sample import BadSample
    from ernie_moe.generate import main as generate

    url = "http://example.com/cat.jpg"
    assert generate(["--model", str(folder), "--image", url]) == 2
    assert f"image '{url}' is a URL" in one_line(capsys)
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"image": url, "text": "a cat"}) + "\n" +
                    json.dumps({"videos": [["https://example.com/f.png", "frame.png"]],
                                "messages": [{"role": "user", "content": "<video>what?"},
                                             {"role": "assistant", "content": "frames"}]}) + "\n")
    dataset = JsonlDataset(str(data), 1 << 20)
    for index, words in ((0, f"image '{url}' is a URL"), (1, "frame 'https://example.com/f.png' is a URL")):
        with pytest.raises(BadSample, match=words) as caught:
            dataset[index]
        assert caught.value.reason == "missing_image"


@pytest.mark.parametrize("override, words", [
    ("training.output_dir=out\x00put", "training.output_dir = 'out\\x00put' holds a NUL byte"),
    ("model=5", "'model' is a section, not a key: write model.<key>=5"),
    ("max_steps=5", "write training.max_steps=5"),
    ("model.vocab_size=10000000000", "model.vocab_size (10000000000) is above 2,147,483,647"),
    ("data.max_seq_len=1000000000000", "data.max_seq_len (1000000000000) is above 4,194,304"),
    ("training.device_memory_gb=1e308", "training.device_memory_gb (1e+308) must be at most 1e6"),
])
def test_config_values_that_cannot_work_are_one_line_errors(override, words):
    """A NUL byte reached the output lock as a ValueError; a bare section was told to become training.model; a
    row of 10**12 tokens (positions as many) packed the whole data stream into memory before any line."""
    extra = ["model.max_position_embeddings=1000000000000"] if "max_seq_len" in override else []
    with pytest.raises(ConfigError) as caught:
        load_config(CONFIG, [*extra, override])
    assert words in str(caught.value)


def test_the_held_out_writer_refuses_a_file_for_a_folder_and_an_endless_count(tmp_path, capsys):
    from ernie_moe.data.held_out import main as held_out

    existing = tmp_path / "file"
    existing.write_text("x")
    assert held_out(["--out", str(existing), "--count", "2"]) == 2
    assert f"--out '{existing}' exists and is not a folder" in one_line(capsys)
    assert held_out(["--out", str(existing / "below"), "--count", "2"]) == 2
    assert "cannot write the held-out samples" in one_line(capsys)
    with pytest.raises(SystemExit) as caught:
        held_out(["--out", str(tmp_path / "many"), "--count", "10000000000"])
    assert caught.value.code == 2
    assert "must be from 1 to 1,000,000" in capsys.readouterr().err
    assert held_out(["--out", str(tmp_path / "two"), "--count", "2"]) == 0
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["00000.png", "00001.png", "captions.jsonl"]


def test_the_chat_names_paths_that_are_not_files_instead_of_blocking(not_files, tmp_path, capsys):
    """``/image`` of a FIFO, ``/dev/zero`` or a folder is not attached, and ``/save`` into a FIFO is refused: the
    write would wait for a reader forever."""
    from types import SimpleNamespace

    from ernie_moe.chat import Transcript, _attach, _save
    from ernie_moe.config.schema import DataConfig

    talk, chat = Transcript(), SimpleNamespace(data=DataConfig())
    for path in not_files:
        _attach(chat, talk, path, video=False)
        assert f"not attached: image '{path}' is not a regular file" in capsys.readouterr().out
    talk.messages.append({"role": "user", "content": [{"type": "text", "text": "hi"}]})
    _save(talk, not_files[0])
    assert f"not saved: '{not_files[0]}' is not a regular file" in capsys.readouterr().out


# -- this round's features: benchmark rows, results files, size options, the server's client faults ----------------

def test_a_benchmark_row_whose_index_is_not_finite_or_that_has_no_answer_is_a_counted_skip(tmp_path):
    from ernie_moe.evaluation.formats import read_benchmark

    rows = ["index\tquestion\tA\tB\tanswer", "inf\tWhich?\tred\tgreen\tA", "1e400\tWhich?\tred\tgreen\tA",
            "2\tWhich?\tred\tgreen\tB", "3\tWhich?\tred\tgreen\t"]
    (tmp_path / "b.tsv").write_text("\n".join(rows) + "\n")
    for kind in ("mcq", "mmbench"):
        bench = read_benchmark(tmp_path / "b.tsv", kind)
        assert {item.group for item in bench.items} == {"2"}  # row 2 (MMBench's also rotated)
        assert dict(bench.skipped) == {"bad_index": 2, "no_answer": 1}
    (tmp_path / "no_answers.tsv").write_text("index\tquestion\tA\tB\n0\tWhich?\tred\tgreen\n1\tAnd?\tred\tblue\n")
    with pytest.raises(Exception, match="no_answer"):  # the VQA kinds' word for it, not answer_not_an_option
        read_benchmark(tmp_path / "no_answers.tsv", "mcq")


def results_file(path, items) -> str:
    path.write_text(json.dumps({"benchmarks": {"b": {"kind": "mcq", "items": items}}}))
    return str(path)


@pytest.mark.parametrize("item, words", [
    ({"unit": "0", "score": float("nan")}, "score nan"),
    ({"unit": "0", "score": None}, "score None"),
    ({"unit": "0", "score": "1"}, "score '1'"),
    ("an answer", "str where an object was expected"),
    ({"score": 1.0}, "unit None"),
    ({"unit": ["0"], "score": 1.0}, "unit ['0']"),
    ({"unit": "0", "score": 1.0, "category": 3}, "category 3"),
])
def test_compare_names_what_a_foreign_or_hand_edited_results_file_gets_wrong(tmp_path, capsys, item, words):
    from ernie_moe import compare

    good = results_file(tmp_path / "good.json", [{"unit": "0", "score": 1.0, "category": "c"}])
    bad = results_file(tmp_path / "bad.json", [item])
    assert compare.main(["--before", bad, "--after", good, "--out", str(tmp_path / "report")]) == 2
    err = one_line(capsys)
    assert "item 1: " + words in err and "bad.json" in err


def test_compare_names_a_missing_side_and_fails_the_gate_on_a_one_sided_benchmark(tmp_path, capsys):
    from ernie_moe import compare

    item = [{"unit": str(i), "score": 1.0, "category": ""} for i in range(12)]
    before = tmp_path / "before.json"
    before.write_text(json.dumps({"benchmarks": {"kept": {"items": item}, "gone": {"items": item}}}))
    (tmp_path / "after.json").write_text(json.dumps({"benchmarks": {"kept": {"items": item}, "new": {"items": item}}}))
    after = str(tmp_path / "after.json")
    absent = str(tmp_path / "absent.json")
    assert compare.main(["--before", absent, "--after", after, "--out", str(tmp_path / "r")]) == 2
    assert "absent.json' does not exist" in one_line(capsys)
    argv = ["--before", str(before), "--after", after, "--out", str(tmp_path / "r")]
    assert compare.main(argv) == 0
    assert "benchmarks on one side only, not compared: gone (before only), new (after only)" in capsys.readouterr().out
    assert json.loads((tmp_path / "r" / "report.json").read_text())["one_sided"] == {
        "before only": ["gone"], "after only": ["new"]}
    assert compare.main([*argv, "--fail-on-regression"]) == 1


@pytest.mark.parametrize("command, option", [("export", "--max-shard-size-gb"), ("serve", "--max-request-mb"),
                                             ("memory", "--device-memory-gb")])
def test_a_size_option_too_large_to_multiply_is_refused(folder, tmp_path, capsys, command, option):
    import importlib

    module = importlib.import_module(f"ernie_moe.{command}" if command != "memory" else "ernie_moe.memory.report")
    argv = {"export": [str(folder), str(tmp_path / "out")], "serve": ["--model", str(folder)],
            "memory": ["--config", str(CONFIG)]}[command]
    with pytest.raises(SystemExit) as stop:
        module.main([*argv, option, "1e308"])
    assert stop.value.code == 2 and "at most" in capsys.readouterr().err


def test_export_refuses_nan_weights_naming_the_tensor(folder, tmp_path, capsys):
    from ernie_moe.export import main as export_main

    copy = copy_of(folder, tmp_path)
    tensors = load_file(shard_of(copy))
    name = next(n for n in tensors if n.endswith("o_proj.weight"))
    tensors[name][0, 0] = np.nan
    save_file(tensors, str(shard_of(copy)))
    assert export_main([str(copy), str(tmp_path / "exported")]) == 2
    err = one_line(capsys)
    assert "holds nan or inf values" in err and ".o_proj." in err


def test_serve_names_a_file_given_for_the_model_folder(folder, capsys):
    from ernie_moe import serve

    assert serve.main(["--model", str(folder / "config.json")]) == 2
    assert "is a file, not a model folder" in capsys.readouterr().err


def test_a_chat_request_that_is_malformed_gets_a_400_naming_the_fault():
    from ernie_moe.serving.openai_api import ApiError, Limits, parse_request
    from ernie_moe.serving.server import MAX_NESTING, nesting

    def refused(body) -> str:
        with pytest.raises(ApiError) as err:
            parse_request(body, "tiny", Limits(), None, 1 << 20)
        assert err.value.status == 400
        return err.value.body()["error"]["message"]

    assert "model must be a string" in refused({"model": ["tiny"], "messages": [{"role": "user", "content": "hi"}]})
    assert "model is required" in refused({"messages": [{"role": "user", "content": "hi"}]})
    text_null = [{"role": "user", "content": [{"type": "text", "text": None}]}]
    assert "holds no text" in refused({"model": "tiny", "messages": text_null})
    nul = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a\x00.png"}}]}]
    assert "NUL byte" in refused({"model": "tiny", "messages": nul})
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    assert nesting(deep) > MAX_NESTING and nesting({"messages": [{"content": [{"a": 1}]}]}) == 5


def test_a_client_that_hangs_up_leaves_one_quiet_line(capsys):
    from types import SimpleNamespace

    from ernie_moe.serving.server import ChatServer

    try:
        raise BrokenPipeError(32, "Broken pipe")
    except BrokenPipeError:
        ChatServer.handle_error(SimpleNamespace(log_requests=True), None, ("127.0.0.1", 5000))
    err = capsys.readouterr().err
    assert err == "127.0.0.1 hung up before its answer was written\n"


def test_a_training_benchmark_of_which_nothing_could_be_asked_says_so(tmp_path, capsys):
    from support.lora import trainer

    from ernie_moe.evaluation.during_training import benchmark_metrics
    from ernie_moe.evaluation.results import read_benchmarks

    question = " ".join(["what"] * 5000)  # past the model's positions
    (tmp_path / "long.tsv").write_text(f"index\tquestion\tA\tB\tanswer\n0\t{question}\tred\tgreen\tA\n")
    tr = trainer(tmp_path / "run")
    figures = benchmark_metrics(read_benchmarks([f"mcq:{tmp_path / 'long.tsv'}"]), tr.parts.model, tr.tokenizer,
                                tr.cfg.data, tr.env)
    assert figures == {"eval_bench/long/skipped_too_long": 1}
    assert "warning: benchmark long" in capsys.readouterr().out


def test_save_best_metric_naming_a_benchmark_that_asked_nothing_is_no_typo():
    from ernie_moe.training.best_model import BestModel

    best = BestModel.__new__(BestModel)
    best.metric = "eval_bench/long"
    with pytest.raises(ConfigError, match="had no question it could ask at this evaluation"):
        best.update(10, {"eval_loss": 1.0, "eval_bench/long/skipped_too_long": 1})


def test_a_tokenizer_that_reads_the_text_as_unknown_tokens_is_said(tmp_path, base, capsys):
    """The default model's 24-word vocabulary turns other text into <unk>: a run on such data says so at start (and
    in data_report.json), and evaluate says so of a benchmark's questions."""
    from support.lora import trainer

    from ernie_moe import evaluate

    records = [{"messages": [{"role": "user", "content": "Please describe the photograph carefully"},
                             {"role": "assistant", "content": "a red square at the top left"}]}] * 4
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    # a fine-tune of the default model, whose folder's tokenizer the run takes
    trainer(tmp_path / "run", f"training.model_name_or_path={base}", "data.dataset=jsonl",
            f"data.train_path={tmp_path / 'chat.jsonl'}", f"data.eval_path={tmp_path / 'chat.jsonl'}")
    out = capsys.readouterr().out
    assert "WARNING" in out and "of the text tokens of the training data are the tokenizer's unknown token" in out
    assert json.loads((tmp_path / "run" / "data_report.json").read_text())["unknown_token_share"] > 0.05
    (tmp_path / "bench.tsv").write_text("index\tquestion\tA\tB\tanswer\n0\tWhich colour is shown?\tred\tgreen\tA\n")
    assert evaluate.main(["--model", str(base), "--benchmark", f"mcq:{tmp_path / 'bench.tsv'}", "--no-progress"]) == 0
    assert "of the text tokens of benchmark bench's questions are the tokenizer's unknown token" in \
        capsys.readouterr().err


def test_a_model_built_here_takes_its_tokenizers_placeholder_as_it_takes_its_vocabulary(tmp_path, capsys):
    """With an ERNIE SentencePiece tokenizer and nothing else said, the run starts (it stopped asking for
    model.im_patch_id by hand)."""
    from support.ernie import make_ernie_tokenizer
    from support.lora import trainer

    from ernie_moe.data.encoding.tokenizer import SentencePieceTokenizer

    folder = make_ernie_tokenizer(tmp_path / "tokenizer")
    own = SentencePieceTokenizer(str(folder), 0).placeholder_id()
    assert own != 4  # the default model.im_patch_id
    tr = trainer(tmp_path / "run", f"data.tokenizer_path={folder}")
    assert (tr.cfg.model.im_patch_id, tr.cfg.model.vocab_size) == (own, 400)
    assert f"the tokenizer's image placeholder has id {own}" in capsys.readouterr().out
