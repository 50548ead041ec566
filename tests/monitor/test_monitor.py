import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import paddle
import pytest
from support.runs import ROOT, launch

from ernie_moe.config import load_config
from ernie_moe.json_files import dumps
from ernie_moe.moe.layer import MoELayer
from ernie_moe.monitor.alerts import Alerts
from ernie_moe.monitor.charts import LABEL_W, TITLE_H, bar_chart, heat_map, load_colours
from ernie_moe.monitor.expert_balance import load_figures, summarize
from ernie_moe.monitor.metrics import MetricsLogger, config_line
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
    scalars, images = summarize([layer])
    text, vision = scalars["moe/layer3_text/routed_tokens"], scalars["moe/layer3_vision/routed_tokens"]
    assert (text, vision) == (3 * 20 * 2, 3 * 12 * 2)
    kept_text = text * (1 - scalars["moe/layer3_text/dropped_frac"])
    assert kept_text == pytest.approx(window[1][:4].sum())
    # the balance group: one layer, so its headline numbers are that layer's
    assert scalars["balance/text_max_mean_load"] == scalars["moe/layer3_text/max_mean_load"]
    assert scalars["balance/vision_dropped_frac"] == pytest.approx(scalars["moe/layer3_vision/dropped_frac"])
    assert scalars["balance/worst_max_mean_load"] == max(scalars["moe/layer3_text/max_mean_load"],
                                                         scalars["moe/layer3_vision/max_mean_load"])
    np.testing.assert_array_equal(images["balance/tokens_per_expert_text"],
                                  bar_chart([window[0][:4]], [3], "text experts: tokens per expert"))
    np.testing.assert_array_equal(images["balance/load_heat_map_vision"],
                                  heat_map([window[0][4:]], [3], "vision experts: load / mean load"))
    assert layer.stats.routed.numpy().sum() == 0  # the window was reset


def test_balance_headlines_over_layers_against_numpy():
    def window(routed, kept):
        return {"layer_idx": len(routed), "router_counts": [len(routed)], "group_modality": [0], "bias": None,
                "window": {"routed": np.array(routed), "kept": np.array(kept), "loss_counts": [0],
                           "loss_sums": [None]}}

    a, b = window([10, 30, 20], [10, 25, 20]), window([5, 5, 5, 25], [5, 5, 5, 10])
    scalars, images = summarize([b, a])
    assert scalars["balance/text_max_mean_load"] == pytest.approx(25 / 10)
    assert scalars["balance/text_dropped_frac"] == pytest.approx((5 + 15) / (60 + 40))
    share = np.array([5, 5, 5, 25]) / 40
    assert scalars["balance/text_routing_entropy"] == pytest.approx(-(share * np.log(share)).sum() / np.log(4))
    assert set(images) == {"balance/load_heat_map_text", "balance/tokens_per_expert_text"}


