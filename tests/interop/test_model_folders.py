"""What a fine-tuning run writes, read where it goes next: generation and evaluation, PaddleFormers' model and
LoRA classes."""

import json
import os
from argparse import Namespace
from collections import Counter

import numpy as np
import pytest
from PIL import Image
from support.ernie import (
    BUDGET,
    VL_MODEL,
    ernie_config,
    make_ernie_tokenizer,
    mtp_logits,
    one_row_batch,
    paddleformers,
    vl_logits,
)
from support.runs import ROOT, fine_tune, run_launch

from ernie_moe.config import load_config
from ernie_moe.data.encoding.packing import Encoder
from ernie_moe.data.feeding.loader import build_tokenizer
from ernie_moe.data.formats.jsonl import JsonlDataset
from ernie_moe.evaluate import main as evaluate_main
from ernie_moe.finetune.adapter_files import read_adapter
from ernie_moe.generate import keyed_prompts
from ernie_moe.generation import prompt_encoder
from ernie_moe.generation.model_folder import folder_run_config, load_model_folder
from ernie_moe.model.ernie_vl import ErnieMoEForConditionalGeneration
from ernie_moe.training import Trainer

CASES = [0, 1, 2, 6]  # text only, one image, three images, an image and a video


def conversation_encoder(model_cfg, folder) -> Encoder:
    cfg = ernie_config(folder, *(f"data.{k}={v}" for k, v in BUDGET.items()))
    return Encoder(build_tokenizer(cfg), model_cfg, 4096, "skip", 448, Counter(), cfg.data.pixel_budget,
                   cfg.data.video_budget)


def our_logits(model_dir, folder) -> dict[int, np.ndarray]:
    loaded = load_model_folder(model_dir, need_tokenizer=False)
    encoder, data = conversation_encoder(loaded.cfg, folder), JsonlDataset(str(folder / "data.jsonl"))
    return {n: vl_logits(loaded.model, encoder(data[n])) for n in CASES}


@pytest.mark.slow
def test_a_fine_tuned_vl_model_keeps_its_source_keys_and_gives_paddleformers_logits(published, tmp_path):
    """Every key of the published config.json survives fine-tuning (those this package does not own with their
    values), and PaddleFormers' from_pretrained + forward on the final model gives our logits."""
    folder, published = published
    final = fine_tune(published, folder, tmp_path / "run")
    source = json.loads((published / "config.json").read_text())
    written = json.loads((final / "config.json").read_text())
    assert sorted(set(source) - set(written)) == []
    for key in ("moe_multimodal_dispatch_use_allgather", "fuse_rms_norm", "bos_token_id", "eos_token_id",
                "pad_token_id", "moe_capacity", "paddleformers_version"):
        assert written[key] == source[key], key
    paddleformers("vl_logits", final, tmp_path, *(folder / "out" / f"{n}.npz" for n in CASES), cwd=tmp_path)
    ours, base = our_logits(final, folder), our_logits(published, folder)
    for n in CASES:
        assert np.abs(ours[n] - base[n]).max() > 1e-3  # fine-tuning changed the model
        np.testing.assert_allclose(ours[n], np.load(tmp_path / f"{n}.npy"), rtol=0, atol=1e-4, err_msg=f"case {n}")


@pytest.mark.slow
def test_paddleformers_lora_model_reads_every_pair_of_a_vl_adapter(published, tmp_path):
    """LoRAModel.from_pretrained holds exactly the adapter's tensors (a fused layer's pair as one per piece, as its
    VL model has them), with our values, and its logits equal ours on text, images and video."""
    folder, published = published
    adapter = fine_tune(published, folder, tmp_path / "run", "training.fine_tuning=lora")
    paddleformers("vl_lora", published, adapter, tmp_path, *(folder / "out" / f"{n}.npz" for n in CASES),
                  cwd=tmp_path)
    theirs = dict(np.load(tmp_path / "lora_state.npz"))
    _, written = read_adapter(adapter)
    assert set(theirs) == set(written)
    assert any(".self_attn.q_proj." in k for k in theirs) and any(".experts.5.up_proj." in k for k in theirs)
    for name, value in written.items():
        np.testing.assert_array_equal(theirs[name], value, err_msg=name)
    ours, base = our_logits(adapter, folder), our_logits(published, folder)
    for n in CASES:
        assert np.abs(ours[n] - base[n]).max() > 1e-3  # the adapter changes the model
        np.testing.assert_allclose(ours[n], np.load(tmp_path / f"{n}.npy"), rtol=0, atol=1e-4, err_msg=f"case {n}")


