"""The fixtures test modules share; the helpers they share are in ``support/``."""

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from ernie_moe.parallel import cpu_fallbacks  # noqa: E402

cpu_fallbacks.use_avx2_math_on_amd()  # the trainer's math path, here and in every process a test launches

from support.ernie import (  # noqa: E402
    BUDGET,
    VL_MODEL,
    conversations,
    ernie_config,
    make_ernie_tokenizer,
    media,
    paddleformers,
    shown,
)
from support.lora import trainer  # noqa: E402
from support.runs import ROOT  # noqa: E402

from ernie_moe.checkpoint import save_model  # noqa: E402
from ernie_moe.data.feeding.loader import build_tokenizer  # noqa: E402


@pytest.fixture
def tiny_cfg():
    """The default config, shrunk for unit tests."""
    from ernie_moe.config import load_config

    return load_config(ROOT / "configs" / "vl_moe.yaml", [
        "data.image_size=56", "data.max_seq_len=48", "training.per_device_train_batch_size=2",
    ])


@pytest.fixture(scope="module")
def ernie_side(tmp_path_factory):
    """The tokenizer, the conversations as JSONL, and PaddleFormers' processor outputs for them."""
    folder = tmp_path_factory.mktemp("ernie_inputs")
    make_ernie_tokenizer(folder / "tokenizer")
    cases = conversations(folder)
    (folder / "data.jsonl").write_text("\n".join(json.dumps({"messages": m}) for m in cases) + "\n")
    reference = [{"messages": shown(m), "budget": BUDGET, "images": [str(folder / p) for p in media(m, "image")],
                  "videos": [[str(folder / f) for f in v] for v in media(m, "video")]} for m in cases]
    (folder / "cases.json").write_text(json.dumps(reference))
    (folder / "out").mkdir()
    paddleformers("process", folder / "tokenizer", folder / "cases.json", folder / "out", cwd=folder)
    return folder, cases


@pytest.fixture(scope="module")
def published(ernie_side, tmp_path_factory):
    """(The conversations' folder, a tiny ERNIE-4.5-VL saved by PaddleFormers with the published settings: capacity
    list, dispatch mode.)"""
    folder, _ = ernie_side
    root = tmp_path_factory.mktemp("published")
    placeholder = build_tokenizer(ernie_config(folder)).placeholder_id()
    paddleformers("make", "vl", root / "model", json.dumps(dict(VL_MODEL, im_patch_id=placeholder)), cwd=root)
    return folder, root / "model" / "hf"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The default model at its seed's weights, saved as a model folder with its tokenizer."""
    tmp = tmp_path_factory.mktemp("base")
    tr = trainer(tmp / "run")
    save_model(tr.parts.model, tr.cfg.model, str(tmp / "model"), tr.tokenizer, hf_layout=True)
    return tmp / "model"
