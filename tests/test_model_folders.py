"""What a fine-tuning run writes, read where it goes next: PaddleFormers' model and LoRA classes."""

import json
from collections import Counter

import numpy as np
import pytest
from conftest import ROOT
from test_ernie_inputs import BUDGET, VL_MODEL, ernie_config, vl_logits
from test_ernie_inputs import ernie_side as conversations  # noqa: F401 (a fixture)
from test_pretrained import paddleformers

from ernie_moe.config import load_config
from ernie_moe.data.jsonl import JsonlDataset
from ernie_moe.data.loader import build_tokenizer
from ernie_moe.data.packing import Encoder
from ernie_moe.finetune.adapter_files import read_adapter
from ernie_moe.generation.model_folder import load_model_folder
from ernie_moe.training import Trainer

pytestmark = pytest.mark.slow  # starts PaddleFormers' processes

CASES = [0, 1, 2, 6]  # text only, one image, three images, an image and a video


@pytest.fixture(scope="module")
def published(conversations, tmp_path_factory):  # noqa: F811 (the fixture imported above)
    """(The conversations' folder, a tiny ERNIE-4.5-VL saved by PaddleFormers with the published settings: capacity
    list, dispatch mode.)"""
    folder, _ = conversations
    root = tmp_path_factory.mktemp("published")
    placeholder = build_tokenizer(ernie_config(folder)).placeholder_id()
    paddleformers("make", "vl", root / "model", json.dumps(dict(VL_MODEL, im_patch_id=placeholder)), cwd=root)
    return folder, root / "model" / "hf"


def fine_tune(base, folder, out, *overrides):
    """Two steps of the README's fine-tuning config on the conversations, from ``base``."""
    cfg = load_config(ROOT / "configs" / "finetune_ernie45_vl.yaml", [
        f"training.model_name_or_path={base}", f"training.output_dir={out}", f"data.train_path={folder / 'data.jsonl'}",
        f"data.tokenizer_path={folder / 'tokenizer'}", *(f"data.{k}={v}" for k, v in BUDGET.items()),
        "data.max_seq_len=1024", "training.max_steps=2", "training.gradient_accumulation_steps=1",
        "training.eval_steps=0", "training.save_steps=0", "training.warmup_steps=0", "training.learning_rate=1e-2",
        "logging.progress_bar=false", "logging.visualdl=false", *overrides])
    Trainer(cfg).train()
    return out / "final_model"


def our_logits(model_dir, folder) -> dict[int, np.ndarray]:
    loaded = load_model_folder(model_dir, need_tokenizer=False)
    cfg = ernie_config(folder, *(f"data.{k}={v}" for k, v in BUDGET.items()))
    encoder = Encoder(build_tokenizer(cfg), loaded.cfg, 4096, "skip", 448, Counter(), cfg.data.pixel_budget,
                      cfg.data.video_budget)
    data = JsonlDataset(str(folder / "data.jsonl"))
    return {n: vl_logits(loaded.model, encoder(data[n])) for n in CASES}


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
