"""Starting from ERNIE 4.5 checkpoints made by PaddleFormers itself, and exporting back to it."""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import paddle
import pytest
from support.ernie import paddleformers
from support.models import imported
from support.runs import ROOT, load_model

from ernie_moe.checkpoint import save_model
from ernie_moe.checkpoint.formats import CheckpointError
from ernie_moe.checkpoint.pretrained import format_report, load_pretrained
from ernie_moe.config import ConfigError, load_config
from ernie_moe.model.ernie_vl import Batch
from ernie_moe.model.parameter_kinds import is_vision
from ernie_moe.parallel.env import DistEnv
from ernie_moe.training.runner import build_model

pytestmark = pytest.mark.slow  # starts processes


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Tiny random ERNIE 4.5 dense, text MoE and VL MoE models, each saved by PaddleFormers in the Hugging Face
    layout (``hf``) and as its in-memory Paddle-layout state dict (``paddle``)."""
    root = tmp_path_factory.mktemp("paddleformers")
    for kind in ("dense", "moe", "vl"):
        paddleformers("make", kind, root / kind, cwd=root)
    return root


def weights(model) -> dict:
    return {name: param.numpy() for name, param in model.stable_named_parameters()}


def text_batch(ids: np.ndarray) -> Batch:
    rows, seq = ids.shape
    positions = np.broadcast_to(np.arange(seq)[None, :, None], [rows, seq, 3]).copy()
    zeros = paddle.zeros([rows, seq], "int64")
    return Batch(paddle.to_tensor(ids), paddle.full([rows, seq], -100, "int64"), zeros, paddle.to_tensor(positions),
                 paddle.full([rows, seq], seq, "int64"), paddle.zeros([0, 588]), np.zeros([0, 3], np.int64))


def test_dense_model_gives_paddleformers_logits(sources, tmp_path):
    ids = np.random.RandomState(0).randint(0, 96, size=[2, 12]).astype("int64")
    np.save(tmp_path / "ids.npy", ids)
    paddleformers("logits", sources / "dense" / "hf", tmp_path / "ids.npy", tmp_path / "logits.npy", cwd=tmp_path)
    cfg, model, report = imported(sources / "dense" / "hf")
    assert cfg.model.moe_num_experts == [] and cfg.model.head_dim == 16 and not cfg.model.tie_word_embeddings
    assert report["upcycled"] == [] and report["ignored"] == []
    assert report["new"] and all(is_vision(n) for n in report["new"])  # a text model has no vision side
    assert "model.layers.0.self_attn.qkv_proj.weight" in report["converted"]
    model.eval()
    ours = model(text_batch(ids), return_logits=True).logits.numpy()
    theirs = np.load(tmp_path / "logits.npy")
    assert ours.shape == theirs.shape == (2, 12, 96)
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)


def test_greedy_tokens_equal_paddleformers_generate(sources, tmp_path):
    """5 prompts, 32 new tokens each, through the key/value cache: PaddleFormers' greedy ``generate()`` tokens."""
    from ernie_moe.data.encoding.packing import Encoded
    from ernie_moe.generation import generate, load_model_folder

    prompts = np.random.RandomState(1).randint(3, 96, size=[5, 8]).astype("int64")
    np.save(tmp_path / "prompts.npy", prompts)
    paddleformers("generate", sources / "dense" / "hf", tmp_path / "prompts.npy", 32, tmp_path / "theirs.npy",
                  cwd=tmp_path)
    theirs = np.load(tmp_path / "theirs.npy")
    loaded = load_model_folder(sources / "dense" / "hf", need_tokenizer=False)
    assert not loaded.sees_images
    eos = json.loads((sources / "dense" / "hf" / "config.json").read_text()).get("eos_token_id", 2)
    for prompt, expected in zip(prompts, theirs):
        positions = np.repeat(np.arange(len(prompt))[:, None], 3, axis=1)
        encoded = Encoded(prompt, np.zeros(len(prompt), bool), np.zeros(len(prompt), np.int64),
                          np.zeros(len(prompt), np.int64), positions, [], [])
        ours = generate(loaded.model, encoded, 32, eos).ids
        expected = list(expected[: list(expected).index(eos)] if eos in expected else expected)
        assert ours == expected and len(expected) == 32

