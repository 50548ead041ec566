import json

import numpy as np
import paddle
import pytest
from conftest import ROOT

from ernie_moe.config import load_config
from ernie_moe.json_files import dumps
from ernie_moe.moe.layer import MoELayer
from ernie_moe.monitor.alerts import Alerts
from ernie_moe.monitor.expert_balance import heat_map, load_figures, summarize
from ernie_moe.monitor.metrics import MetricsLogger
from ernie_moe.nn.init import init_layer
from ernie_moe.parallel import SingleDevicePlan


def test_load_figures_against_numpy():
    routed, kept = np.array([10, 30, 0, 20]), np.array([10, 25, 0, 20])
    f = load_figures(routed, kept)
    share = routed / 60
    nz = share[share > 0]
    assert f["routed_tokens"] == 60
    assert f["max_mean_load"] == pytest.approx(30 / 15)
    assert f["load_cv"] == pytest.approx(routed.std() / 15)
    assert f["routing_entropy"] == pytest.approx(-(nz * np.log(nz)).sum() / np.log(4))
    assert f["dropped_frac"] == pytest.approx(5 / 60)
    assert f["idle_expert_frac"] == 0.25
    balanced = load_figures(np.array([5, 5, 5, 5]), np.array([5, 5, 5, 5]))
    assert balanced["max_mean_load"] == 1.0 and balanced["load_cv"] == 0.0
    assert balanced["routing_entropy"] == pytest.approx(1.0)


def test_counts_sum_to_tokens_times_k_minus_dropped():
    cfg = load_config(None, ["model.hidden_size=16", "model.moe_capacity=[1.0, 1.0, 1.0]"]).model
    paddle.seed(0)
    layer = init_layer(MoELayer(SingleDevicePlan(), cfg, [0, 1], layer_idx=3))
    types = paddle.to_tensor([[0] * 20 + [1] * 12 + [-1] * 4])
    for _ in range(3):
        layer(paddle.randn([1, 36, 16]), types)
    window = layer.stats.routed.numpy().copy(), layer.stats.kept.numpy().copy()
    scalars, histograms, images = summarize([layer])
    text, vision = scalars["moe/layer3_text/routed_tokens"], scalars["moe/layer3_vision/routed_tokens"]
    assert (text, vision) == (3 * 20 * 2, 3 * 12 * 2)
    kept_text = text * (1 - scalars["moe/layer3_text/dropped_frac"])
    assert kept_text == pytest.approx(window[1][:4].sum())
    np.testing.assert_array_equal(histograms["moe/layer3_text/tokens_per_expert"], window[0][:4])
    assert images["moe/load_heat_map_text"].shape == (16, 4 * 16, 3)
    assert layer.stats.routed.numpy().sum() == 0  # the window was reset


def test_heat_map_colours():
    image = heat_map([np.array([1.0, 1.0]), np.array([3.0, 0.0])], cell=1)
    assert image[0, 0].tolist() == [255, 255, 255]  # at the mean: white
    assert image[1, 0].tolist() == [255, 0, 0]  # 1.5x the mean and above 2x saturate to red
    assert image[1, 1].tolist() == [0, 0, 255]  # idle: blue


def test_imbalance_and_memory_alerts():
    cfg = load_config(None, ["logging.imbalance_warn_ratio=1.5", "logging.imbalance_warn_windows=2"]).logging
    alerts = Alerts(cfg, device_total_gb=10.0)
    tag = "moe/layer1_text/max_mean_load"
    assert alerts.check(1, {tag: 2.0}, 1.0) == []
    lines = alerts.check(2, {tag: 2.0}, 1.0)
    assert len(lines) == 1 and "layer1_text" in lines[0] and "2.00x" in lines[0]
    assert [alerts.check(step, {tag: 2.0}, 1.0) for step in range(3, 9)] == [[]] * 6  # said once while it lasts
    ended = alerts.check(9, {tag: 1.2}, 1.0)  # the streak ends: said once
    assert len(ended) == 1 and "layer1_text is balanced again" in ended[0] and "after 8 windows" in ended[0]
    assert alerts.check(10, {tag: 2.0}, 1.0) == []  # a new streak, not long enough yet
    assert alerts.check(11, {tag: 1.0}, 1.0) == []  # a short streak ending says nothing
    memory = alerts.check(12, {}, 9.5)
    assert len(memory) == 1 and "9.5 GB" in memory[0] and "90%" in memory[0]
    assert alerts.check(13, {}, 9.6) == [] and "below 90%" in alerts.check(14, {}, 5.0)[0]


def read_scalars(logdir, tag):
    from visualdl import LogReader

    (log,) = list(logdir.glob("vdlrecords.*.log"))
    return [(r.id, r.value) for r in LogReader(file_path=str(log)).get_data("scalar", tag)]


