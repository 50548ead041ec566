"""Hugging Face transformers' ERNIE-4.5-VL (torch, on the CPU, in its own process) reading the folders this package
writes, and this package reading, training and writing back the folders transformers saves."""

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file
from support.ernie import BUDGET, HF_SIDE, ernie_config, other_side, vl_logits
from support.runs import CONFIG, SMALL, fine_tune

import run_trainer
from ernie_moe.checkpoint import save_model
from ernie_moe.config import load_config
from ernie_moe.data.encoding.images import target_size
from ernie_moe.data.encoding.packing import Encoder
from ernie_moe.data.feeding.loader import build_tokenizer
from ernie_moe.data.formats.jsonl import JsonlDataset
from ernie_moe.export import main as export_main
from ernie_moe.finetune.adapter_files import adapter_base
from ernie_moe.generation.model_folder import load_model_folder

pytestmark = pytest.mark.slow  # starts transformers' processes

CASES = [0, 1, 9, 5, 6]  # text only, one image, two images, a video, an image and a video


def transformers(*args, cwd):
    """Run transformers' side in its own process."""
    other_side(HF_SIDE, *args, cwd=cwd, timeout=600)


@pytest.fixture(scope="module")
def made(ernie_side, tmp_path_factory):
    """(The conversations' folder, a tiny random ERNIE-4.5-VL saved by transformers for its tokenizer.)"""
    folder, _ = ernie_side
    tokenizer = build_tokenizer(ernie_config(folder))
    ids = {f"{kind}_{end}_token_id": tokenizer.token_id(f"<|{kind.upper()}_{end.upper()}|>")
           for kind in ("image", "video") for end in ("start", "end")}
    config = {"text_config": {"vocab_size": 400, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                              "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "moe_num_experts": 4,
                              "moe_intermediate_size": [32, 16], "moe_k": 2, "moe_num_shared_experts": 1,
                              "mlp_layer_types": ["dense", "sparse", "sparse"],
                              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                  "mrope_section": [2, 2, 4]},
                              "bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id,
                              "pad_token_id": tokenizer.pad_id},
              "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                                "patch_size": 14, "spatial_merge_size": 2},
              "image_token_id": tokenizer.placeholder_id(),
              "video_token_id": tokenizer.token_id("<|VIDEO_PLACEHOLDER|>"), **ids}
    root = tmp_path_factory.mktemp("transformers")
    transformers("make", root / "hf", json.dumps(config), cwd=root)
    return folder, root / "hf"


def inputs_for_transformers(sample, model_cfg, video_token_id: int) -> dict:
    """Our encoded conversation as transformers' model takes it: position ids [3, 1, seq], video placeholders under
    their own id, the image and the video patches apart."""
    ids, types = sample.input_ids.copy(), sample.token_type_ids
    placeholder = ids == model_cfg.im_patch_id
    # each run of placeholders is one image or video, in the order of the patches and grids
    starts = np.nonzero(placeholder & ~np.concatenate([[False], placeholder[:-1]]))[0]
    is_video = [types[s] == 2 for s in starts]
    ids[placeholder & (types == 2)] = video_token_id
    out = {"input_ids": ids[None], "position_ids": np.ascontiguousarray(sample.position_ids.T[:, None, :]),
           "moe_mm_token_type_ids": types[None]}
    for video, pixels, grid in ((False, "pixel_values", "image_grid_thw"), (True, "pixel_values_videos",
                                                                            "video_grid_thw")):
        chosen = [k for k, v in enumerate(is_video) if v == video]
        out[pixels] = (np.concatenate([sample.patches[k] for k in chosen]) if chosen
                       else np.zeros([0, 588], np.float32))
        out[grid] = np.stack([sample.grids[k] for k in chosen]) if chosen else np.zeros([0, 3], np.int64)
    return out


