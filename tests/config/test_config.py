import json
import subprocess
import sys

import paddle
import pytest
from support.runs import ROOT

from ernie_moe.config import ConfigError, load_config


def test_default_config_loads_with_typed_sections():
    cfg = load_config(ROOT / "configs" / "vl_moe.yaml")
    assert cfg.model.moe_num_experts == [4, 4]
    assert isinstance(cfg.training.learning_rate, float)
    assert cfg.model.vision_config.patch_size == 14


def test_an_objectives_settings_are_a_section_read_flat_too(tmp_path):
    """``training.dpo.*`` and ``training.rl.*``, and the flat ``training.dpo_*`` / ``training.rl_*`` keys configs
    were written with, in a file or on the command line: the command line's wins over the file's either way; one
    key given both ways in one file is refused, naming both."""
    path = tmp_path / "flat.yaml"
    path.write_text("training:\n  stage: dpo\n  dpo_beta: 0.2\n  rl:\n    group_size: 6\n  rl_top_p: 0.9\n")
    cfg = load_config(path, ["training.dpo_loss=ipo", "training.rl.temperature=0.7"]).training
    assert (cfg.dpo.beta, cfg.dpo.loss, cfg.rl.group_size, cfg.rl.top_p, cfg.rl.temperature) == \
        (0.2, "ipo", 6, 0.9, 0.7)
    assert load_config(path, ["training.dpo.beta=0.3"]).training.dpo.beta == 0.3
    assert load_config(path, ["training.rl_group_size=8"]).training.rl.group_size == 8
    path.write_text("training:\n  dpo_beta: 0.2\n  dpo:\n    beta: 0.3\n")
    with pytest.raises(ConfigError, match=r"training\.dpo_beta and training\.dpo\.beta"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"unknown key 'training\.rl\.group_sise'.*group_size"):
        load_config(None, ["training.rl_group_sise=4"])


def test_overrides_follow_yaml_types():
    cfg = load_config(ROOT / "configs" / "vl_moe.yaml", [
        "training.max_steps=20", "model.hidden_size=32", "training.learning_rate=1e-3",
        "model.moe_capacity=[1.5, 2, 2]", "model.vision_config.depth=1", "logging.visualdl=false",
    ])
    assert cfg.training.max_steps == 20 and cfg.model.hidden_size == 32
    assert cfg.training.learning_rate == pytest.approx(1e-3)
    assert cfg.model.moe_capacity == [1.5, 2.0, 2.0]
    assert cfg.model.vision_config.depth == 1 and cfg.logging.visualdl is False
    # ``key=`` empties a string key, as ``key=''`` does
    emptied = load_config(ROOT / "configs" / "vl_moe.yaml", ["parallel.sharding=stage1", "parallel.sharding=",
                                                             "training.resume_from_checkpoint= "])
    assert emptied.parallel.sharding == "" and emptied.training.resume_from_checkpoint == ""
    with pytest.raises(ConfigError, match="max_steps"):  # a number is never empty
        load_config(ROOT / "configs" / "vl_moe.yaml", ["training.max_steps="])


