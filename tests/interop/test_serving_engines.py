"""What vLLM, SGLang and FastDeploy read from a folder this package writes: config.json and the tensors as the
engines read them, the check a run makes at save time (``checkpoint.engines``) on good folders and on folders
broken on purpose, and the remote code transformers runs for the engines at their pin (transformers 5.19, in
``engines-venv/`` as .ci/run installs it): config, tokenizer and processor, against this package's encoding."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import load_file
from support.ernie import (
    SERVED_PIECES,
    SERVED_PLACEHOLDER,
    SERVED_SPECIALS,
    SERVED_VOCAB,
    VL_MODEL,
    make_ernie_tokenizer,
    make_served_tokenizer,
    paddleformers,
)
from support.lora import trainer
from support.runs import ROOT

from ernie_moe.checkpoint.engines import check_folder, summary_lines
from ernie_moe.checkpoint.remote_code import HUB_CODE
from ernie_moe.data.encoding.images import patchify, prepare
from ernie_moe.data.encoding.tokenizer import SentencePieceTokenizer
from ernie_moe.export import main as export_main

ENGINES_VENV = "engines-venv"  # .ci/run installs the engines' transformers pin here, apart from the package's
ENGINES_SIDE = ROOT / "tests" / "support" / "engines_side.py"
MARKERS = {"image_start_token_id": "<|IMAGE_START|>", "image_end_token_id": "<|IMAGE_END|>",
           "video_start_token_id": "<|VIDEO_START|>", "video_end_token_id": "<|VIDEO_END|>"}


def served_run(out, tokenizer, *overrides):
    """Two steps of the default model with an ERNIE-ordered SentencePiece tokenizer: its final model."""
    tr = trainer(out, f"data.tokenizer_path={tokenizer}", f"model.vocab_size={SERVED_VOCAB}",
                 f"model.im_patch_id={SERVED_PLACEHOLDER}", "training.max_steps=2", "training.eval_steps=0",
                 "training.save_steps=0", "data.image_min_pixels=3136", "data.image_max_pixels=50176",
                 "data.max_image_side=0", *overrides)
    tr.train()
    return out / "final_model"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the tokenizer's folder, a trained model's final_model, what the run printed)."""
    root = tmp_path_factory.mktemp("served")
    tokenizer = make_served_tokenizer(root / "tokenizer")
    return tokenizer, served_run(root / "run", tokenizer)


def problems(folder) -> dict[str, list[str]]:
    return {r.engine: r.problems for r in check_folder(folder)}


def test_a_run_writes_config_json_and_tensors_as_the_engines_read_them(served):
    _, final = served
    config = json.loads((final / "config.json").read_text())
    layers = config["num_hidden_layers"]
    assert config["moe_layer_start_index"] == [1, 1] and config["moe_layer_end_index"] == [layers - 1] * 2
    assert config["use_temporal_conv"] is True and config["hidden_act"] == "silu"
    assert config["vision_config"]["in_chans"] == config["vision_config"]["in_channels"] == 3
    assert {k: config[k] for k in MARKERS} == {k: SERVED_PIECES + SERVED_SPECIALS.index(t) for k, t in MARKERS.items()}
    assert config["auto_map"] == {"AutoConfig": "configuration_ernie_moe.Ernie4_5_VLMoEConfig"}
    for name in ("configuration_ernie_moe.py", "tokenization_ernie_moe.py", "processing_ernie_moe.py"):
        assert (final / name).read_bytes() == (HUB_CODE / name).read_bytes()
    processor = json.loads((final / "preprocessor_config.json").read_text())
    assert processor["auto_map"]["AutoProcessor"] == "processing_ernie_moe.Ernie4_5_VLProcessor"
    assert (processor["min_pixels"], processor["max_pixels"]) == (3136, 50176)
    # the run did not balance with a correction bias (moe_use_aux_free false): zeros, which route as none
    assert config["moe_use_aux_free"] is False
    tensors = {}
    for shard in final.glob("*.safetensors"):
        tensors.update(load_file(shard))
    biases = {n: v for n, v in tensors.items() if n.endswith("moe_statics.e_score_correction_bias")}
    assert sorted(biases) == [f"model.layers.{i}.mlp.moe_statics.e_score_correction_bias" for i in range(1, layers)]
    assert all(v.shape == (2, 4) and not v.any() for v in biases.values())
    assert problems(final) == {"vllm": [], "sglang": [], "fastdeploy": []}