def test_heat_map_cells_legend_and_labels():
    cell = 40
    image = heat_map([np.array([1.0, 1.0, 1.0]), np.array([3.0, 0.0, 0.0])], [1, 2], "t", cell=cell)
    top = TITLE_H + 22

    def cell_colour(row, col):  # a cell's corner, clear of the number written in it
        return image[top + row * cell + 3, LABEL_W + col * cell + 3].tolist()

    assert cell_colour(0, 0) == [255, 255, 255]  # at the mean: white
    assert cell_colour(1, 0) == [255, 0, 0]  # 3x the mean saturates to red
    assert cell_colour(1, 1) == [0, 0, 255]  # idle: blue
    ink = (image.sum(axis=-1) < 200)
    for row in range(2):  # "layer i" left of each row, the ratio written in each cell
        band = slice(top + row * cell, top + (row + 1) * cell)
        assert ink[band, :LABEL_W].sum() > 20
        assert all(ink[band, LABEL_W + c * cell: LABEL_W + (c + 1) * cell].sum() > 10 for c in range(3))
    assert ink[top + 2 * cell: top + 2 * cell + 40, LABEL_W: LABEL_W + 3 * cell].sum() > 30  # expert ids, "expert"
    # the legend: a colour bar from red (2 and above) at the top through white (1) to blue (0)
    legend = image[top + 4: top + 4 + 112, LABEL_W + 3 * cell + 28]  # the bar: 112 px from top + 4
    assert legend[0].tolist() == legend[-1].tolist() == [20, 20, 20]  # its outline
    np.testing.assert_allclose(legend[1], [255, 0, 0], atol=6)  # the row below the outline: 1.98
    np.testing.assert_allclose(legend[-2], [0, 0, 255], atol=6)
    middle = legend[len(legend) // 2].astype(int)
    assert (np.abs(middle - 255) <= 6).all()  # 1: white
    np.testing.assert_array_equal(load_colours(np.array([0.0, 0.5, 1.0, 2.5])),
                                  [[0, 0, 255], [128, 128, 255], [255, 255, 255], [255, 0, 0]])


def test_bar_chart_bars_follow_the_counts():
    image = bar_chart([np.array([10.0, 40.0, 30.0, 0.0])], [1], "t", bar=30)
    base = TITLE_H + 14 + 64
    column = image[:base, LABEL_W + 30 * np.arange(4) + 15]  # one pixel column through each bar
    heights = [(np.abs(column[:, e].astype(int) - load_colours(r)).max(axis=-1) == 0).sum()
               for e, r in enumerate(np.array([10, 40, 30, 0]) / 20)]
    # bar heights in pixels: 64 for the largest count, the others in proportion (less the outline)
    assert heights[1] == pytest.approx(64, abs=2) and heights[0] == pytest.approx(16, abs=2)
    assert heights[2] == pytest.approx(48, abs=2) and heights[3] == 0


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
    trainer.parts.model.moe_layers()[0].moe_statics.e_score_correction_bias.set_value(bias)
    trainer.train()
    logdir = tmp_path / "visualdl"
    assert [v for _, v in read_scalars(logdir, "moe/layer1_text/max_mean_load")] == [4.0, 4.0]
    assert [v for _, v in read_scalars(logdir, "moe/layer1_text/idle_expert_frac")] == [0.75, 0.75]
    assert [v for _, v in read_scalars(logdir, "moe/layer1_text/routing_entropy")] == [0.0, 0.0]
    assert read_scalars(logdir, "balance/worst_max_mean_load")[-1][1] == 4.0
    assert read_scalars(logdir, "balance/text_max_mean_load")[-1][1] == 4.0
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
    assert {"balance/tokens_per_expert_text", "balance/load_heat_map_text"} <= set(reader.get_tags()["image"])
    # this rank's memory is its own run, under the tags every rank shares
    (rank_log,) = list((logdir / "rank0").glob("vdlrecords.*.log"))
    rank_reader = LogReader(file_path=str(rank_log))
    assert [r.value for r in rank_reader.get_data("scalar", "memory/max_rss_gb")] == pytest.approx(
        [r["memory/rank0/max_rss_gb"] for r in train], rel=1e-6)
    assert not any(tag.startswith("memory/rank") for tag in reader.get_tags()["scalar"])


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


@contextlib.contextmanager
def visualdl_server(*logdirs):
    """A real VisualDL server on a free local port over ``logdirs``: yields its base URL."""
    import time
    import urllib.request

    port = free_port()
    # the `visualdl` command's own entry point, run by this interpreter (its script may not be on PATH)
    entry = "import sys; from visualdl.server.app import main; sys.argv[0] = 'visualdl'; sys.exit(main())"
    server = subprocess.Popen([sys.executable, "-c", entry, "--logdir", *map(str, logdirs),
                               "--host", "127.0.0.1", "--port", str(port), "-L", "en"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900  # only a server that never answers fails: load delays it by any amount
        while True:  # the server answers once it has read the logs
            try:
                urllib.request.urlopen(f"{base}/app/api/runs", timeout=30)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"the VisualDL server {'exited' if server.poll() is not None else 'never answered'}")
                time.sleep(0.5)
        yield base
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory):
    """A 2-process training run, served twice: the whole dashboard, and its per-rank runs alone."""
    tmp = tmp_path_factory.mktemp("dashboard")
    out, _ = launch(tmp, 2, "training.max_steps=30", "logging.logging_steps=5", "training.eval_steps=15")
    logdir = out / "visualdl"
    with visualdl_server(logdir) as base, visualdl_server(logdir / "rank0", logdir / "rank1") as ranks:
        yield base, ranks, out


def get(url):
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read()


def get_json(url):
    body = json.loads(get(url))
    assert body["status"] == 0, body
    return body["data"]


def launched_records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_visualdl_server_serves_the_dashboard(dashboard):
    import io

    import yaml
    from PIL import Image

    base, _, out = dashboard
    assert set(get_json(f"{base}/app/api/runs")) == {"run", "rank0", "rank1"}
    tags = get_json(f"{base}/app/api/scalar/tags")
    by_run = dict(zip(tags["runs"], tags["tags"]))
    for tag in ("train/loss", "train/grad_norm", "moe/layer1_text/max_mean_load", "balance/worst_max_mean_load",
                "balance/text_max_mean_load", "balance/vision_dropped_frac", "balance/text_routing_entropy",
                "memory/max_rank_max_allocated_gb", "eval/eval_caption_accuracy", "train/mfu"):
        assert tag in by_run["run"], tag
    train = [r for r in launched_records(out) if "loss" in r]
    points = get_json(f"{base}/app/api/scalar/list?run=run&tag=train/loss")
    assert [p[1] for p in points] == [r["step"] for r in train]
    np.testing.assert_allclose([p[2] for p in points], [r["loss"] for r in train], rtol=1e-5)
    # memory: every rank a run of its own under the same tags, so VisualDL draws a line per rank in one chart
    for rank in (0, 1):
        assert {"memory/max_rss_gb", "memory/max_allocated_gb", "memory/allocated_gb"} <= set(by_run[f"rank{rank}"])
        curve = get_json(f"{base}/app/api/scalar/list?run=rank{rank}&tag=memory/max_rss_gb")
        np.testing.assert_allclose([p[2] for p in curve], [r[f"memory/rank{rank}/max_rss_gb"] for r in train],
                                   rtol=1e-5)
    assert not any(tag.startswith("memory/rank") for tag in by_run["run"])
    # the images: a heat map and a bar chart per modality; the heat map's reddest cell is the logged load ratio
    images = get_json(f"{base}/app/api/image/tags")["tags"][0]
    assert set(images) == {f"balance/{kind}_{m}" for kind in ("load_heat_map", "tokens_per_expert")
                           for m in ("text", "vision")}
    steps = get_json(f"{base}/app/api/image/list?run=run&tag=balance/load_heat_map_text")
    assert [s["step"] for s in steps] == [r["step"] for r in train]
    png = get(f"{base}/app/api/image/image?run=run&tag=balance/load_heat_map_text&index={len(steps) - 1}")
    picture = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    cells = picture[TITLE_H + 22 + 3, LABEL_W + 3: LABEL_W + 4 * 56: 56]  # 4 experts, 56 px cells, one layer
    assert np.abs(cells.astype(int) - load_colours(train[-1]["moe/layer1_text/max_mean_load"])).max(axis=-1).min() <= 1
    # the config: one text entry per section, equal to run_config.yaml's section
    config = yaml.safe_load((out / "run_config.yaml").read_text())
    assert set(get_json(f"{base}/app/api/text/tags")["tags"][0]) == {f"config/{name}" for name in config}
    text = get(f"{base}/app/api/text/text?run=run&tag=config/training&index=0").decode()
    assert text == config_line(config["training"]) and yaml.safe_load(text) == config["training"]


def columns_in(pixels, colour, tolerance=40):
    """How many pixel columns of the page hold ``colour``: a curve drawn across a chart fills hundreds."""
    return (np.abs(pixels - np.array(colour)).max(axis=-1) < tolerance).any(axis=0).sum()


@pytest.mark.slow
def test_dashboard_pages_render_in_a_real_browser(dashboard, tmp_path):
    base, ranks, _ = dashboard

    # VisualDL draws the first run's curves in #2932E1 across each chart's width; its "no data" page has that
    # blue only in a few links (85 columns measured), two rows of charts fill hundreds of columns
    def curves(pixels):
        return columns_in(pixels[150:, :1080], (41, 50, 225)) > 250

    # the per-rank runs alone: the memory charts, a line per rank in the runs' two colours
    def a_line_per_rank(pixels):
        chart = pixels[200:, :1080]
        return columns_in(chart, (41, 50, 225), 20) > 250 and columns_in(chart, (0, 204, 136), 20) > 250

    # the images page: the heat maps' colour legends run from red to blue, colours VisualDL's page does not use
    # (the browser's scaling keeps the red, shifts the blue by up to 20)
    def heat_maps(pixels):
        content = pixels[120:, :1100]
        return columns_in(content, (255, 0, 0), 8) >= 10 and columns_in(content, (0, 0, 255), 25) >= 10

    for url, name, drawn, height in ((f"{base}/app/scalar", "scalars", curves, 900),
                                     (f"{ranks}/app/scalar", "memory", a_line_per_rank, 900),
                                     (f"{base}/app/sample/image", "heat_maps", heat_maps, 1100)):
        assert drawn(screenshot(url, tmp_path / f"{name}.png", drawn, height)), name


def screenshot(url, path, drawn, height=900):
    """The page at ``url`` in headless Chromium, its screenshot taken again until ``drawn(pixels)`` holds: the
    charts draw once the page has fetched their data, which a loaded machine delays by any amount. The limit
    only turns a page that never draws into a failure."""
    import shutil
    import time

    from PIL import Image
    from support.devtools import Browser

    browser = Browser(url, path.parent / (path.stem + "_profile"), width=1400, height=height)
    try:
        deadline = time.monotonic() + 900
        while True:
            browser.screenshot(path)
            pixels = np.asarray(Image.open(path).convert("RGB")).astype(int)
            if drawn(pixels) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        browser.close()
    keep = os.environ.get("ERNIE_MOE_SCREENSHOTS")  # a folder to keep them in: the docs' pictures
    if keep:
        shutil.copy(path, Path(keep) / f"dashboard_{path.name}")
    assert pixels.shape[:2] == (height, 1400)
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 100 and pixels.std() > 20  # not a blank page
    return pixels


def test_flops_follow_the_6nd_formula(tiny_cfg):
    """6 FLOPs per activated weight per token (each modality's tokens through k of its own experts), plus the
    attention scores, the ViT per patch and the adapter per image token."""
    from types import SimpleNamespace

    from ernie_moe.batch import HostCounts
    from ernie_moe.model.ernie_vl import ErnieMoEForConditionalGeneration
    from ernie_moe.monitor.flops import FlopsCounter

    m = tiny_cfg.model
    model = ErnieMoEForConditionalGeneration(m)
    types = np.array([[0] * 30 + [1] * 9 + [-1] * 9])  # 30 text, 9 image tokens, 9 padding
    counts = HostCounts.of(np.zeros_like(types), types)
    batch = SimpleNamespace(host_counts=lambda: counts, input_ids=paddle.zeros([1, 48], "int64"),
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


def test_most_rollout_groups_scoring_alike_is_said_when_it_begins_and_ends():
    """A window where most groups scored every answer alike (no advantage, no gradient) is said once, with what to
    do for a task too hard or too easy, and once when it ends; the progress bar shows the reward first."""
    from ernie_moe.monitor.alerts import Alerts
    from ernie_moe.monitor.monitor import progress_figures

    alerts = Alerts(load_config(None, []).logging, 0.0)
    hard = alerts.check(5, {"rollout/equal_reward_groups": 0.75, "rollout/reward": 0.0}, 0.0)
    assert len(hard) == 1 and hard[0].startswith("step 5: 75% of the rollout groups scored every answer alike")
    assert "too hard" in hard[0] and "training.rl.dynamic_sampling=true" in hard[0]
    assert alerts.check(6, {"rollout/equal_reward_groups": 0.9, "rollout/reward": 0.0}, 0.0) == []
    ended = alerts.check(7, {"rollout/equal_reward_groups": 0.25, "rollout/reward": 0.4}, 0.0)
    assert ended == ["step 7: 25% of the rollout groups scored their answers alike, fewer than 50% again"]
    easy = Alerts(load_config(None, []).logging, 0.0).check(3, {"rollout/equal_reward_groups": 1.0,
                                                                  "rollout/reward": 1.0}, 0.0)
    assert "harder prompts, or a stricter reward" in easy[0]
    assert Alerts(load_config(None, []).logging, 0.0).check(3, {"loss": 1.0}, 0.0) == []
    shown = progress_figures({"loss": 0.5, "tokens_per_sec": 100.0, "rollout/reward": 0.25, "rollout/reward_std": 0.1})
    assert list(shown) == ["reward", "loss", "tok_s"] and shown["reward"] == "0.250+-0.100"
