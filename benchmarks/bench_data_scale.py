"""What the data costs one rank as the job grows: per step, at a resume, and to index a large source.

    python benchmarks/bench_data_scale.py [--images 512] [--steps 20] [--records 1000000]

1. Per-rank data time per step at 1, 2 and 4 data ranks with the same rows per rank (2 rows of 512 tokens of JPEG
   captions, 640 x 480 photos-to-be at ERNIE's pixel budget of 200,704): data rank 0's feed in this process, the
   other ranks' shares planned but not read, as each rank of a real job does. Beside it, the row stream every rank
   read before (every sample of the global batch, then its share).
2. Data time per step reading 0, 1 and 4 steps ahead (``data.read_ahead_steps``) on the same captions with one
   sample in 16 slow to read, beside a step's compute (a sleep: the reader thread runs while it waits).
3. The step's largest data rank's vision patches over their mean at 4 data ranks, on a source of text alone,
   images of five sizes and videos of 2 to 8 frames, with ``data.balance`` tokens and vision, and the step's time
   (the slowest rank's forward and backward through the default model).
4. Time from a fresh feed to its first step after a resume at step 20 and at step 2,000 (the position restored
   from the state a checkpoint keeps), beside replaying the consumed rows through the encoder as resumes did.
5. Index build rate and memory of a source of ``--records`` caption records (one small image each, its header read
   per record): the build, then a later run's read-back, and the resident memory a rank keeps for the source
   (offsets and index), measured in a fresh process each.

Prints markdown tables; figures from one run on one machine, as ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import psutil
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ernie_moe.config import load_config  # noqa: E402
from ernie_moe.data import RowStream, build_datasets, build_tokenizer  # noqa: E402
from ernie_moe.data.feeding.feed import RowFeed  # noqa: E402
from ernie_moe.data.feeding.loader import rank_batches  # noqa: E402


def write_photos(folder: Path, count: int) -> Path:
    rng = np.random.default_rng(0)
    lines = []
    for i in range(count):
        coarse = rng.integers(0, 256, (16, 21, 3), dtype=np.uint8)
        Image.fromarray(coarse).resize((640, 480), Image.BICUBIC).save(folder / f"{i}.jpg", quality=90)
        lines.append(json.dumps({"image": f"{i}.jpg", "text": f"a photograph numbered {i} " * (1 + i % 4)}))
    path = folder / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def rank(data_rank: int, world: int):
    return SimpleNamespace(data_rank=data_rank, data_world=world, rank=0, world_size=1, is_main=True,
                           all_gather_object=lambda value: [value])


def config(data: Path, index: Path):
    return load_config(None, ["data.dataset=jsonl", f"data.train_path={data}", "model.vocab_size=300",
                              "data.max_seq_len=512", "data.image_max_pixels=200704", "data.image_min_pixels=3136",
                              f"data.index_dir={index}", "logging.progress_bar=false"])


def per_step(cfg, steps: int) -> None:
    train, _ = build_datasets(cfg)
    tok = build_tokenizer(cfg)
    RowFeed(train, tok, cfg, rank(0, 1), Counter())  # the index, once
    print("| data ranks | feed: data time per step (rank 0) | row stream, as before | before / now |")
    print("|---|---|---|---|")
    base = None
    for world in (1, 2, 4):
        feed = RowFeed(train, tok, cfg, rank(0, world), Counter())
        feed.next_step(2, 1)
        started = time.perf_counter()
        for _ in range(steps):
            feed.next_step(2, 1)
        now = (time.perf_counter() - started) / steps
        batches = rank_batches(RowStream(train, tok, cfg, Counter(), shuffle=True), 2 * world, 0, world)
        next(batches)
        started = time.perf_counter()
        for _ in range(steps):
            next(batches)
        before = (time.perf_counter() - started) / steps
        base = base or now
        print(f"| {world} | {now * 1e3:.0f} ms ({now / base:.2f}x dp1) | {before * 1e3:.0f} ms | {before / now:.1f}x |")


class Uneven:
    """The data set with every 16th sample slow to read (a slow shard, a large video): ``seconds`` more."""

    def __init__(self, dataset, seconds: float):
        self.dataset, self.seconds = dataset, seconds

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        if index % 16 == 0:
            time.sleep(self.seconds)
        return self.dataset[index]

    def shapes(self, index: int):
        return self.dataset.shapes(index)

    def identity(self) -> dict:
        return self.dataset.identity()


def read_ahead(cfg, steps: int, compute_s: float = 0.15, slow_s: float = 0.3) -> None:
    """Data time per step on a source whose samples vary in cost, beside a step of ``compute_s`` (a sleep: the
    model's compute leaves the reader the interpreter), reading 0, 1 and 4 steps ahead."""
    train, _ = build_datasets(cfg)
    tok = build_tokenizer(cfg)
    slow = Uneven(train, slow_s)
    print(f"\n(a step computes {compute_s:.2f} s; one sample in 16 takes {slow_s:.1f} s more to read)\n\n"
          "| data.read_ahead_steps | data time per step, mean | the slowest step's |\n|---|---|---|")
    for ahead in (0, 1, 4):
        ahead_cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, read_ahead_steps=ahead))
        feed = RowFeed(slow, tok, ahead_cfg, rank(0, 1), Counter())
        feed.next_step(2, 1)
        waits = []
        for _ in range(steps):
            time.sleep(compute_s)
            started = time.perf_counter()
            feed.next_step(2, 1)
            waits.append(time.perf_counter() - started)
        feed.close()
        print(f"| {ahead} | {np.mean(waits) * 1e3:.0f} ms | {max(waits) * 1e3:.0f} ms |")