@pytest.mark.parametrize("kind", ["dense", "moe", "vl"])
def test_hugging_face_and_paddle_layouts_load_the_same_weights(sources, kind):
    """PaddleFormers' files and its in-memory state (a model_state.pdparams in the Paddle layout, with its
    per-KV-group fused q/k/v for the text models) give the same model."""
    _, from_hf, hf_report = imported(sources / kind / "hf")
    _, from_paddle, paddle_report = imported(sources / kind / "paddle")
    a, b = weights(from_hf), weights(from_paddle)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert hf_report["new"] == paddle_report["new"]
    if kind == "vl":
        assert hf_report["new"] == []
    else:
        assert all(is_vision(n) for n in hf_report["new"])
    for report in (hf_report, paddle_report):  # multi-token prediction and a tied head's copy are left out
        assert all(n.startswith("model.mtp") or n == "lm_head.weight" for n in report["ignored"]), report["ignored"]


def test_vl_round_trip_through_paddleformers(sources, tmp_path):
    """import -> the trainer's final save -> PaddleFormers' from_pretrained: every tensor as PaddleFormers had it."""
    cfg, model, _ = imported(sources / "vl" / "hf")
    save_model(model, cfg.model, str(tmp_path / "export"), hf_layout=True)
    paddleformers("dump", "vl", tmp_path / "export", tmp_path / "ours.npz", cwd=tmp_path)
    paddleformers("dump", "vl", sources / "vl" / "hf", tmp_path / "theirs.npz", cwd=tmp_path)
    ours, theirs = np.load(tmp_path / "ours.npz"), np.load(tmp_path / "theirs.npz")
    assert sorted(ours.files) == sorted(theirs.files) and len(ours.files) > 80
    for name in theirs.files:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)