def test_router_forced_to_one_expert_shows_max_mean_equal_to_experts(tmp_path):
    """A correction bias that sends every text token to expert 0 (k=1): max/mean = 4 experts, 3 of 4 idle."""
    from ernie_moe.training import Trainer

    cfg = load_config(ROOT / "configs" / "vl_moe.yaml", [
        f"training.output_dir={tmp_path}", "training.max_steps=4", "logging.logging_steps=2", "model.moe_k=1",
        "model.moe_use_aux_free=true", "model.moe_aux_free_update_coef=0", "logging.progress_bar=false",
        "data.num_eval_samples=8", "data.image_size=56", "data.max_seq_len=48",
    ])
    trainer = Trainer(cfg)
    bias = np.zeros((2, 4), np.float32)
    bias[0, 0] = 100.0
    trainer.model.moe_layers()[0].moe_statics.e_score_correction_bias.set_value(bias)
    trainer.train()
    logdir = tmp_path / "visualdl"
    assert [v for _, v in read_scalars(logdir, "moe/layer1_text/max_mean_load")] == [4.0, 4.0]
    assert [v for _, v in read_scalars(logdir, "moe/layer1_text/idle_expert_frac")] == [0.75, 0.75]
    assert [v for _, v in read_scalars(logdir, "moe/layer1_text/routing_entropy")] == [0.0, 0.0]
    assert read_scalars(logdir, "moe/worst_max_mean_load")[-1][1] == 4.0
    assert read_scalars(logdir, "moe/layer1_text/bias_range")[-1][1] == pytest.approx(100.0)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    for key in ("memory/rank0/rss_gb", "memory/rank0/max_rss_gb", "memory/rank0/allocated_gb",
                "memory/rank0/max_allocated_gb", "memory/max_rank_max_allocated_gb",
                "model_tflops_per_card", "mfu", "grad_norm_expert", "grad_norm_non_expert",
                "router/layer1_vision/z_loss", "moe/layer1_vision/load_cv"):
        assert all(np.isfinite(r[key]) for r in train), key
    assert 0 < train[-1]["memory/rank0/max_rss_gb"] < 24
    # the allocator's peak of a step: parameters, gradients, AdamW moments and more, far below the process RSS
    assert 4 * 265280 * 4 / 2 ** 30 < train[-1]["memory/rank0/max_allocated_gb"] < train[-1]["memory/rank0/rss_gb"]
    from visualdl import LogReader

    (log,) = list(logdir.glob("vdlrecords.*.log"))
    reader = LogReader(file_path=str(log))
    assert "moe/layer1_text/tokens_per_expert" in reader.get_tags().get("histogram", [])
    assert "moe/load_heat_map_text" in reader.get_tags().get("image", [])


def test_monitor_off_keeps_the_essentials(tmp_path):
    from ernie_moe.training import Trainer

    cfg = load_config(ROOT / "configs" / "vl_moe.yaml", [
        f"training.output_dir={tmp_path}", "training.max_steps=2", "logging.logging_steps=2",
        "logging.monitor=false", "logging.progress_bar=false", "data.num_eval_samples=8",
    ])
    Trainer(cfg).train()
    (record, _) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {"loss", "lm_loss", "router_loss", "lr", "grad_norm", "tokens_per_sec"} <= set(record)
    assert not any(k.startswith(("memory/", "moe/", "router/")) for k in record)
    assert "mfu" not in record and "aux_loss" not in record


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory):
    """A short training run served by a real VisualDL server on a free local port."""
    import subprocess
    import sys
    import time
    import urllib.request

    from ernie_moe.training import Trainer

    out = tmp_path_factory.mktemp("dashboard")
    cfg = load_config(ROOT / "configs" / "vl_moe.yaml", [
        f"training.output_dir={out}", "training.max_steps=30", "logging.logging_steps=5", "training.eval_steps=15",
        "logging.progress_bar=false", "data.num_eval_samples=32",
    ])
    Trainer(cfg).train()
    port = free_port()
    # the `visualdl` command's own entry point, run by this interpreter (its script may not be on PATH)
    entry = "import sys; from visualdl.server.app import main; sys.argv[0] = 'visualdl'; sys.exit(main())"
    server = subprocess.Popen([sys.executable, "-c", entry, "--logdir", str(out / "visualdl"),
                               "--host", "127.0.0.1", "--port", str(port), "-L", "en"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"{base}/app/api/runs", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("the VisualDL server did not answer within 60 s")
        yield base, out
    finally:
        server.terminate()
        server.wait(timeout=30)


def get_json(url):
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as response:
        body = json.loads(response.read())
    assert body["status"] == 0, body
    return body["data"]


@pytest.mark.slow
def test_visualdl_server_serves_the_scalars_and_histograms(dashboard):
    from urllib.parse import quote

    base, out = dashboard
    (run,) = get_json(f"{base}/app/api/runs")
    tags = get_json(f"{base}/app/api/scalar/tags")["tags"][0]
    for tag in ("train/loss", "train/grad_norm", "moe/layer1_text/max_mean_load", "moe/worst_max_mean_load",
                "memory/rank0/max_rss_gb", "eval/eval_caption_accuracy", "train/mfu"):
        assert tag in tags, tag
    points = get_json(f"{base}/app/api/scalar/list?run={quote(run)}&tag=train/loss")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    expected = [(r["step"], r["loss"]) for r in records if "loss" in r]
    assert [p[1] for p in points] == [s for s, _ in expected]
    np.testing.assert_allclose([p[2] for p in points], [v for _, v in expected], rtol=1e-5)
    assert "moe/layer1_vision/tokens_per_expert" in get_json(f"{base}/app/api/histogram/tags")["tags"][0]
    histogram = get_json(f"{base}/app/api/histogram/list?run={quote(run)}&tag=moe/layer1_text/tokens_per_expert")
    assert len(histogram) == 6 and sum(bucket[2] for bucket in histogram[-1][2]) == 4  # 4 text experts per step


@pytest.mark.slow
def test_scalars_page_renders_in_a_real_browser(dashboard, tmp_path):
    import shutil
    import subprocess

    from PIL import Image

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("Chromium is not installed (apt-get install chromium); .ci/run installs it")
    base, _ = dashboard
    shot = tmp_path / "scalars.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1400,900",
                    "--virtual-time-budget=15000", f"--screenshot={shot}", f"{base}/app/scalar"],
                   capture_output=True, timeout=180, check=True)
    pixels = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    assert pixels.shape[:2] == (900, 1400)
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 100 and pixels.std() > 20  # not a blank page
    # VisualDL draws curves in #2932E1 across each chart's width; its "no data" page has that blue only in a
    # few links (85 columns measured), two rows of charts fill hundreds of columns
    curve = np.abs(pixels[150:, :1080] - np.array([41, 50, 225])).max(axis=-1) < 40
    assert curve.any(axis=0).sum() > 250