def write_mixed(folder: Path, count: int) -> Path:
    """A JSONL source of text alone, images of five sizes and videos of 2 to 8 frames, a third each."""
    rng = np.random.default_rng(1)
    sides = [(112, 112), (224, 168), (448, 336), (640, 480), (896, 672)]
    for k, (w, h) in enumerate(sides):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(folder / f"s{k}.jpg", quality=90)
    lines = []
    for i in range(count):
        text = f"record {i} " * (2 + i % 5)
        if i % 3 == 0:
            lines.append({"text": text})
        elif i % 3 == 1:
            lines.append({"image": f"s{i % 5}.jpg", "text": text})
        else:
            frames = [f"s{(i + j) % 2}.jpg" for j in range(2 + 2 * (i % 4))]
            lines.append({"messages": [{"role": "user", "content": "<video>what happens?"},
                                       {"role": "assistant", "content": text}], "videos": [frames]})
    path = folder / "mixed.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def balance(folder: Path, steps: int, world: int = 4) -> None:
    """At ``world`` data ranks on the mixed source, rows dealt by tokens (contiguous shares) and by vision patches:
    the step's largest rank's patches over their mean, and the step's time, the slowest rank's forward and
    backward of its rows through the default model (each rank's in turn, in this process)."""
    import paddle

    from ernie_moe.data.feeding.loader import collate
    from ernie_moe.model.ernie_vl import ErnieMoEForConditionalGeneration

    data = write_mixed(folder, 600)
    print(f"\n| data.balance ({world} data ranks, 2 rows of 512 tokens each, mixed text / image / video) | largest "
          "rank's patches / mean, per step (mean) | worst step | step time (slowest rank, mean) |\n|---|---|---|---|")
    for mode in ("tokens", "vision"):
        cfg = load_config(None, ["data.dataset=jsonl", f"data.train_path={data}", "model.vocab_size=300",
                                 "data.max_seq_len=512", f"data.index_dir={folder / 'index'}",
                                 "logging.progress_bar=false", f"data.balance={mode}", "data.read_ahead_steps=0"])
        train, _ = build_datasets(cfg)
        tok = build_tokenizer(cfg)
        feeds = [RowFeed(train, tok, cfg, rank(r, world), Counter()) for r in range(world)]
        paddle.seed(0)
        model = ErnieMoEForConditionalGeneration(cfg.model)
        ratios, seconds = [], []
        for step in range(steps + 1):
            slowest = 0.0
            for feed in feeds:
                batch = collate(feed.next_step(2, 1)[0])
                started = time.perf_counter()
                out = model(batch)
                (out.loss_sum + out.router_loss).backward()
                model.clear_gradients()
                slowest = max(slowest, time.perf_counter() - started)
            ratio = feeds[0].window_metrics(0.0)["data/vision_imbalance"]
            if step:  # the first step warms up
                ratios.append(ratio)
                seconds.append(slowest)
        for feed in feeds:
            feed.close()
        print(f"| {mode} | {np.mean(ratios):.2f} | {max(ratios):.2f} | {np.mean(seconds) * 1e3:.0f} ms |")