def test_text_moe_round_trip_through_a_checkpoint_and_the_exporter(sources, tmp_path):
    """import -> a Paddle-layout save -> ``python -m ernie_moe.export --model-type ernie4_5_moe`` -> PaddleFormers."""
    cfg, model, _ = imported(sources / "moe" / "hf")
    assert cfg.model.moe_num_experts == [4] and cfg.model.moe_use_aux_free
    save_model(model, cfg.model, str(tmp_path / "saved"))
    done = subprocess.run([sys.executable, "-m", "ernie_moe.export", str(tmp_path / "saved"), str(tmp_path / "export"),
                           "--model-type", "ernie4_5_moe"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "(ernie4_5_moe, Hugging Face layout)" in done.stdout
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["model_type"] == "ernie4_5_moe" and "vision_config" not in config and config["torch_dtype"]
    paddleformers("dump", "moe", tmp_path / "export", tmp_path / "ours.npz", cwd=tmp_path)
    paddleformers("dump", "moe", sources / "moe" / "hf", tmp_path / "theirs.npz", cwd=tmp_path)
    ours, theirs = np.load(tmp_path / "ours.npz"), np.load(tmp_path / "theirs.npz")
    shared = [n for n in theirs.files if not n.startswith("model.mtp")]  # not part of this package's model
    assert len(shared) > 40 and set(shared) <= set(ours.files)
    for name in shared:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)


def test_a_dense_model_is_upcycled_into_every_expert(sources):
    overrides = ["model.moe_num_experts=[4,4]", "model.moe_intermediate_size=[128,128]",
                 "model.moe_layer_start_index=1"]
    _, model, report = imported(sources / "dense" / "hf", *overrides)
    _, dense, _ = imported(sources / "dense" / "hf")
    moe, mlp = weights(model), weights(dense)
    assert len(report["upcycled"]) == 2 * 8 * 2  # layers 1, 2 x (4 text + 4 vision experts) x (up_gate, down)
    for layer in (1, 2):
        for expert in range(8):
            for part in ("up_gate_proj", "down_proj"):
                np.testing.assert_array_equal(moe[f"model.layers.{layer}.mlp.experts.{expert}.{part}.weight"],
                                              mlp[f"model.layers.{layer}.mlp.{part}.weight"])
    assert "model.layers.1.mlp.gate.weight_1" in report["new"]
    assert "model.layers.2.mlp.shared_experts.up_gate_proj.weight" in report["new"]
    assert report["ignored"] == []  # the dense MLPs of layers 1 and 2 went into the experts
    np.testing.assert_array_equal(moe["model.layers.0.mlp.up_gate_proj.weight"],
                                  mlp["model.layers.0.mlp.up_gate_proj.weight"])
    text = format_report(report)
    assert "upcycled     32" in text and "model.layers.*.mlp.experts.*.up_gate_proj.weight" in text


def test_a_text_moe_model_grows_vision_experts(sources):
    """Text experts and router come from the source; vision experts, router and correction-bias row start fresh."""
    _, model, report = imported(sources / "moe" / "hf", "model.moe_num_experts=[4,4]",
                                "model.moe_intermediate_size=[32,16]")
    _, text_only, _ = imported(sources / "moe" / "hf")
    grown, source = weights(model), weights(text_only)
    np.testing.assert_array_equal(grown["model.layers.1.mlp.experts.3.down_proj.weight"],
                                  source["model.layers.1.mlp.experts.3.down_proj.weight"])
    assert "model.layers.1.mlp.experts.4.down_proj.weight" in report["new"]
    assert "model.layers.1.mlp.gate.weight_1" in report["new"]
    bias = grown["model.layers.1.mlp.moe_statics.e_score_correction_bias"]
    np.testing.assert_array_equal(bias[0], source["model.layers.1.mlp.moe_statics.e_score_correction_bias"][0])
    np.testing.assert_array_equal(bias[1], np.zeros(4))
    assert "model.layers.1.mlp.moe_statics.e_score_correction_bias" in report["converted"]


def test_mismatches_and_unreadable_sources_are_errors_that_name_what_is_wrong(sources, tmp_path):
    with pytest.raises(ConfigError, match=r"model\.intermediate_size=64 on the command line contradicts .*"
                                          r"intermediate_size = 128"):
        imported(sources / "dense" / "hf", "model.intermediate_size=64")
    narrower = dataclasses.replace(load_config(None, [f"training.model_name_or_path={sources / 'dense' / 'hf'}"]).model,
                                   intermediate_size=64)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.mlp\.up_gate_proj\.weight'.*\[64, 256\].*"
                                              r"\[64, 128\]"):
        load_pretrained(build_model(narrower, DistEnv()), sources / "dense" / "hf")
    with pytest.raises(CheckpointError, match=r"cannot upcycle model\.layers\.1\.mlp\.up_gate_proj\.weight"):
        imported(sources / "dense" / "hf", "model.moe_num_experts=[4,4]", "model.moe_intermediate_size=[128,64]")
    with pytest.raises(ConfigError, match="has no config.json"):
        load_config(None, [f"training.model_name_or_path={tmp_path}"])
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"model_type": "llama", "num_attention_heads": 4}))
    with pytest.raises(CheckpointError, match="model_type 'llama' is not one of"):
        load_pretrained(None, odd)
    (odd / "config.json").write_text(json.dumps({"model_type": "ernie4_5", "hidden_size": 64}))
    with pytest.raises(ConfigError, match="lacks vocab_size, num_hidden_layers, num_attention_heads"):
        load_config(None, [f"training.model_name_or_path={odd}"])
    (odd / "config.json").write_text((sources / "dense" / "hf" / "config.json").read_text())
    with pytest.raises(CheckpointError, match="holds no weights"):
        load_pretrained(None, odd)
    cut = tmp_path / "cut"
    cut.mkdir()
    for f in (sources / "dense" / "hf").iterdir():
        (cut / f.name).write_bytes(f.read_bytes())
    shard = cut / "model-00001-of-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"model-00001-of-00001\.safetensors"):
        imported(cut)