@pytest.mark.parametrize("override, words", [
    ("model.hiden_size=3", ["unknown key 'model.hiden_size'", "hidden_size"]),
    ("trainig.max_steps=3", ["unknown key 'trainig'", "training"]),
    # numbers that would reach the arithmetic and end the run at its first step, with advice about something else
    ("training.reward_weights=[.nan]", ["training.reward_weights = [nan] is not a finite number"]),
    ("model.multi_token_pred_lambda=.inf", ["model.multi_token_pred_lambda = inf is not a finite number"]),
    ("data.index_dir=/dev/null", ["data.index_dir '/dev/null' is not a folder"]),
    # a key of another section, not a look-alike of this one's (training.eval_steps)
    ("training.logging_steps=5", ["unknown key 'training.logging_steps'", "another section: logging.logging_steps."]),
    ("training.max_steps=abc", ["training.max_steps", "integer"]),
    ("training.learning_rate=true", ["training.learning_rate", "number"]),
    ("model.moe_num_experts=4", ["model.moe_num_experts", "list of int"]),
    ("training.lr_scheduler_type=cosin", ["lr_scheduler_type", "'cosine'"]),
    ("model.num_key_value_heads=3", ["num_attention_heads (4)", "num_key_value_heads (3)"]),
    ("model.moe_k=5", ["moe_k (5)", "expert count"]),
    ("model.moe_layer_start_index=7", ["outside the model's 2 layers"]),
    ("model.moe_layer_end_index=[1, 9]", ["outside the model's 2 layers"]),
    ("model.moe_layer_end_index=[]", ["model.moe_layer_end_index []", "one value per modality (2)"]),
    ("model.moe_layer_start_index=[1, 1, 1]", ["model.moe_layer_start_index [1, 1, 1]", "one value per modality"]),
    ("model.moe_intermediate_size=[8]", ["one width per entry"]),
    ("model.pixel_hidden_size=48", ["pixel_hidden_size (48)", "embed_dim (32)"]),
    ("data.image_size=50", ["data.image_size (50)", "multiple of"]),
    ("training.min_lr=1.0", ["min_lr"]),
    ("parallel.tensor_parallel_degree=3", ["num_attention_heads (4)", "divisible by parallel.tensor_parallel_degree"]),
    ("parallel.expert_parallel_degree=3", ["moe_num_experts [4, 4]", "divisible by parallel.expert_parallel_degree"]),
    ("parallel.sequence_parallel=true", ["sequence_parallel", "tensor_parallel_degree > 1"]),
    ("parallel.pipeline_parallel_degree=3", ["num_hidden_layers (2)", "pipeline_parallel_degree x virtual_pp_degree"]),
    ("parallel.virtual_pp_degree=2", ["virtual_pp_degree (2)", "pipeline_parallel_degree > 1"]),
    ("parallel.pipeline_parallel_degree=2", ["training.gradient_accumulation_steps (1)", "at least 2"]),
    ("parallel.sharding_parallel_degree=2", ["sharding_parallel_degree (2)", "go together"]),
    ("parallel.sharding=stage1", ["sharding ('stage1')", "go together"]),
    ("training.max_steps", ["section.key=value"]),
    ("data.video_timestamp_font=README.md", ["data.video_timestamp_font", "not a TrueType font file"]),
])
def test_bad_values_name_the_key(override, words):
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs" / "vl_moe.yaml", [override])
    for word in words:
        assert word in str(err.value)


FOLDER_CONFIG = {"model_type": "ernie4_5_moe_vl", "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "moe_num_experts": [4, 4], "moe_intermediate_size": [32, 16]}


def test_a_model_folder_config_gives_the_expert_groups(tmp_path):
    for widths, expected in (([32, 16], [32, 16]), (32, [32, 32])):  # one width: the same for both groups
        (tmp_path / "config.json").write_text(json.dumps({**FOLDER_CONFIG, "moe_intermediate_size": widths}))
        model = load_config(None, [f"training.model_name_or_path={tmp_path}"]).model
        assert (model.moe_num_experts, model.moe_intermediate_size, model.head_dim) == ([4, 4], expected, 16)


def test_a_model_folder_sets_its_own_architecture_over_the_config_file(tmp_path):
    """The default config's model section describes the default model: started from a folder of another shape,
    the folder's architecture wins, the run's choices (capacity, loss weights) still come from the file and the
    command line, and a command-line key that contradicts the folder is one problem naming both values."""
    (tmp_path / "config.json").write_text(json.dumps({**FOLDER_CONFIG, "im_patch_id": 7, "moe_capacity": [4, 4, 4],
                                                       "vision_config": {"depth": 3, "embed_dim": 32}}))
    start = [f"training.model_name_or_path={tmp_path}"]
    model = load_config(ROOT / "configs" / "vl_moe.yaml", start).model
    assert (model.vocab_size, model.im_patch_id, model.moe_intermediate_size) == (300, 7, [32, 16])
    assert model.vision_config.depth == 3 and model.vision_config.patch_size == 14  # the folder's, then the file's
    assert model.moe_capacity == []  # the file's choice over the folder's
    chosen = load_config(ROOT / "configs" / "vl_moe.yaml", [*start, "model.vocab_size=300", "model.moe_k=2",
                                                            "model.moe_capacity=[2, 2, 2]"]).model
    assert chosen.vocab_size == 300 and chosen.moe_capacity == [2.0, 2.0, 2.0]
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs" / "vl_moe.yaml", [*start, "model.vocab_size=32", "model.vision_config.depth=2",
                                                       "training.max_steps=0"])
    message = str(err.value)
    assert message.startswith("3 problems:")
    assert "model.vocab_size=32 on the command line contradicts" in message and "vocab_size = 300" in message
    assert "vision_config.depth = 3" in message and "training.max_steps must be at least 1" in message