def test_the_run_says_whether_the_engines_serve_its_model(served):
    _, final = served
    summary = json.loads((final.parent / "summary.json").read_text())
    assert {e: s["loads"] for e, s in summary["serving_engines"].items()} == {
        "vllm": True, "sglang": True, "fastdeploy": True}
    assert summary_lines(check_folder(final)) == [
        "serving: vLLM 0.33.0, SGLang 0.5.23, FastDeploy (develop) load this folder as trained"]


def broken(final, tmp_path, name) -> Path:
    folder = tmp_path / name
    shutil.copytree(final, folder)
    return folder


def edit_json(path: Path, **changes) -> None:
    value = json.loads(path.read_text())
    value.update(changes)
    path.write_text(json.dumps(value))


def test_the_check_names_each_fault_of_a_folder_broken_on_purpose(served, tmp_path, capsys):
    tokenizer, final = served
    scalar = broken(final, tmp_path, "scalar")  # the MoE range as this package wrote it before
    edit_json(scalar / "config.json", moe_layer_start_index=1, moe_layer_end_index=-1)
    found = problems(scalar)
    for engine in ("vllm", "sglang"):
        assert any("moe_layer_end_index -1: " in p and "[text, vision] list" in p for p in found[engine]), found
    # layer 1: 8 experts' gate, up and down, 2 routers, the shared expert's 3, the bias
    assert found["fastdeploy"] == ["layers 1 hold experts, but FastDeploy (develop)'s reading of moe_layer_start_index "
                                   "1 / moe_layer_end_index -1 builds them dense and skips their 30 expert, router "
                                   "and shared-expert tensors"]

    unbiased = broken(final, tmp_path, "unbiased")
    index = json.loads((unbiased / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if "moe_statics" not in k}
    (unbiased / "model.safetensors.index.json").write_text(json.dumps(index))
    found = problems(unbiased)
    assert any("vLLM creates it in every MoE layer and refuses" in p for p in found["vllm"]), found
    assert any("uninitialised memory" in p for p in found["sglang"]), found
    assert found["fastdeploy"] == []  # it reads the bias only with moe_use_aux_free
    edit_json(unbiased / "config.json", moe_use_aux_free=True)
    assert any("which FastDeploy reads with moe_use_aux_free" in p for p in problems(unbiased)["fastdeploy"])

    no_code = broken(final, tmp_path, "no_code")
    (no_code / "configuration_ernie_moe.py").unlink()
    found = problems(no_code)
    for engine in ("vllm", "sglang"):
        assert "config.json's auto_map names configuration_ernie_moe.py, which the folder lacks: " \
               "AutoConfig.from_pretrained raises" in found[engine]
    assert found["fastdeploy"] == []  # it reads config.json as a dict

    no_map = broken(final, tmp_path, "no_map")
    config = json.loads((no_map / "config.json").read_text())
    del config["auto_map"], config["image_start_token_id"]
    (no_map / "config.json").write_text(json.dumps(config))
    found = problems(no_map)
    assert any("is not a transformers model type and config.json has no auto_map" in p for p in found["vllm"])
    assert any("lacks image_start_token_id" in p and "AttributeError" in p for p in found["sglang"])

    low = broken(final, tmp_path, "low")  # text pieces above the image placeholder
    make_ernie_tokenizer(tmp_path / "low_tokenizer")
    shutil.copy(tmp_path / "low_tokenizer" / "tokenizer.model", low / "tokenizer.model")
    shutil.copy(tmp_path / "low_tokenizer" / "tokenizer_config.json", low / "tokenizer_config.json")
    placeholder = SentencePieceTokenizer(str(low), 0).placeholder_id()
    edit_json(low / "config.json", im_patch_id=placeholder)
    assert any("text tokens have ids at or above im_patch_id" in p for p in problems(low)["fastdeploy"])

    transformers_form = broken(final, tmp_path, "nested")
    edit_json(transformers_form / "config.json", model_type="ernie4_5_vl_moe")
    assert all(any("transformers' nested ERNIE-4.5-VL config" in p for p in v)
               for v in problems(transformers_form).values())

    assert export_main([str(final), "--check"]) == 0
    assert export_main([str(scalar), "--check"]) == 1
    out = capsys.readouterr().out
    assert "vLLM 0.33.0: loads it as trained" in out and "FastDeploy (develop): would not serve it as trained" in out
    assert export_main([str(tmp_path / "absent"), "--check"]) == 2
    del tokenizer


def test_an_mtp_folder_is_named_for_sglang_and_exported_without_its_depths(served, tmp_path):
    """SGLang's VL loader raises on the multi-token prediction tensors; vLLM and FastDeploy skip them.
    ``export --no-mtp`` writes the folder SGLang loads."""
    tokenizer, _ = served
    final = served_run(tmp_path / "mtp", tokenizer, "model.num_nextn_predict_layers=1")
    found = {r.engine: r for r in check_folder(final)}
    assert [p for p in found["sglang"].problems if "multi-token prediction" in p]
    assert found["vllm"].problems == [] and found["fastdeploy"].problems == []
    assert any("skips the" in n for n in found["vllm"].notes)
    assert export_main([str(final), str(tmp_path / "no_mtp"), "--no-mtp"]) == 0
    assert problems(tmp_path / "no_mtp") == {"vllm": [], "sglang": [], "fastdeploy": []}
    assert json.loads((tmp_path / "no_mtp" / "config.json").read_text())["num_nextn_predict_layers"] == 0


def test_the_text_moe_export_resolves_its_range_and_holds_a_bias(served, tmp_path):
    tokenizer, _ = served
    final = served_run(tmp_path / "pool", tokenizer, "model.moe_num_experts=[4]", "model.moe_intermediate_size=[64]",
                       "model.moe_use_hard_gate=false")
    assert export_main([str(final), str(tmp_path / "text"), "--model-type", "ernie4_5_moe"]) == 0
    config = json.loads((tmp_path / "text" / "config.json").read_text())
    assert (config["moe_layer_start_index"], config["moe_layer_end_index"]) == (1, config["num_hidden_layers"] - 1)
    names = json.loads((tmp_path / "text" / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.moe_statics.e_score_correction_bias" in names
    assert (tmp_path / "text" / "tokenization_ernie_moe.py").is_file()
    assert not (tmp_path / "text" / "configuration_ernie_moe.py").exists()  # transformers knows ernie4_5_moe
    assert problems(tmp_path / "text") == {"vllm": [], "sglang": [], "fastdeploy": []}


def test_the_remote_processor_resizes_as_the_training_does():
    """The resize rule written again in the remote code (which runs without this package) against the training's,
    over sizes from a sliver to a poster, tall and wide, under and over the budget."""
    import ast
    import math

    from ernie_moe.data.encoding.images import pixel_budget_size

    # the function and its constant alone (the module imports transformers, which runs apart from paddle)
    tree = ast.parse((HUB_CODE / "processing_ernie_moe.py").read_text())
    wanted = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "budget_size"
              or isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "MAX_ASPECT" for t in n.targets)]
    space: dict = {"math": math}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), "processing_ernie_moe.py", "exec"), space)
    budget_size = space["budget_size"]

    sides = [1, 13, 28, 55, 100, 333, 999, 4096, 9000]
    for height in sides:
        for width in sides:
            for budget in ((56 * 56, 28 * 28 * 1280), (3136, 50176), (4 * 28 * 28, 16 * 28 * 28)):
                assert budget_size(height, width, 28, *budget) == pixel_budget_size(height, width, 28, *budget)