def resume(cfg) -> None:
    train, _ = build_datasets(cfg)
    tok = build_tokenizer(cfg)
    print("\n| resumed at step | feed: to its first step | replaying the rows, as before |\n|---|---|---|")
    for step in (20, 2000):
        planner = RowFeed(train, tok, cfg, rank(0, 1), Counter())
        for _ in range(step):  # the position a checkpoint at this step keeps (planned, nothing read)
            for _ in range(2):
                planner.plan.next_row()
        planner.rows_read = 2 * step
        saved = json.loads(json.dumps(planner.state_dict()))
        started = time.perf_counter()
        feed = RowFeed(train, tok, cfg, rank(0, 1), Counter())
        feed.load_state_dict(saved)
        feed.next_step(2, 1)
        now = time.perf_counter() - started
        replay = "-"
        if step <= 20:
            started = time.perf_counter()
            rows = RowStream(train, tok, cfg, Counter(), shuffle=True)
            for _ in itertools.islice(rows, 2 * step + 2):
                pass
            replay = f"{time.perf_counter() - started:.2f} s"
        print(f"| {step} | {now:.3f} s | {replay} |")


def index_memory(records: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        Image.fromarray(np.zeros((56, 84, 3), np.uint8)).save(folder / "a.png")
        with open(folder / "big.jsonl", "w") as f:
            for i in range(records):
                f.write(json.dumps({"image": "a.png", "text": f"caption number {i}"}) + "\n")
        print(f"\n| source of {records:,} records | open, index, first step | samples/s | memory it added (rank) |")
        print("|---|---|---|---|")
        for what in ("index built", "index read back"):
            out = subprocess.run([sys.executable, __file__, "--measure-index", str(folder)], capture_output=True,
                                 text=True, check=True).stdout.strip().splitlines()[-1]
            seconds, rss = (float(x) for x in out.split())
            print(f"| {what} | {seconds:.2f} s | {records / seconds:,.0f} | {rss:.0f} MB |")


def measure_index(folder: Path) -> None:
    """In a fresh process: open the source and its index as a rank does; the time and the memory it added."""
    warnings.filterwarnings("ignore")
    cfg = load_config(None, ["data.dataset=jsonl", f"data.train_path={folder / 'big.jsonl'}", "model.vocab_size=300",
                             f"data.index_dir={folder / 'index'}", "logging.progress_bar=false"])
    tok = build_tokenizer(cfg)
    process = psutil.Process()
    before = process.memory_info().rss
    started = time.perf_counter()
    train, _ = build_datasets(cfg)
    feed = RowFeed(train, tok, cfg, rank(0, 1), Counter())
    feed.next_step(1, 1)
    seconds = time.perf_counter() - started
    print(seconds, (process.memory_info().rss - before) / 2 ** 20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--measure-index", help=argparse.SUPPRESS)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.measure_index:
        measure_index(Path(args.measure_index))
        return
    with tempfile.TemporaryDirectory() as tmp:
        data = write_photos(Path(tmp), args.images)
        cfg = config(data, Path(tmp) / "index")
        per_step(cfg, args.steps)
        read_ahead(cfg, args.steps)
        balance(Path(tmp), args.steps)
        resume(cfg)
    index_memory(args.records)


if __name__ == "__main__":
    main()
