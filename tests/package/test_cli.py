"""The commands' numeric arguments: out of range is argparse's exit 2 with the range, before any work; and the
defaults that depend on the device."""

import argparse

import pytest
from support.runs import CONFIG

from ernie_moe import evaluate, export, generate, serve
from ernie_moe.cli import DRAFT_TOKENS, add_speculative_argument, at_least_one, bounded
from ernie_moe.memory import report


def test_bounded_takes_finite_numbers_in_range_only():
    fraction, above_zero = bounded(float, 0, 1), bounded(float, 0, low_included=False)
    assert (fraction("0"), fraction("1"), fraction("0.25"), above_zero("1e-3"), at_least_one("3")) == (0, 1, 0.25,
                                                                                                        1e-3, 3)
    for parse, text, message in ((fraction, "1.5", "must be from 0 to 1, not 1.5"),
                                 (fraction, "nan", "must be from 0 to 1, not nan"),
                                 (above_zero, "0", "must be above 0, not 0"),
                                 (above_zero, "inf", "must be above 0, not inf"),
                                 (bounded(float, 0, 1, low_included=False), "0", "above 0 and at most 1, not 0"),
                                 (at_least_one, "0", "must be at least 1, not 0"),
                                 (at_least_one, "2.5", "must be a whole number, not '2.5'"),
                                 (fraction, "half", "must be a number, not 'half'")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            parse(text)


@pytest.mark.parametrize("main, argv, message", [
    (report.main, ["--config", CONFIG, "--world-size", "0"], "--world-size: must be at least 1, not 0"),
    (report.main, ["--config", CONFIG, "--image-fraction", "7"], "--image-fraction: must be from 0 to 1, not 7"),
    (report.main, ["--config", CONFIG, "--device-memory-gb", "-5"],
     "--device-memory-gb: must be above 0 and at most 1e+06, not -5"),
    (generate.main, ["--model", "m", "--top-p", "0"], "--top-p: must be above 0 and at most 1, not 0"),
    (generate.main, ["--model", "m", "--temperature", "nan"], "--temperature: must be at least 0, not nan"),
    (generate.main, ["--model", "m", "--seed", "-1"], "--seed: must be at least 0, not -1"),
    (evaluate.main, ["--model", "m", "--data", "d", "--max-batches", "-1"], "--max-batches: must be at least 0"),
    (export.main, ["a", "b", "--max-shard-size-gb", "0"],
     "--max-shard-size-gb: must be above 0 and at most 1e+06, not 0"),
    # a billion drafts a step would chain the depth that many times before the first answer
    (generate.main, ["--model", "m", "--draft-tokens", "1000000000"],
     "--draft-tokens: must be from 0 to 16, not 1000000000"),
    (serve.main, ["--model", "m", "--draft-tokens", "17"], "--draft-tokens: must be from 0 to 16, not 17"),
    (evaluate.main, ["--model", "m", "--benchmark", "mcq:x.tsv", "--max-new-tokens", "0"],
     "--max-new-tokens: must be from 1 to 65,536, not 0"),
], ids=["world size", "image fraction", "device memory", "top-p", "temperature", "seed", "max batches", "shard size",
        "drafts", "server drafts", "benchmark answer length"])
def test_the_commands_refuse_numbers_out_of_range(capsys, main, argv, message):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("device, drafts", [("cpu", 0), ("gpu:0", DRAFT_TOKENS)])
def test_speculative_decoding_drafts_by_default_on_a_gpu_only(monkeypatch, device, drafts):
    """On a CPU checking drafts costs more than they save (``bench_generate.py --step-costs``): ``generate``,
    ``chat`` and ``serve`` draft only when told there; on a GPU by default."""
    import paddle

    monkeypatch.setattr(paddle.device, "get_device", lambda: device)
    parser = argparse.ArgumentParser()
    add_speculative_argument(parser)
    assert parser.parse_args([]).draft_tokens == drafts
    assert parser.parse_args(["--draft-tokens", "3"]).draft_tokens == 3


def test_evaluate_says_when_it_cannot_write_its_figures(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(evaluate, "scores", lambda *args: ({"eval_loss": 0.5}, {}))
    assert evaluate.main(["--model", "m", "--data", "synthetic", "--out", str(tmp_path)]) == 2  # a folder
    # said before any answering: the figures would have nowhere to go
    assert "is not a regular file (a folder, a FIFO or a device)" in capsys.readouterr().err
    assert evaluate.main(["--model", "m", "--data", "synthetic", "--out", str(tmp_path / "figures.json")]) == 0
    assert '"eval_loss": 0.5' in (tmp_path / "figures.json").read_text()


def test_export_refuses_a_folder_whose_config_does_not_fit_its_weights(tmp_path, capsys):
    """q/k/v are split by the config's heads: heads that do not add up to the stored columns would hand one
    projection's columns to another, so they are an error, as are heads that cannot work together."""
    import json

    import paddle

    from ernie_moe.checkpoint import save_model
    from ernie_moe.config import load_config
    from ernie_moe.data import build_tokenizer
    from ernie_moe.model.ernie_vl import ErnieMoEForConditionalGeneration

    cfg = load_config(CONFIG)
    paddle.seed(0)
    save_model(ErnieMoEForConditionalGeneration(cfg.model), cfg.model, str(tmp_path / "model"), build_tokenizer(cfg),
               hf_layout=True)
    written = json.loads((tmp_path / "model" / "config.json").read_text())
    assert export.main([str(tmp_path / "model"), str(tmp_path / "out")]) == 0
    heads, kv, head_dim = cfg.model.num_attention_heads, cfg.model.num_key_value_heads, cfg.model.head_dim
    assert kv < heads - 1  # grouped-query attention, so both changes below are changes
    for change, message in (({"num_key_value_heads": heads}, f"columns; the config's heads give q, k and v "
                                                              f"{heads * head_dim} + {heads * head_dim}"),
                            ({"num_key_value_heads": heads - 1}, f"num_attention_heads ({heads}) must be a multiple")):
        (tmp_path / "model" / "config.json").write_text(json.dumps({**written, **change}))
        capsys.readouterr()
        assert export.main([str(tmp_path / "model"), str(tmp_path / "again")]) == 2
        assert message in capsys.readouterr().err