# -- the engines' transformers, at their pin ----------------------------------------------------------------------

def engines_python() -> str:
    python = ROOT / ENGINES_VENV / "bin" / "python"
    if not python.is_file():
        pytest.skip(f"the engines' transformers pin is not installed (.ci/run installs it in {ENGINES_VENV}/)")
    return str(python)


def engines_side(folder, tmp_path, texts, prompt, images) -> tuple[dict, dict]:
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"texts": texts, "prompt": prompt, "images": [str(p) for p in images]}))
    done = subprocess.run([engines_python(), str(ENGINES_SIDE), str(folder), str(request), str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((tmp_path / "engines.json").read_text()), dict(np.load(tmp_path / "engines.npz"))


SLOT = "<|IMAGE_START|><|image@placeholder|><|IMAGE_END|>"


def pictures(folder) -> list[Path]:
    rng = np.random.default_rng(3)
    paths = []
    for n, (h, w) in enumerate([(70, 100), (330, 60), (400, 380)]):
        paths.append(folder / f"picture{n}.png")
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(paths[-1])
    return paths


def assert_reads_as_trained(folder, tmp_path, config_module: str, processor_module: str) -> dict:
    """The engines' AutoConfig, AutoTokenizer and AutoProcessor on ``folder``: the config the engines index, the
    tokenizer's ids and the processor's patches, grids and placeholders those of this package's encoding."""
    ours = SentencePieceTokenizer(str(folder), SERVED_PLACEHOLDER)
    texts = [f"<|begin_of_sentence|>User: Picture 1:{SLOT}what is this?\nAssistant: a red cat<|end_of_sentence|>",
             "  two  spaces ", "Wie heißt das? café"]
    images = pictures(tmp_path)
    prompt = f"User: {SLOT} and {SLOT}{SLOT}\nAssistant: "
    theirs, arrays = engines_side(folder, tmp_path, texts, prompt, images)
    assert theirs["transformers"] == "5.19.0"
    config = theirs["config"]
    assert config["class"].endswith(config_module)
    assert config["moe_layer_start_index"] == [1, 1] and config["use_temporal_conv"] is True
    assert config["vision"]["in_chans"] == config["vision"]["in_channels"] == 3
    assert config["image_start_token_id"] == ours.token_id("<|IMAGE_START|>")
    assert theirs["tokenizer"]["ids"] == [ours.encode(t) for t in texts]
    assert theirs["tokenizer"]["eos_token_id"] == ours.eos_id
    assert theirs["processor"]["class"].endswith(processor_module)
    budget = (theirs["processor"]["size"]["min_pixels"], theirs["processor"]["size"]["max_pixels"])
    saved = json.loads((folder / "preprocessor_config.json").read_text())
    assert budget == (saved["min_pixels"], saved["max_pixels"])
    start, placeholders = 0, 0
    for n, path in enumerate(images):
        patches, grid = patchify(prepare(np.asarray(Image.open(path).convert("RGB")), 28, 0, budget), 14, 2)
        np.testing.assert_array_equal(arrays["grid_thw"][n], grid)
        np.testing.assert_allclose(arrays["patches"][start:start + len(patches)], patches, atol=1e-5)
        start += len(patches)
        placeholders += len(patches) // 4
    assert start == len(arrays["patches"])
    assert int((arrays["input_ids"] == SERVED_PLACEHOLDER).sum()) == placeholders
    return theirs


@pytest.mark.slow
def test_transformers_at_the_engines_pin_reads_a_trained_folder_as_it_was_trained(served, tmp_path):
    _, final = served
    assert_reads_as_trained(final, tmp_path, "configuration_ernie_moe.Ernie4_5_VLMoEConfig",
                            "processing_ernie_moe.Ernie4_5_VLProcessor")


# A published ERNIE-4.5-VL folder's remote code, under its file names: the test gives them this package's classes
# (the published modules are not on this machine); the names and auto_map entries are the published ones.
PUBLISHED_CODE = {"configuration_ernie_45t_vl.py": "configuration_ernie_moe.py",
                  "tokenization_ernie_45t_vl.py": "tokenization_ernie_moe.py",
                  "processing_ernie_45t_vl.py": "processing_ernie_moe.py"}


def make_published(root, tokenizer) -> Path:
    """A tiny ERNIE-4.5-VL that PaddleFormers saves, given a published folder's remote code, tokenizer and
    processor config (its classes and auto_map, its pixel budget)."""
    made = dict(VL_MODEL, vocab_size=SERVED_VOCAB, im_patch_id=SERVED_PLACEHOLDER)
    root.mkdir(parents=True)
    paddleformers("make", "vl", root / "model", json.dumps(made), cwd=root)
    folder = root / "model" / "hf"
    for name, ours in PUBLISHED_CODE.items():
        shutil.copy(HUB_CODE / ours, folder / name)
    (folder / "modeling_ernie_45t_vl.py").write_text("from .configuration_ernie_45t_vl import Ernie4_5_VLMoEConfig\n")
    edit_json(folder / "config.json", auto_map={
        "AutoConfig": "configuration_ernie_45t_vl.Ernie4_5_VLMoEConfig",
        "AutoModel": "modeling_ernie_45t_vl.Ernie4_5_VLMoeForConditionalGeneration",
        "AutoModelForCausalLM": "modeling_ernie_45t_vl.Ernie4_5_VLMoeForConditionalGeneration"},
        moe_layer_start_index=[1, 1], moe_layer_end_index=[2, 2])
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, folder / name)
    edit_json(folder / "tokenizer_config.json",
              auto_map={"AutoTokenizer": ["tokenization_ernie_45t_vl.Ernie4_5_VLTokenizer", None]})
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Ernie_45T_VLImageProcessor", "processor_class": "Ernie_45T_VLProcessor",
        "auto_map": {"AutoProcessor": "processing_ernie_45t_vl.Ernie4_5_VLProcessor",
                     "AutoImageProcessor": "processing_ernie_45t_vl.Ernie4_5_VLImageProcessor"},
        "min_pixels": 3136, "max_pixels": 28 * 28 * 6177, "patch_size": 14, "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_resize": True, "resample": 3, "rescale_factor": 1 / 255}))
    return folder