@pytest.mark.slow
def test_paddleformers_lora_model_reads_the_pairs_of_an_mtp_depth(ernie_side, tmp_path):
    """A LoRA run over a VL checkpoint PaddleFormers made with an MTP depth, the depth adapted too (``mtp``):
    LoRAModel.from_pretrained holds exactly the adapter's tensors, the depth's among them, and through it the
    depth's logits equal ours on text, an image, and an image with a video."""
    folder, _ = ernie_side
    cases = [0, 1, 6]
    placeholder = build_tokenizer(ernie_config(folder)).placeholder_id()
    made = dict(VL_MODEL, im_patch_id=placeholder, num_nextn_predict_layers=1, moe_layer_start_index=2)
    paddleformers("make", "vl", tmp_path / "model", json.dumps(made), cwd=tmp_path)
    base = tmp_path / "model" / "hf"
    adapter = fine_tune(base, folder, tmp_path / "run", "training.fine_tuning=lora",
                        "training.lora_targets=[attention,mlp,shared_experts,text_experts,vision_experts,mtp]")
    paddleformers("vl_mtp_lora", base, adapter, tmp_path, *(folder / "out" / f"{n}.npz" for n in cases),
                  cwd=tmp_path)
    theirs = dict(np.load(tmp_path / "lora_state.npz"))
    _, written = read_adapter(adapter)
    assert set(theirs) == set(written)
    assert {k.rsplit(".", 1)[0] for k in theirs if k.startswith("model.mtp_")} == {
        "model.mtp_linear_proj.0", *(f"model.mtp_block.0.{m}" for m in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj"))}
    for name, value in written.items():
        np.testing.assert_array_equal(theirs[name], value, err_msg=name)
    model, base_model = (load_model_folder(path, need_tokenizer=False).model for path in (adapter, base))
    model.train(), base_model.train()  # the depths run in training
    encoder, data = conversation_encoder(model.cfg, folder), JsonlDataset(str(folder / "data.jsonl"))
    for n in cases:
        batch = one_row_batch(encoder(data[n]), labelled=True)
        ours, before = mtp_logits(model, batch)[1], mtp_logits(base_model, batch)[1]
        length = batch.input_ids.shape[1] - 1
        assert np.abs(ours - before).max() > 1e-3  # the adapter changes the depth
        np.testing.assert_allclose(ours[:length], np.load(tmp_path / f"{n}_mtp.npy")[0], rtol=0, atol=1e-4,
                                   err_msg=f"conversation {n}")


# under, at and over a small pixel budget; tall, wide, 2000+ px, below the minimum
IMAGE_SIZES = [(70, 100), (224, 224), (1500, 300), (300, 1600), (2100, 2000), (30, 40)]
SMALL_BUDGET = ["data.image_min_pixels=3136", "data.image_max_pixels=50176", "data.video_min_pixels=3136",
                "data.video_max_pixels=12544"]


@pytest.fixture(scope="module")
def run_on_images(tmp_path_factory):
    """A two-step run on conversations about images of many sizes, with a pixel budget, a sequence length and a
    longest side that are not the defaults; its config and its final model."""
    root = tmp_path_factory.mktemp("images")
    make_ernie_tokenizer(root / "tokenizer")
    rng = np.random.default_rng(0)
    lines = []
    for i, (height, width) in enumerate(IMAGE_SIZES):
        Image.fromarray((rng.random((height, width, 3)) * 255).astype(np.uint8)).save(root / f"{i}.png")
        lines.append({"images": [f"{i}.png"], "messages": [{"role": "user", "content": "<image>what is this?"},
                                                           {"role": "assistant", "content": "a red square"}]})
    (root / "data.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    cfg = ernie_config(root, f"training.output_dir={root / 'run'}", "data.dataset=jsonl",
                       f"data.train_path={root / 'data.jsonl'}", f"data.eval_path={root / 'data.jsonl'}",
                       "data.max_seq_len=320", "data.max_image_side=112", *SMALL_BUDGET, "training.max_steps=2",
                       "training.eval_steps=0", "logging.visualdl=false", "logging.progress_bar=false",
                       "model.max_position_embeddings=1024")
    summary = Trainer(cfg).train()
    return root, cfg, summary


def test_generate_encodes_a_prompt_as_the_training_did(run_on_images):
    """For every image size, the prompt generate builds from the final model's folder alone equals the training
    encoder's for the same conversation: ids, types, 3D positions, grids and patches."""
    root, cfg, _ = run_on_images
    final = root / "run" / "final_model"
    settings = folder_run_config(final).data
    assert settings.pixel_budget == cfg.data.pixel_budget and settings.max_seq_len == 320
    loaded = load_model_folder(final)
    chat = root / "prompts.jsonl"
    chat.write_text("".join(json.dumps({"images": [f"{i}.png"], "messages": [
        {"role": "user", "content": "<image>what is this?"}]}) + "\n" for i in range(len(IMAGE_SIZES))))
    samples = [s for _, s in keyed_prompts(Namespace(messages=str(chat), image=[], prompt=None), settings)]
    ours = prompt_encoder(loaded.tokenizer, loaded.cfg, settings)
    training = Encoder(loaded.tokenizer, cfg.model, 1024, "skip", cfg.data.max_image_side, Counter(),
                       cfg.data.pixel_budget, cfg.data.video_budget)
    default = folder_run_config(root).data  # a folder without the file: the package's defaults
    assert default.pixel_budget == (3136, 200704) and default.max_image_side == 0
    grids = []
    for n, sample in enumerate(samples):
        got, want = ours.prompt(sample), training.prompt(sample)
        for field in ("input_ids", "token_type_ids", "position_ids"):
            np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=f"{field} {n}")
        np.testing.assert_array_equal(np.stack(got.grids), np.stack(want.grids), err_msg=f"image {n}")
        np.testing.assert_array_equal(np.concatenate(got.patches), np.concatenate(want.patches))
        grids.append(int(np.prod(got.grids[0])))
        assert 4 <= grids[-1] <= 50176 // 196 + 4  # inside the budget, in patches
    assert len(set(grids)) > 3


def test_evaluate_on_the_folder_alone_gives_the_trainers_final_figures(run_on_images, tmp_path, capsys):
    root, _, summary = run_on_images
    out = tmp_path / "scores.json"
    assert evaluate_main(["--model", str(root / "run" / "final_model"), "--data", str(root / "data.jsonl"),
                          "--out", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert "skipped/overlong_skipped" not in figures
    for key in ("eval_loss", "eval_token_accuracy"):
        assert figures[key] == pytest.approx(summary[key], rel=1e-6, abs=1e-7), key
    # --data takes what data.train_path takes: the same records as a folder of shards, or a glob of them
    records = [json.loads(line) for line in (root / "data.jsonl").read_text().splitlines()]
    for record in records:  # images named from the shards' folder
        record["images"] = [str(root / name) for name in record["images"]]
    lines = [json.dumps(record) + "\n" for record in records]
    shards = root / "shards"
    shards.mkdir(exist_ok=True)
    for i, part in enumerate((lines[:len(lines) // 2], lines[len(lines) // 2:])):
        (shards / f"part-{i}.jsonl").write_text("".join(part))
    for data in (shards, shards / "part-*.jsonl"):
        assert evaluate_main(["--model", str(root / "run" / "final_model"), "--data", str(data), "--out",
                              str(out)]) == 0
        assert json.loads(out.read_text()) == figures, data


def test_processor_settings_of_other_libraries_and_bad_files(tmp_path):
    """PaddleFormers' and transformers' processor files give their pixel budget; a file that is not an object, holds
    a value of the wrong kind or is far too large is a config error naming it."""
    from ernie_moe.config import ConfigError
    from ernie_moe.data.encoding.processor_config import FILE, folder_settings

    file = tmp_path / FILE
    file.write_text(json.dumps({"min_pixels": 3136, "max_pixels": 1003520, "patch_size": 14}))
    assert folder_run_config(tmp_path).data.pixel_budget == (3136, 1003520)
    file.write_text(json.dumps({"size": {"shortest_edge": 3136, "longest_edge": 4816896}}))
    assert folder_run_config(tmp_path).data.pixel_budget == (3136, 4816896)
    for text, message in (("[1]", "holds a JSON list"), ("{", "cannot read"),
                          (json.dumps({"max_pixels": "many"}), "image_max_pixels = 'many' has the wrong type"),
                          (json.dumps({"ernie_moe": {"data": {"max_seq_len": 1.5}}}), "max_seq_len"),
                          (json.dumps({"ernie_moe": []}), "must be an object"), (" " * (2 << 20), "bytes")):
        file.write_text(text)
        with pytest.raises(ConfigError, match=message) as caught:
            folder_settings(tmp_path)
        assert FILE in str(caught.value)


@pytest.mark.parametrize("change, message", [({"moe_k": 9}, "moe_k"), ({"rope_theta": 0}, "rope_theta"),
                                             ({"rms_norm_eps": -1}, "rms_norm_eps"),
                                             ({"im_patch_id": 10 ** 6}, "im_patch_id"),
                                             ({"num_hidden_layers": 10 ** 6}, "describes 1000000 decoder layers"),
                                             ({"vision_config": {"depth": 10 ** 6}}, "describes 1000000 ViT blocks")])
def test_generate_and_evaluate_check_a_folders_config_as_a_run_does(tmp_path, capsys, change, message):
    """A model folder whose config.json a run would refuse, or that describes more layers than its tensors hold,
    is refused by generate, evaluate and export (exit 2, the key named), before a model is built from it."""
    from ernie_moe.checkpoint import save_model
    from ernie_moe.export import main as export_main
    from ernie_moe.generate import main as generate_main

    cfg = load_config(ROOT / "configs" / "vl_moe.yaml", ["data.image_size=56"])
    save_model(ErnieMoEForConditionalGeneration(cfg.model), cfg.model, str(tmp_path / "model"), build_tokenizer(cfg),
               hf_layout=True)
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    if "vision_config" in change:
        change = {"vision_config": {**config["vision_config"], **change["vision_config"]}}
    (tmp_path / "model" / "config.json").write_text(json.dumps({**config, **change}))
    assert generate_main(["--model", str(tmp_path / "model"), "--prompt", "a"]) == 2
    assert message in capsys.readouterr().err
    assert evaluate_main(["--model", str(tmp_path / "model"), "--data", "synthetic"]) == 2
    assert message in capsys.readouterr().err
    assert export_main([str(tmp_path / "model"), str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_smoke_config_trains_evaluates_and_generates(published, tmp_path):
    """configs/finetune_ernie45_vl_smoke.yaml, as the README's fine-tuning section starts with it: the PaddleFormers
    model on the 12 conversations (held out too), through launch, then generate on what it wrote."""
    import subprocess
    import sys
    import time

    folder, base = published
    data = folder / "data.jsonl"
    started = time.time()
    done = run_launch([sys.executable, "-m", "paddle.distributed.launch", "--log_dir", str(tmp_path / "log"),
                       "run_trainer.py", "--config", "configs/finetune_ernie45_vl_smoke.yaml",
                       f"training.model_name_or_path={base}", f"data.train_path={data}", f"data.eval_path={data}",
                       f"data.tokenizer_path={folder / 'tokenizer'}", f"training.output_dir={tmp_path / 'run'}",
                       "logging.progress_bar=false"],
                      tmp_path / "log", cwd=ROOT, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "done" and summary["trained_steps"] == 8 and np.isfinite(summary["eval_loss"])
    print(f"smoke config: {time.time() - started:.0f} s from launch to final model")
    prompt = tmp_path / "prompt.jsonl"
    prompt.write_text(json.dumps({"id": "q", "messages": [{"role": "user", "content": "What is this?"}]}) + "\n")
    final = tmp_path / "run" / "final_model"
    answer = subprocess.run([sys.executable, "-m", "ernie_moe.generate", "--model", str(final), "--messages",
                             str(prompt), "--max-new-tokens", "4"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert answer.returncode == 0, answer.stderr[-2000:]
    assert json.loads(answer.stdout)["id"] == "q"