def test_training_starts_from_a_paddleformers_checkpoint_and_ends_in_its_format(sources, tmp_path):
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "run_trainer.py", "--config", "configs/finetune_ernie45_vl.yaml",
         f"training.model_name_or_path={sources / 'vl' / 'hf'}", f"training.output_dir={out}",
         "data.dataset=synthetic", "data.max_seq_len=64", "data.image_size=56", "training.max_steps=4",
         "training.eval_steps=0", "training.per_device_train_batch_size=2", "data.num_eval_samples=8",
         "logging.progress_bar=false"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "initialised from" in done.stdout and "Hugging Face layout" in done.stdout
    report = json.loads((out / "import_report.json").read_text())
    assert report["new"] == [] and len(report["loaded"]) + len(report["converted"]) == 80
    final = out / "final_model"
    assert json.loads((final / "config.json").read_text())["torch_dtype"] == "float32"
    tensors = load_model(final)
    assert "model.layers.1.mlp.experts.4.gate_proj.weight" in tensors and "lm_head.weight" not in tensors
    bad = subprocess.run([sys.executable, "run_trainer.py", "--config", "configs/finetune_ernie45_vl.yaml",
                          f"training.model_name_or_path={tmp_path / 'missing'}"], cwd=ROOT, capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "has no config.json" in bad.stderr


def train_lora(base, out):
    done = subprocess.run(
        [sys.executable, "run_trainer.py", "--config", "configs/finetune_ernie45_vl.yaml",
         f"training.model_name_or_path={base}", f"training.output_dir={out}",
         "data.dataset=synthetic", "data.max_seq_len=64", "data.image_size=56", "training.max_steps=3",
         "training.eval_steps=0", "training.per_device_train_batch_size=2", "data.num_eval_samples=8",
         "logging.progress_bar=false", "training.fine_tuning=lora", "training.learning_rate=1e-2"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    return out / "final_model"


def test_a_lora_adapter_trained_here_gives_paddleformers_lora_logits(sources, tmp_path):
    """PaddleFormers' ``LoRAModel.from_pretrained`` reads the adapter of a LoRA run on its dense model and
    computes our logits."""
    from ernie_moe.generation.model_folder import load_model_folder

    adapter = train_lora(sources / "dense" / "hf", tmp_path / "run")
    ids = np.random.default_rng(0).integers(6, 90, [2, 12])
    np.save(tmp_path / "ids.npy", ids)
    paddleformers("lora_logits", "dense", sources / "dense" / "hf", adapter, tmp_path / "ids.npy",
                  tmp_path / "theirs.npy", cwd=tmp_path)
    with paddle.no_grad():
        ours = load_model_folder(adapter, need_tokenizer=False).model(text_batch(ids), return_logits=True).logits
        base = load_model_folder(sources / "dense" / "hf", need_tokenizer=False).model(text_batch(ids),
                                                                                      return_logits=True).logits
    theirs = np.load(tmp_path / "theirs.npy")
    assert np.abs(ours.numpy() - base.numpy()).max() > 1e-2  # the adapter changes the model
    np.testing.assert_allclose(ours.numpy(), theirs, rtol=1e-4, atol=1e-4)


def test_paddleformers_loads_a_text_moe_adapter_trained_here(sources, tmp_path):
    """On the text MoE every pair PaddleFormers' LoRA model expects (experts and shared experts included) is
    read from the adapter, with our values; its MoE forward needs GPU-only dispatch kernels, so the logits
    are compared on the dense model above."""
    from ernie_moe.finetune.adapter_files import read_adapter

    adapter = train_lora(sources / "moe" / "hf", tmp_path / "run")
    paddleformers("lora_dump", "moe", sources / "moe" / "hf", adapter, tmp_path / "theirs.npz", cwd=tmp_path)
    theirs = dict(np.load(tmp_path / "theirs.npz"))
    _, ours = read_adapter(adapter)
    assert set(theirs) == set(ours) and any(".mlp.experts.3." in k for k in theirs)
    for name, value in ours.items():
        np.testing.assert_array_equal(theirs[name], value, err_msg=name)


def to_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 rounded to bfloat16 (nearest, ties to even), as float32."""
    bits = x.astype(np.float32).view(np.uint32)
    return (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


def test_pixel_budget_images_are_those_of_ernies_image_processor(tmp_path):
    """data.image_min_pixels / image_max_pixels at ERNIE's values: for a small, a tall, a wide, an over-budget,
    a below-minimum and a 448 x 896 image, the grid equals PaddleFormers' Ernie4_5_VLImageProcessor's and the
    normalised patches (in merge-block order) equal its pixel_values, which it returns in bfloat16, once ours
    are rounded to bfloat16."""
    from ernie_moe.data.encoding.images import patchify, prepare

    rng = np.random.default_rng(0)
    for i, (height, width) in enumerate([(70, 100), (1500, 300), (300, 1600), (2000, 2000), (30, 40), (448, 896)]):
        image = (rng.random((height, width, 3)) * 255).astype(np.uint8)
        np.save(tmp_path / f"{i}.npy", image)
        paddleformers("image", tmp_path / f"{i}.npy", tmp_path / f"{i}.npz", cwd=tmp_path)
        reference = np.load(tmp_path / f"{i}.npz")
        min_pixels, max_pixels = (int(x) for x in reference["budget"])
        cfg = load_config(None, [f"data.image_min_pixels={min_pixels}", f"data.image_max_pixels={max_pixels}"])
        patches, grid = patchify(prepare(image, 28, 448, cfg.data.pixel_budget), 14, 2)
        np.testing.assert_array_equal(grid, reference["grid"][0], err_msg=f"{height} x {width}")
        np.testing.assert_array_equal(to_bfloat16(patches), reference["pixels"], err_msg=f"{height} x {width}")