def test_one_launch_names_every_problem_of_a_config():
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs" / "vl_moe.yaml", [
            "training.logging_steps=3", "model.vocab_size=abc", "data.max_seq_len=4", "parallel.virtual_pp_degree=0",
            "model.vocab_size2=1"])
    lines = str(err.value).splitlines()
    assert lines[0] == "6 problems:" and len(lines) == 7
    for words in ("unknown key 'training.logging_steps'. It is a key of another section: logging.logging_steps",
                  "model.vocab_size = 'abc' has the wrong type", "Did you mean 'vocab_size'?",
                  "data.max_seq_len (4) must be at least 8", "parallel.virtual_pp_degree must be at least 1"):
        assert any(words in line for line in lines), (words, lines)
    # a value that did not build is not judged again at its default
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs" / "vl_moe.yaml", ["data.max_seq_len=long", "model.max_position_embeddings=16"])
    assert str(err.value).startswith("data.max_seq_len = 'long' has the wrong type"), err.value
    with pytest.raises(ConfigError) as err:  # one problem reads as it always did
        load_config(ROOT / "configs" / "vl_moe.yaml", ["training.max_steps=0"])
    assert str(err.value) == "training.max_steps must be at least 1, got 0."


@pytest.mark.parametrize("change, words", [
    ([FOLDER_CONFIG], ["holds a JSON list, not an object"]),
    ({"num_attention_heads": "4"}, ["num_attention_heads must be a positive whole number, not '4'"]),
    ({"hidden_size": [64]}, ["hidden_size must be a positive whole number, not [64]"]),
    ({"num_attention_heads": 0}, ["num_attention_heads must be a positive whole number, not 0"]),
    ({"moe_num_experts": 1.5}, ["moe_num_experts must be a whole number or a list of them, not 1.5"]),
    ({"moe_intermediate_size": {"text": 32}}, ["moe_intermediate_size must be a whole number or a list"]),
    ({"moe_num_experts": [4, True]}, ["moe_num_experts must be a whole number or a list of them"]),
    ({"num_key_value_heads": "2"}, ["model.num_key_value_heads", "integer"]),
], ids=["list", "string heads", "list width", "no heads", "fractional experts",
        "mapping widths", "boolean experts", "string kv heads"])
def test_a_model_folder_config_with_values_of_the_wrong_kind_is_a_config_error(tmp_path, change, words):
    """A run started from a model folder reads its config.json: each value of the wrong kind is named."""
    config = [FOLDER_CONFIG] if isinstance(change, list) else {**FOLDER_CONFIG, **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"training.model_name_or_path={tmp_path}"])
    for word in words:
        assert word in str(err.value)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(listing)


def test_moe_layer_rule():
    cfg = load_config(None, ["model.num_hidden_layers=8", "model.moe_layer_interval=2",
                             "model.moe_layer_start_index=2", "model.moe_layer_end_index=6"]).model
    # (i + 1) % 2 == 0 and 2 <= i <= 6 -> layers 3 and 5
    assert [i for i in range(8) if cfg.moe_modalities_at(i)] == [3, 5]
    per_modality = load_config(None, ["model.num_hidden_layers=4", "model.moe_layer_start_index=[1, 2]",
                                      "model.moe_layer_end_index=[3, 2]"]).model
    assert [per_modality.moe_modalities_at(i) for i in range(4)] == [[], [0], [0, 1], [0]]