def test_flops_follow_the_6nd_formula(tiny_cfg):
    """6 FLOPs per activated weight per token (each modality's tokens through k of its own experts), plus the
    attention scores, the ViT per patch and the adapter per image token."""
    from types import SimpleNamespace

    from ernie_moe.model.ernie_vl import ErnieMoEForConditionalGeneration
    from ernie_moe.monitor.flops import FlopsCounter

    m = tiny_cfg.model
    model = ErnieMoEForConditionalGeneration(m)
    types = np.array([[0] * 30 + [1] * 9 + [-1] * 9])  # 30 text, 9 image tokens, 9 padding
    batch = SimpleNamespace(token_type_ids=paddle.to_tensor(types), input_ids=paddle.zeros([1, 48], "int64"),
                            pixel_patches=paddle.zeros([36, 588]))
    h, hd, q, kv = m.hidden_size, m.head_dim, m.num_attention_heads, m.num_key_value_heads
    attention = h * (q + 2 * kv) * hd + q * hd * h
    dense = 3 * h * m.intermediate_size
    shared = 3 * h * m.moe_intermediate_size[0] * m.moe_num_shared_experts
    routed = {0: m.moe_k * 3 * h * m.moe_intermediate_size[0] + h * m.moe_num_experts[0],
              1: m.moe_k * 3 * h * m.moe_intermediate_size[1] + h * m.moe_num_experts[1]}
    vit = sum(int(np.prod(p.shape)) for p in model.vision_model.parameters())
    adapter = sum(int(np.prod(p.shape)) for p in model.model.resampler_model.parameters())
    tokens = 39
    expected = 6 * tokens * (2 * attention + dense + shared) + 6 * (30 * routed[0] + 9 * routed[1])
    expected += 3 * 2 * 2 * 2 * (48 / 2) * q * hd * tokens + 6 * vit * 36 + 6 * adapter * 9
    assert FlopsCounter(model, m).batch_flops(batch) == pytest.approx(expected, rel=1e-9)


def test_metrics_and_summaries_are_strict_json_with_the_reason_beside_a_non_finite_value(tmp_path):
    logger = MetricsLogger(str(tmp_path), visualdl=False, enabled=True)
    logger.log(3, {"loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-3, "scale": -float("inf")})
    logger.close()
    line = (tmp_path / "metrics.jsonl").read_text().splitlines()[0]
    record = json.loads(line, parse_constant=lambda word: pytest.fail(f"{word} is not JSON"))
    assert record == {"step": 3, "loss": None, "loss_nonfinite": "nan", "grad_norm": None,
                      "grad_norm_nonfinite": "inf", "lr": 1e-3, "scale": None, "scale_nonfinite": "-inf"}
    assert json.loads(dumps({"eval": [1.0, float("nan")], "nested": {"x": float("nan")}})) == \
        {"eval": [1.0, None], "nested": {"x": None, "x_nonfinite": "nan"}}