@pytest.mark.slow
def test_a_fine_tune_of_a_published_folder_keeps_its_remote_code_and_processor(served, tmp_path):
    """The base's .py modules copied, its auto_map entries and processor classes kept, the run's pixel budget on
    top; the check passes and the engines' transformers builds the base's classes."""
    tokenizer, _ = served
    published = make_published(tmp_path / "published", tokenizer)
    final = served_run(tmp_path / "run", published, f"training.model_name_or_path={published}",
                       "data.image_max_pixels=100352")
    for name in (*PUBLISHED_CODE, "modeling_ernie_45t_vl.py"):
        assert (final / name).read_bytes() == (published / name).read_bytes(), name
    assert not (final / "configuration_ernie_moe.py").exists()
    config = json.loads((final / "config.json").read_text())
    assert config["auto_map"]["AutoConfig"] == "configuration_ernie_45t_vl.Ernie4_5_VLMoEConfig"
    processor = json.loads((final / "preprocessor_config.json").read_text())
    assert processor["processor_class"] == "Ernie_45T_VLProcessor"
    assert processor["auto_map"]["AutoProcessor"] == "processing_ernie_45t_vl.Ernie4_5_VLProcessor"
    assert (processor["min_pixels"], processor["max_pixels"]) == (3136, 100352)  # the run's budget
    assert problems(final) == {"vllm": [], "sglang": [], "fastdeploy": []}
    (tmp_path / "side").mkdir()
    assert_reads_as_trained(final, tmp_path / "side", "configuration_ernie_45t_vl.Ernie4_5_VLMoEConfig",
                            "processing_ernie_45t_vl.Ernie4_5_VLProcessor")


