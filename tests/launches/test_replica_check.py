"""The replica check (training.replica_check): digests against NumPy, a weight moved on one rank of two found and
named, the run stopped or warned. That no layout raises a false alarm is in test_layouts.py (every step of each)."""

import json

import numpy as np
import paddle
import pytest
from support.runs import records, train

from ernie_moe.parallel import replicas
from ernie_moe.parallel.replicas import digest

PERTURBED = "model.embed_tokens.weight"  # the first replicated parameter, which the fault moves


def numpy_digest(bits: np.ndarray) -> list[int]:
    """The digest of a tensor given as the integers of its bits."""
    bits = bits.reshape(-1).astype(np.int64)
    weight = np.arange(bits.size, dtype=np.int64) * np.int64(2654435761) + 1  # wraps like int64 does
    return [int(bits.sum()), int((bits * weight).sum())]


@pytest.mark.parametrize("dtype, bits", [("float32", "int32"), ("bfloat16", "int16")])
def test_the_digest_is_numpys_in_chunks_and_sees_one_bit(monkeypatch, dtype, bits):
    x = paddle.randn([37, 11]).astype(dtype)
    whole = digest(x).numpy().tolist()
    assert whole == numpy_digest(x.view(bits).numpy())
    monkeypatch.setattr(replicas, "_CHUNK", 50)  # chunk edges inside the tensor change nothing
    assert digest(x).numpy().tolist() == whole
    flipped = x.view(bits).numpy().copy()
    flipped.reshape(-1)[200] ^= 1  # the lowest bit of one element
    assert digest(paddle.to_tensor(flipped).view(dtype)).numpy().tolist() != whole


@pytest.mark.slow
def test_a_weight_moved_on_one_rank_stops_the_run_naming_it(tmp_path):
    out = tmp_path / "run"
    result = train(out, "training.max_steps=5", "training.replica_check_steps=1", fault="perturb_weight@2@1",
                   nproc=2, check=False)
    assert result.returncode == 3, result.stdout[-3000:] + result.stderr[-3000:]
    line = next(s for s in result.stdout.splitlines() if s.startswith("training stopped"))  # the worker log
    assert f"differ after step 2: {PERTURBED} on rank 1 differs from rank 0 by up to 0.001" in line
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps"] == 2
    checks = [r for r in records(out) if "replicas/max_abs_diff" in r]
    assert [(r["step"], r["replicas/differing_copies"]) for r in checks] == [(0, 0), (1, 0), (2, 1)]
    assert checks[-1]["replicas/max_abs_diff"] == pytest.approx(1e-3, rel=1e-3)
    assert not (out / "final_model").exists()


@pytest.mark.slow
def test_a_run_set_to_warn_goes_on_and_logs_the_difference(tmp_path):
    out = tmp_path / "run"
    result = train(out, "training.max_steps=4", "training.replica_check_steps=2", "training.replica_check=warn",
                   fault="perturb_weight@1@1", nproc=2)
    assert f"WARNING replicas that should hold the same weights differ after step 2: {PERTURBED} on rank 1" \
        in result.stdout
    checks = {r["step"]: r["replicas/max_abs_diff"] for r in records(out) if "replicas/max_abs_diff" in r}
    assert set(checks) == {0, 2, 4} and checks[0] == 0
    assert checks[2] == pytest.approx(1e-3, rel=1e-2) and checks[4] == pytest.approx(1e-3, rel=1e-2)
    assert (out / "final_model").is_dir()