def compare_on_conversations(model_dir, folder, tmp_path, peft=None) -> tuple[dict, dict, dict]:
    """(Our logits, transformers') on the cases, each read from ``model_dir`` (with ``peft``: ours from the
    adapter ``model_dir``, transformers' from its base with the PEFT adapter ``peft``); and what transformers
    reported."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    loaded = load_model_folder(model_dir, need_tokenizer=False)
    cfg = ernie_config(folder, *(f"data.{k}={v}" for k, v in BUDGET.items()))
    encoder = Encoder(build_tokenizer(cfg), loaded.cfg, 4096, "skip", 448, Counter(), cfg.data.pixel_budget,
                      cfg.data.video_budget)
    base = Path(adapter_base(model_dir)) if peft else Path(model_dir)
    video_id = json.loads((base / "config.json").read_text()).get("video_token_id")
    data = JsonlDataset(str(folder / "data.jsonl"))
    ours = {}
    for n in CASES:
        sample = encoder(data[n])
        ours[n] = vl_logits(loaded.model, sample, bfloat16_pixels=False)
        np.savez(tmp_path / f"{n}.npz", **inputs_for_transformers(sample, loaded.cfg, video_id))
    cases = [tmp_path / f"{n}.npz" for n in CASES]
    if peft:
        transformers("peft", base, peft, tmp_path, *cases, cwd=tmp_path)
    else:
        transformers("logits", model_dir, tmp_path, *cases, cwd=tmp_path)
    theirs = {n: np.load(tmp_path / f"{n}.npy") for n in CASES}
    return ours, theirs, json.loads((tmp_path / "loading.json").read_text())


def tensors(folder) -> dict[str, np.ndarray]:
    out = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def test_a_folder_transformers_saves_gives_its_outputs_here_and_goes_back_bit_for_bit(made, tmp_path):
    """transformers' folder read here gives its logits on text, images and video; written back in transformers'
    form it holds every tensor bit for bit, and transformers loads it with nothing missing or unexpected."""
    folder, hf = made
    ours, theirs, _ = compare_on_conversations(hf, folder, tmp_path / "a")
    for n in CASES:
        np.testing.assert_allclose(ours[n], theirs[n], rtol=0, atol=1e-4, err_msg=f"case {n}")
    loaded = load_model_folder(hf, need_tokenizer=False)
    back = tmp_path / "back"
    save_model(loaded.model, loaded.cfg, str(back), build_tokenizer(ernie_config(folder)), hf_layout=True,
               form="transformers")
    original, written = tensors(hf), tensors(back)
    assert sorted(original) == sorted(written)
    for name, value in original.items():
        assert value.dtype == written[name].dtype and np.array_equal(value, written[name]), name
    _, again, report = compare_on_conversations(back, folder, tmp_path / "b")
    assert report["missing_keys"] == [] and report["unexpected_keys"] == []
    for n in CASES:
        np.testing.assert_array_equal(again[n], theirs[n], err_msg=f"case {n}")


def test_a_model_without_a_correction_bias_is_written_with_zeros_for_it(made, tmp_path):
    """A model trained without the aux-loss-free bias (``moe_use_aux_free: false``), written in transformers' form,
    and exported to it from PaddleFormers' form by ``python -m ernie_moe.export --format transformers``: zeros stand
    in for the bias transformers' model always holds, so it loads either folder with nothing missing (nothing newly
    initialised), and gives this model's logits."""
    import dataclasses

    from ernie_moe.model.ernie_vl import ErnieMoEForConditionalGeneration

    folder, hf = made
    loaded = load_model_folder(hf, need_tokenizer=False)
    cfg = dataclasses.replace(loaded.cfg, moe_use_aux_free=False)
    model = ErnieMoEForConditionalGeneration(cfg)
    model.eval()
    weights = dict(loaded.model.stable_named_parameters())
    for name, param in model.stable_named_parameters():
        param.set_value(weights[name])
    assert not any("correction_bias" in name for name, _ in model.stable_named_parameters())
    out = tmp_path / "no_bias"
    save_model(model, cfg, str(out), build_tokenizer(ernie_config(folder)), hf_layout=True, form="transformers")
    biases = {n: v for n, v in tensors(out).items() if n.endswith("e_score_correction_bias")}
    assert biases and all(v.shape == (2, 4) and not v.any() for v in biases.values())
    ours, theirs, report = compare_on_conversations(out, folder, tmp_path / "cmp")
    assert report["missing_keys"] == [] and report["unexpected_keys"] == []
    encoder = Encoder(build_tokenizer(ernie_config(folder)), cfg, 4096, "skip", 448, Counter(),
                      ernie_config(folder, *(f"data.{k}={v}" for k, v in BUDGET.items())).data.pixel_budget)
    data = JsonlDataset(str(folder / "data.jsonl"))
    for n in CASES:
        np.testing.assert_allclose(ours[n], vl_logits(model, encoder(data[n]), bfloat16_pixels=False), atol=1e-5)
        np.testing.assert_allclose(ours[n], theirs[n], rtol=0, atol=1e-4, err_msg=f"case {n}")
    # the same model written in PaddleFormers' form holds the zeros too (the serving engines need them) ...
    save_model(model, cfg, str(tmp_path / "paddleformers"), build_tokenizer(ernie_config(folder)), hf_layout=True)
    written = {n: v for n, v in tensors(tmp_path / "paddleformers").items() if n.endswith("e_score_correction_bias")}
    assert written.keys() == biases.keys() and not any(v.any() for v in written.values())
    # ... and a folder without them (as PaddleFormers writes such a model), exported for transformers, gets them
    index_file = tmp_path / "paddleformers" / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if "correction_bias" not in k}
    index_file.write_text(json.dumps(index))
    assert export_main([str(tmp_path / "paddleformers"), str(tmp_path / "exported"), "--format", "transformers"]) == 0
    exported = {n: v for n, v in tensors(tmp_path / "exported").items() if n.endswith("e_score_correction_bias")}
    assert exported.keys() == biases.keys() and all(v.shape == (2, 4) and not v.any() for v in exported.values())
    again, theirs_again, report = compare_on_conversations(tmp_path / "exported", folder, tmp_path / "cmp_export")
    assert report["missing_keys"] == [] and report["unexpected_keys"] == []
    for n in CASES:
        np.testing.assert_allclose(again[n], theirs_again[n], rtol=0, atol=1e-4, err_msg=f"exported, case {n}")