@pytest.mark.slow
def test_cli_reports_config_errors_without_traceback(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "run_trainer.py"), "--config",
                             str(ROOT / "configs" / "vl_moe.yaml"), "model.moe_k=9"],
                            capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    assert "config error: model.moe_k (9)" in result.stderr
    assert "Traceback" not in result.stderr
    missing = subprocess.run([sys.executable, str(ROOT / "run_trainer.py"), "--config", "missing.yaml"],
                             capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert missing.returncode == 2 and "does not exist" in missing.stderr and "Traceback" not in missing.stderr


def test_layouts_must_fit_the_processes():
    from ernie_moe.parallel.env import check_layout, data_degree

    cfg = load_config(None, ["parallel.expert_parallel_degree=2"])
    check_layout(cfg.parallel, 4)
    with pytest.raises(ConfigError, match=r"expert_parallel_degree \(2\) must divide the data x sharding ranks \(3"):
        check_layout(cfg.parallel, 3)
    cfg = load_config(None, ["parallel.tensor_parallel_degree=2", "parallel.sharding_parallel_degree=2",
                             "parallel.sharding=stage1"])
    assert data_degree(cfg.parallel, 8) == 2
    with pytest.raises(ConfigError, match=r"6 processes cannot hold tensor x pipeline x sharding = 2 x 1 x 2 = 4"):
        check_layout(cfg.parallel, 6)
    for stage in ("stage2", "stage3"):  # sharded by the package's own step, which a pipeline schedule bypasses
        assert load_config(None, ["parallel.sharding_parallel_degree=2", f"parallel.sharding={stage}"])
        with pytest.raises(ConfigError, match=f"'{stage}' with pipeline_parallel_degree 2.*use 'stage1'"):
            load_config(None, ["parallel.sharding_parallel_degree=2", f"parallel.sharding={stage}",
                               "parallel.pipeline_parallel_degree=2", "training.gradient_accumulation_steps=2"])
    with pytest.raises(ConfigError, match="eval_generate.*sharding stage 3"):
        load_config(None, ["parallel.sharding_parallel_degree=2", "parallel.sharding=stage3",
                           "training.eval_generate=true"])


def test_moe_group_mp_rules():
    with pytest.raises(ConfigError, match="moe_group 'mp' spreads experts over the 2 tensor-parallel ranks"):
        load_config(None, ["parallel.tensor_parallel_degree=2", "parallel.moe_group=mp",
                           "parallel.expert_parallel_degree=4"])
    with pytest.raises(ConfigError, match="sequence_parallel with moe_group 'ep'"):
        load_config(None, ["parallel.tensor_parallel_degree=2", "parallel.sequence_parallel=true"])
    cfg = load_config(None, ["parallel.tensor_parallel_degree=2", "parallel.sequence_parallel=true",
                             "parallel.moe_group=mp"])
    assert cfg.parallel.sequence_parallel


@pytest.mark.parametrize("name, gpus, data_parallel", [("ernie45_vl_28b_a3b.yaml", 8, 1),
                                                       ("ernie45_vl_424b_a47b.yaml", 96, 1)])
def test_real_scale_configs_fit_their_gpu_counts(tmp_path, monkeypatch, name, gpus, data_parallel):
    from ernie_moe.parallel.env import check_layout, data_degree

    (tmp_path / "train.jsonl").write_text("")
    (tmp_path / "tokenizer.model").write_bytes(b"")
    cfg = load_config(ROOT / "configs" / name, [f"data.train_path={tmp_path / 'train.jsonl'}",
                                                 f"data.tokenizer_path={tmp_path}"])
    monkeypatch.setattr(paddle.device, "get_device", lambda: "gpu:0")
    check_layout(cfg.parallel, gpus)
    p = cfg.parallel
    assert data_degree(p, gpus) == data_parallel
    assert data_parallel * p.tensor_parallel_degree * p.pipeline_parallel_degree * p.sharding_parallel_degree == gpus
    with pytest.raises(ConfigError, match="cannot hold"):
        check_layout(cfg.parallel, gpus // 2 + 1)


def test_configs_that_expand_nest_or_are_not_text_are_refused_before_they_are_built(tmp_path):
    """A 300-byte alias bomb, YAML nested 20,000 deep, a Latin-1 file, a far too large one and a folder given as the
    config each give one config error (quickly: nothing is expanded), as does an alias in an override."""
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(7))
    cases = {"bomb.yaml": (bomb.encode(), "anchor or alias"),
             "deep.yaml": (b"a: " + b"[" * 20_000 + b"]" * 20_000 + b"\n", "levels deep"),
             "latin1.yaml": ("training:\n  output_dir: caf\xe9\n".encode("latin-1"), "not UTF-8"),
             "huge.yaml": (b"# " + b"x" * (2 << 20) + b"\n", "bytes; a config is at most")}
    for name, (data, message) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ConfigError, match=message):
            load_config(tmp_path / name)
    with pytest.raises(ConfigError, match="is not a regular file"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match="anchor or alias"):
        load_config(None, ["training.lora_targets=[&a attention, *a]"])


def test_a_transformers_layer_list_gives_the_moe_range_a_search_would():
    """transformers' mlp_layer_types read as (start, end, interval): the same as trying every interval, in one pass
    however long the list; a list no interval describes is a clear error."""
    import random

    from ernie_moe.config.transformers_form import _interval

    def searched(sparse):
        for interval in range(1, sparse[-1] + 2):
            if [i for i in range(sparse[0], sparse[-1] + 1) if (i + 1) % interval == 0] == sparse:
                return interval
        return None

    rng = random.Random(0)
    cases = [[0], [3], [1, 2, 3], [1, 3, 5], [2, 5, 8], [3, 5], [1, 2, 4]]
    cases += [sorted(rng.sample(range(20), k)) for k in range(1, 6) for _ in range(100)]
    for sparse in cases:
        want = searched(sparse)
        if want is None:
            with pytest.raises(ValueError, match="no \\(start, end, interval\\) describes"):
                _interval(sparse)
        else:
            assert _interval(sparse) == want, sparse
    assert _interval(list(range(1, 2_000_000, 2))) == 2