@pytest.mark.slow
def test_doctor_serve_holds_an_engines_answer_against_this_packages(served, tmp_path):
    """``doctor --serve`` with an OpenAI-compatible command standing in for an engine (this package's server, the
    one that runs here): the same folder served gives this package's answer (pass); another model's answer fails."""
    tokenizer, final = served
    other = served_run(tmp_path / "other", tokenizer, "training.seed=7")
    command = "{python} -m ernie_moe.serve --model %s --port {port} --served-name served"
    doctor = [sys.executable, "-m", "ernie_moe.doctor", "--serve", str(final), "--serve-timeout", "600"]
    same = subprocess.run([*doctor, "--engine-command", command % "{model}"], capture_output=True, text=True,
                          timeout=900, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert same.returncode == 0, same.stdout[-2000:] + same.stderr[-2000:]
    row = [line for line in same.stdout.splitlines() if line.startswith("| ") and "pass" in line]
    assert len(row) == 1 and "| 0.000 |" in row[0], row  # the server's log-probabilities, ours within 5e-4
    differs = subprocess.run([*doctor, "--engine-command", command % other], capture_output=True, text=True,
                             timeout=900, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert differs.returncode == 1 and "| FAIL |" in differs.stdout, differs.stdout[-2000:] + differs.stderr[-2000:]
    none = subprocess.run([*doctor], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert none.returncode == 1 and "no serving engine is installed here" in none.stdout