def test_a_default_run_exported_for_transformers_loads_whole_and_cuts_trainings_image_grids(tmp_path):
    """The default config's model, exported with ``--format transformers``: transformers loads every tensor (the
    correction biases it expects written as zeros), its image processor cuts the grid training cut from a
    photo of each size, and the video placeholder it is told lies inside the vocabulary."""
    run, exported, sizes = tmp_path / "run", tmp_path / "exported", ("300x200", "640x480", "1920x1080")
    overrides = [*SMALL, "training.max_steps=2", "training.eval_steps=0", f"training.output_dir={run}"]
    assert run_trainer.main(["--config", CONFIG, *overrides]) == 0
    assert export_main([str(run / "final_model"), str(exported), "--format", "transformers"]) == 0
    transformers("grids", exported, tmp_path, *sizes, cwd=tmp_path)
    found = json.loads((tmp_path / "grids.json").read_text())
    assert found["missing_keys"] == [] and found["unexpected_keys"] == [] and found["mismatched_keys"] == []
    cfg = load_config(CONFIG, overrides)
    data, vision = cfg.data, cfg.model.vision_config
    unit = vision.patch_size * vision.spatial_merge_size
    for size in sizes:
        width, height = map(int, size.split("x"))
        rows, cols = target_size(height, width, unit, data.max_image_side, data.pixel_budget)
        assert found["grids"][size] == [1, rows // vision.patch_size, cols // vision.patch_size], size
    assert found["grids"]["640x480"] == [1, 26, 36]  # 364 x 504 pixels: the most 28-pixel blocks within 448 x 448
    assert 0 <= found["video_token_id"] < found["vocab_size"]
    assert found["image_token_id"] == cfg.model.im_patch_id
    refused = tmp_path / "refused"
    side = run_trainer.main(["--config", CONFIG, *overrides[:-1], f"training.output_dir={refused}",
                             "data.max_image_side=448"])
    assert side == 0
    assert export_main([str(refused / "final_model"), str(tmp_path / "no"), "--format", "transformers"]) == 2
    assert not (tmp_path / "no").exists()
    assert export_main([str(refused / "final_model"), str(tmp_path / "anyway"), "--format", "transformers",
                        "--any-image-rule"]) == 0


def test_a_run_from_a_transformers_folder_ends_in_a_folder_transformers_reads(made, tmp_path):
    """Two fine-tuning steps from transformers' folder, final_model in its form: transformers loads it whole, with
    the run's pixel budget in its image processor, and gives our logits; the exporter writes the same tensors
    from the run's checkpoint."""
    folder, hf = made
    final = fine_tune(hf, folder, tmp_path / "run", "training.final_model_format=transformers")
    assert json.loads((final / "config.json").read_text())["model_type"] == "ernie4_5_vl_moe"
    ours, theirs, report = compare_on_conversations(final, folder, tmp_path / "cmp")
    assert report["missing_keys"] == [] and report["unexpected_keys"] == []
    assert report["image_processor_size"] == {"shortest_edge": BUDGET["image_min_pixels"],
                                              "longest_edge": BUDGET["image_max_pixels"]}
    base, _, _ = compare_on_conversations(hf, folder, tmp_path / "base")
    for n in CASES:
        assert np.abs(ours[n] - base[n]).max() > 1e-3  # the run changed the model
        np.testing.assert_allclose(ours[n], theirs[n], rtol=0, atol=1e-4, err_msg=f"case {n}")
    exported = tmp_path / "exported"
    assert export_main([str(tmp_path / "run" / "checkpoint-2"), str(exported), "--format", "transformers"]) == 0
    assert json.loads((exported / "config.json").read_text()) == json.loads((final / "config.json").read_text())
    final_tensors, exported_tensors = tensors(final), tensors(exported)
    assert sorted(final_tensors) == sorted(exported_tensors)
    for name, value in final_tensors.items():
        assert np.array_equal(value, exported_tensors[name]), name


def test_a_lora_adapter_in_pefts_form_gives_our_logits_over_transformers_base(made, tmp_path, capsys):
    """A LoRA run on attention, dense MLP, shared experts, ViT and adapter from transformers' folder: the adapter in
    PEFT's form loads over that folder with every tensor where PEFT holds it, and gives our logits, as does the
    adapter merged into a transformers folder; an adapter on routed experts, which transformers stacks, is refused
    with the way out."""
    folder, hf = made
    adapter = fine_tune(hf, folder, tmp_path / "run", "training.fine_tuning=lora", "training.freeze=[]",
                        "training.lora_targets=[attention,mlp,shared_experts,vit,adapter]")
    peft = tmp_path / "peft"
    assert export_main([str(adapter), str(peft), "--adapter", "--format", "transformers"]) == 0
    ours, theirs, _ = compare_on_conversations(adapter, folder, tmp_path / "cmp", peft=peft)
    held = dict(np.load(tmp_path / "cmp" / "peft_state.npz"))
    written = load_file(str(peft / "adapter_model.safetensors"))
    assert sorted(held) == sorted(written)
    assert any(".self_attn.v_proj.lora_B" in k for k in held) and any("vision_tower.blocks.1" in k for k in held)
    for name, value in written.items():
        np.testing.assert_array_equal(held[name], value, err_msg=name)
    base, _, _ = compare_on_conversations(hf, folder, tmp_path / "base")
    for n in CASES:
        assert np.abs(ours[n] - base[n]).max() > 1e-3  # the adapter changes the model
        np.testing.assert_allclose(ours[n], theirs[n], rtol=0, atol=1e-4, err_msg=f"case {n}")
    merged = tmp_path / "merged"
    assert export_main([str(adapter), str(merged), "--merge-lora", "--format", "transformers"]) == 0
    _, merged_theirs, report = compare_on_conversations(merged, folder, tmp_path / "merged_cmp")
    assert report["missing_keys"] == [] and report["unexpected_keys"] == []
    for n in CASES:
        np.testing.assert_allclose(merged_theirs[n], ours[n], rtol=0, atol=1e-4, err_msg=f"merged, case {n}")
    experts = fine_tune(hf, folder, tmp_path / "experts", "training.fine_tuning=lora", "training.max_steps=1",
                        "training.lora_targets=[text_experts]")
    assert export_main([str(experts), str(tmp_path / "no"), "--adapter", "--format", "transformers"]) == 2
    assert "merge the adapter instead" in capsys.readouterr().err
