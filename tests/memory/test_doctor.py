"""The self-check users run on their machines: it passes here, and it fails when a computation is wrong."""

import subprocess
import sys

import paddle
import pytest
from support.runs import ROOT

import ernie_moe.doctor.kernels as kernels
from ernie_moe.doctor.__main__ import main
from ernie_moe.model.attention import core_attention
from ernie_moe.moe.expert_matmul import expert_loop
from ernie_moe.nn import quant
from ernie_moe.nn.flashmask import RowBounds
from ernie_moe.nn.layers import RMSNorm


def test_every_computation_matches_its_reference_here(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "14 of 14 checks passed" in out and "FAIL" not in out


@pytest.mark.parametrize("broken", ["attention", "rms_norm", "routed experts one by one, with gradients",
                                    "int4 base weight matmul"])
def test_a_broken_computation_fails_the_doctor(monkeypatch, capsys, broken):
    if broken == "int4 base weight matmul":  # the two four-bit halves of each byte read the wrong way round
        real = quant.unpack_int4
        monkeypatch.setattr(quant, "unpack_int4", lambda packed: real(packed).reshape([-1, 2, packed.shape[1]])
                            .flip(axis=[1]).reshape([-1, packed.shape[1]]))
    elif broken == "attention":  # causal, but the packed documents' bounds ignored
        monkeypatch.setattr(kernels, "core_attention", lambda q, k, v, bounds: core_attention(
            q, k, v, RowBounds(paddle.full_like(bounds.ends, q.shape[1])) if bounds and bounds.causal else bounds))
    elif broken == "rms_norm":  # an epsilon far too large
        monkeypatch.setattr(kernels, "RMSNorm", lambda dim, eps: RMSNorm(dim, eps * 1e5))
    else:  # each expert handed another expert's rows
        monkeypatch.setattr(kernels, "expert_loop",
                            lambda rows, counts, up, down: expert_loop(rows, counts[::-1], up, down))
    assert main([]) == 1
    failed = [line for line in capsys.readouterr().out.splitlines() if "FAIL" in line]
    assert len(failed) == 1 and failed[0].startswith(f"| {broken} |")


def test_the_doctor_checks_a_users_config_at_its_shapes_and_layout(capsys, tmp_path):
    args = ["--config", str(ROOT / "configs" / "ernie45_vl_28b_a3b.yaml"), "--world-size", "8"]
    assert main([*args, "--device-memory-gb", "80"]) == 0
    out = capsys.readouterr().out
    assert "19 of 19 checks passed" in out
    for row in ("| attention, 20 heads / 4 kv of 128 |", "| rms_norm, hidden 2560 |",
                "| routed experts, 2560 x 512 |", "| routed experts, 2560 x 1536 |",
                "| memory plan of the layout on 8 ranks (share of the device) | - | 8.58e-01 | 9e-01 | pass |"):
        assert row in out, row
    assert "busiest rank 68.61 GiB of 80 GB predicted" in out
    # the same layout on 40 GB devices does not fit: that row fails, and the run's exit code says so
    assert main([*args, "--device-memory-gb", "40"]) == 1
    failed = [line for line in capsys.readouterr().out.splitlines() if "FAIL" in line]
    assert len(failed) == 1 and failed[0].startswith("| memory plan of the layout")
    # a config that does not load: one line and exit code 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  hidden_size: 64\n  num_attention_heads: 3\n")
    assert main(["--config", str(bad)]) == 2
    assert "config error" in capsys.readouterr().err


@pytest.mark.slow
def test_the_layout_checks_pass_here(tmp_path):
    done = subprocess.run([sys.executable, "-m", "ernie_moe.doctor", "--layouts", "--workdir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for layout in ("data parallel x2", "tensor parallel x2", "expert parallel x2", "pipeline x2",
                   "sharding stage 2 x2", "sharding stage 3 x2", "sequence parallel x2, loss over chunks"):
        assert f"| {layout} | float32 |" in done.stdout
    assert "21 of 21 checks passed" in done.stdout
