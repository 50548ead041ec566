"""The data at cluster scale: each data rank reads only the samples of its own rows, which are the rows one
process builds; a resume reads no sample before its first step; the length index is kept and read back."""

import dataclasses
import itertools
import json
import os
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from ernie_moe.config import load_config
from ernie_moe.data import RowStream, build_datasets, build_tokenizer
from ernie_moe.data.feeding.feed import RowFeed
from ernie_moe.data.feeding.held_out_rows import held_out_batches
from ernie_moe.data.feeding.loader import rank_batches, rank_share
from ernie_moe.data.feeding.plan import deal_by_patches
from ernie_moe.data.formats.sample import BadSample


class CountingReads:
    """A data set that counts the samples read whole (``shapes``, the sizes the index measures, apart)."""

    def __init__(self, dataset):
        self.dataset, self.reads, self.sized = dataset, Counter(), 0

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        self.reads[index] += 1
        return self.dataset[index]

    def shapes(self, index):
        self.sized += 1
        return self.dataset.shapes(index)

    def identity(self):
        return self.dataset.identity()


def data_rank(rank, world):
    """One data rank of ``world`` as the feed sees it (the index measured by this process alone)."""
    return SimpleNamespace(data_rank=rank, data_world=world, rank=0, world_size=1, is_main=True,
                           all_gather_object=lambda value: [value])


@pytest.fixture(scope="module")
def captions(tmp_path_factory):
    """A JSONL caption file of 40 images of nine sizes (so the rows hold different numbers of samples), two of
    them missing."""
    folder = tmp_path_factory.mktemp("captions")
    lines = []
    for i in range(40):
        side = 28 * (1 + i % 3), 28 * (1 + i % 9 // 3)
        Image.fromarray(np.full((*side, 3), 7 * i, np.uint8)).save(folder / f"{i}.png")
        image = f"{i}.png" if i not in (5, 17) else "gone.png"
        lines.append({"image": image, "text": "a picture " + "of it " * (i % 4)})
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def png(value: int, height: int = 28, width: int = 28) -> bytes:
    import io

    out = io.BytesIO()
    Image.fromarray(np.full((height, width, 3), value, np.uint8)).save(out, "PNG")
    return out.getvalue()


def write_tar(path, members: list[tuple[str, bytes]]) -> None:
    import io
    import tarfile

    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """A folder of shards in three formats: a WebDataset tar (captions as .txt and as .json, a chat record, a
    key without its text), a Parquet file of datasets' layout in row groups of 3 (one image cell without bytes) and
    a JSONL file of interleaved documents."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path_factory.mktemp("shards")
    members = []
    for i in range(12):
        members.append((f"part/{i:04d}.png", png(9 * i, 28 * (1 + i % 3), 28)))
        if i == 7:
            continue  # no text member: a counted skip
        text = (f"a tar caption {i}" if i % 2 else json.dumps({"caption": f"a json caption {i} " * (i % 3 + 1)}))
        if i == 4:
            text = json.dumps({"messages": [{"role": "user", "content": "<image>what?"},
                                            {"role": "assistant", "content": "a picture"}]})
        members.append((f"part/{i:04d}.{'txt' if i % 2 else 'json'}", text.encode()))
    write_tar(folder / "a-0000.tar", members)
    images = [{"bytes": png(5 * i, 28, 28 * (1 + i % 2)), "path": None} for i in range(10)]
    images[6] = {"bytes": None, "path": "elsewhere.png"}
    pq.write_table(pa.table({"image": images, "text": [f"parquet text {i} " * (1 + i % 3) for i in range(10)]}),
                   folder / "b-0000.parquet", row_group_size=3)
    Image.fromarray(np.zeros((56, 28, 3), np.uint8)).save(folder / "figure.png")
    documents = [{"texts": ["an opening", None, "a closing " * (1 + i % 2)], "images": [None, "figure.png", None]}
                 for i in range(8)]
    (folder / "c-0000.jsonl").write_text("".join(json.dumps(d) + "\n" for d in documents))
    return folder


def configs(captions, index_dir, shards=None):
    common = [f"data.index_dir={index_dir}", "logging.progress_bar=false"]
    return {"synthetic": load_config(None, [*common, "data.num_train_samples=64", "data.image_size=56",
                                            "data.max_seq_len=48"]),
            "jsonl": load_config(None, [*common, "data.dataset=jsonl", f"data.train_path={captions}",
                                        "model.vocab_size=300", "data.max_seq_len=96"]),
            "mixed": load_config(None, [*common, "data.dataset=jsonl", f"data.train_path=[{captions}, {captions}]",
                                        "data.train_probs=[0.7, 0.3]", "model.vocab_size=300",
                                        "data.max_seq_len=96"]),
            **({"shards": load_config(None, [*common, "data.dataset=jsonl", f"data.train_path=[{shards}, {captions}]",
                                             "data.train_probs=[0.5, 0.5]", "model.vocab_size=300",
                                             "data.max_seq_len=96"])} if shards else {})}


def same_rows(rows, expected):
    assert len(rows) == len(expected)
    for a, b in zip(rows, expected):
        for name in ("input_ids", "labels", "token_type_ids", "position_ids", "key_ends"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
        assert len(a.patches) == len(b.patches) and all(np.array_equal(x, y) for x, y in zip(a.patches, b.patches))


@pytest.mark.parametrize("kind", ["synthetic", "jsonl", "mixed", "shards"])
def test_each_data_rank_reads_only_the_samples_of_its_own_rows(captions, shards, tmp_path, kind):
    """At 1, 2 and 4 data ranks (4 rows per rank, 2 micro-batches a step, 3 steps, and the fourth read ahead):
    each rank's rows are its share of the rows one process packs from the same data (the row stream, which reads
    every sample), and it reads each sample of its rows once and no other; together the ranks read each planned
    sample once."""
    cfg = configs(captions, tmp_path / "index", shards)[kind]
    train, _ = build_datasets(cfg)
    tok = build_tokenizer(cfg)
    for world in (1, 2, 4):
        reference = list(itertools.islice(RowStream(train, tok, cfg, Counter(), shuffle=True), 4 * 2 * 4 * world))
        everyone = Counter()
        for rank in range(world):
            data = CountingReads(train)
            feed = RowFeed(data, tok, cfg, data_rank(rank, world), Counter())
            rows = [row for _ in range(3) for micro_batch in feed.next_step(4, 2) for row in micro_batch]
            ahead = feed.aheads[0].rows.result()[0]  # step 4, read ahead
            rows += [row for micro_batch in ahead for row in micro_batch]
            mine = [row for start in range(0, len(reference), 4 * world)
                    for row in rank_share(reference[start: start + 4 * world], rank, world)]
            same_rows(rows, mine)
            docs = sum(int(row.doc_ids.max()) + int((row.token_type_ids != -1).all()) for row in rows)
            assert sum(data.reads.values()) == docs  # the samples of its rows, each read once
            everyone += data.reads
        assert max(everyone.values()) <= 1 + 4 * 2 * 4 * world * 48 // len(train)  # no sample read by every rank
        assert sum(everyone.values()) == sum(int(r.doc_ids.max()) + int((r.token_type_ids != -1).all())
                                             for r in reference)


@pytest.fixture(scope="module")
def pairs(captions):
    """A JSONL file of 30 preference pairs beside the captions' images (one missing, one with equal answers)."""
    records = []
    for i in range(30):
        answer = "a picture " + "of it " * (i % 4)
        records.append({"images": [f"{i}.png" if i != 5 else "gone.png"],
                        "messages": [{"role": "user", "content": "<image>what is it?"}],
                        "chosen": answer, "rejected": answer if i == 11 else answer + "and more " * (1 + i % 3)})
    path = captions.parent / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def pair_configs(pairs, index_dir):
    common = [f"data.index_dir={index_dir}", "logging.progress_bar=false", "training.stage=dpo"]
    return {"synthetic": load_config(None, [*common, "data.num_train_samples=40", "data.image_size=56",
                                            "data.max_seq_len=48"]),
            "jsonl": load_config(None, [*common, "data.dataset=jsonl", f"data.train_path={pairs}",
                                        "model.vocab_size=300", "data.max_seq_len=160"])}


def same_pairs(rows, expected):
    same_rows(rows, expected)
    assert [r.key for r in rows] == [r.key for r in expected]
    assert all(np.array_equal(a.inputs["pair_sides"], b.inputs["pair_sides"]) for a, b in zip(rows, expected))


@pytest.mark.parametrize("kind", ["synthetic", "jsonl"])
def test_each_data_rank_reads_only_its_own_preference_pairs(pairs, tmp_path, kind):
    """Preference pairs, a row each, at 1, 2 and 4 data ranks (2 pairs per rank, 2 micro-batches a step, 3 steps):
    each rank's pairs are its share of those one process takes from the row stream (which reads every pair), read
    once each and no other; a resume at step 2 reads nothing before its first step and continues them; held-out
    pairs are each rank's share of each evaluation batch, read once."""
    cfg = pair_configs(pairs, tmp_path / "index")[kind]
    train, _ = build_datasets(cfg)
    tok = build_tokenizer(cfg)
    for world in (1, 2, 4):
        reference = list(itertools.islice(RowStream(train, tok, cfg, Counter(), shuffle=True), 2 * 2 * 3 * world))
        held = list(RowStream(train, tok, cfg, Counter(), shuffle=False, held_out=True))
        everyone = Counter()
        for rank in range(world):
            data = CountingReads(train)
            feed = RowFeed(data, tok, cfg, data_rank(rank, world), Counter())
            rows = [row for _ in range(3) for micro_batch in feed.next_step(2, 2) for row in micro_batch]
            ahead = sum(len(mb) for mb in feed.aheads[0].rows.result()[0])  # step 4's pairs, read ahead
            mine = [row for start in range(0, len(reference), 2 * world)
                    for row in rank_share(reference[start: start + 2 * world], rank, world)]
            same_pairs(rows, mine)
            assert sum(data.reads.values()) == len(rows) + ahead
            everyone += data.reads
            resumed_data = CountingReads(train)
            resumed = RowFeed(resumed_data, tok, cfg, data_rank(rank, world), Counter())
            first = RowFeed(train, tok, cfg, data_rank(rank, world), Counter())
            for _ in range(2):
                first.next_step(2, 2)
            resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
            assert sum(resumed_data.reads.values()) == 0
            same_pairs([r for mb in resumed.next_step(2, 2) for r in mb], rows[8:])
            held_data = CountingReads(train)
            batches = list(held_out_batches(held_data, tok, cfg, data_rank(rank, world), 2, Counter()))
            for got, want in zip(batches, rank_batches(iter(held), 2 * world, rank, world, drop_last=False)):
                same_pairs(got, want)
            assert sum(held_data.reads.values()) == sum(len(b) for b in batches)
        assert sum(everyone.values()) == 2 * 2 * 4 * world  # together, each planned pair once (4 steps' worth)


def test_rows_dealt_by_their_patches_give_each_rank_as_many_rows_and_even_patches():
    """A hand-made global micro-batch of 8 rows for 2 and 4 ranks: each rank as many rows, every row dealt once,
    each rank's rows in batch order, the greedy deal's loads as counted by hand; and against every deal of 8 rows to
    2 ranks, the greedy one's largest load within 4/3 of the best."""
    patches = np.array([0, 64, 4, 16, 16, 36, 0, 100, 4, 49], np.int64)  # per sample
    rows = [[0, 2], [1], [3, 4], [5], [6], [7], [8, 9], [2, 3]]  # samples per row: 4, 64, 32, 36, 0, 100, 53, 20
    cost = [int(patches[r].sum()) for r in rows]
    two = deal_by_patches(rows, patches, 2)
    assert sorted(map(tuple, two[0] + two[1])) == sorted(map(tuple, rows)) and [len(d) for d in two] == [4, 4]
    assert all(d == sorted(d, key=rows.index) for d in two)
    loads = [sum(int(patches[r].sum()) for r in d) for d in two]
    # by hand: 100 -> 0, 64 -> 1, 53 -> 1, 36 -> 0, 32 -> 1, 20 -> 0, 4 -> 1 (rank 1's fourth), 0 -> 0
    assert loads == [156, 153]
    best = min(max(sum(cost[i] for i in pick), sum(cost) - sum(cost[i] for i in pick))
               for pick in itertools.combinations(range(8), 4))
    assert max(loads) <= best * 4 / 3
    contiguous = [sum(cost[:4]), sum(cost[4:])]
    assert max(loads) < max(contiguous)  # 136 | 173 taken in order
    four = deal_by_patches(rows, patches, 4)
    assert [len(d) for d in four] == [2, 2, 2, 2]
    # by hand: 100, 64, 53, 36 one each; 32 -> 3, 20 -> 2, 4 -> 1, 0 -> 0
    assert [sum(int(patches[r].sum()) for r in d) for d in four] == [100, 68, 73, 68]


def test_vision_balance_deals_the_same_global_rows_with_even_patches(captions, tmp_path):
    """On captions of nine image sizes, 2 and 4 data ranks: with data.balance vision each global micro-batch holds
    the rows it holds with tokens balance (so the losses are the same), each rank as many, each read by its rank
    alone, and the step's largest rank's patches over their mean (data/vision_imbalance) nearer 1."""
    tokens_cfg = configs(captions, tmp_path / "index")["jsonl"]
    vision_cfg = dataclasses.replace(tokens_cfg, data=dataclasses.replace(tokens_cfg.data, balance="vision"))
    train, _ = build_datasets(tokens_cfg)
    tok = build_tokenizer(tokens_cfg)
    for world in (2, 4):
        steps = {}
        imbalance = {}
        for name, cfg in (("tokens", tokens_cfg), ("vision", vision_cfg)):
            per_rank = []
            for rank in range(world):
                data = CountingReads(train)
                feed = RowFeed(data, tok, cfg, data_rank(rank, world), Counter())
                per_rank.append([feed.next_step(2, 2) for _ in range(4)])
                imbalance[name] = feed.window_metrics(0.0)["data/vision_imbalance"]
                got = [row for step in per_rank[-1] for micro_batch in step for row in micro_batch]
                ahead = [row for micro_batch in feed.aheads[0].rows.result()[0] for row in micro_batch]
                assert sum(data.reads.values()) == docs_of(got + ahead)
            steps[name] = per_rank
        for step in range(4):
            for micro in range(2):
                def key(row):
                    return row.input_ids.tobytes() + row.position_ids.tobytes()

                rows = {name: sorted(key(r) for rank in range(world) for r in steps[name][rank][step][micro])
                        for name in steps}
                assert rows["tokens"] == rows["vision"]
        assert 1.0 <= imbalance["vision"] < imbalance["tokens"], imbalance


def docs_of(rows) -> int:
    """The samples a list of rows holds (a row with no padding holds one more than its last document id)."""
    return sum(int(row.doc_ids.max()) + int((row.token_type_ids != -1).all()) for row in rows)


@pytest.mark.parametrize("kind", ["synthetic", "jsonl", "shards"])
def test_each_data_rank_reads_only_the_samples_of_its_own_held_out_rows(captions, shards, tmp_path, kind):
    """At 1, 2 and 4 data ranks, batches of 4 rows a rank: each rank's held-out rows are its share of each batch
    of the rows one process packs in order (the row stream, which reads every sample), a rank left without rows
    in the short last batch an unlabelled copy of its first row; each rank reads the samples of its rows once and
    no other, so together the ranks read each sample once (the copy's apart)."""
    cfg = configs(captions, tmp_path / "index", shards)[kind]
    data, _ = build_datasets(cfg)
    tok = build_tokenizer(cfg)
    reference = list(RowStream(data, tok, cfg, Counter(), shuffle=False, held_out=True))
    for world in (1, 2, 4):
        everyone, copies = Counter(), 0
        for rank in range(world):
            counted = CountingReads(data)
            batches = list(held_out_batches(counted, tok, cfg, data_rank(rank, world), 4, Counter()))
            expected = list(rank_batches(iter(reference), 4 * world, rank, world, drop_last=False))
            assert len(batches) == len(expected) == -(-len(reference) // (4 * world))
            for got, want in zip(batches, expected):
                same_rows(got, want)
            assert sum(counted.reads.values()) == docs_of([row for batch in batches for row in batch])
            unlabelled = [row for row in batches[-1] if not (row.labels != -100).any()]
            copies += docs_of(unlabelled)
            everyone += counted.reads
        assert sum(everyone.values()) - copies == docs_of(reference) and max(everyone.values()) <= 2


@pytest.mark.parametrize("ahead", [0, 1, 3])
def test_a_resume_reads_no_sample_before_its_first_step_and_continues_the_rows(captions, tmp_path, ahead):
    """The position saved after 3 steps, given to a new feed (as a resume in another layout does, at 2 data
    ranks): it reads nothing until asked for a step, then exactly its own rows of the uninterrupted run. Reading
    0, 1 or 3 steps ahead gives the same rows and saves the position of the rows handed out, not of those read."""
    default = configs(captions, tmp_path / "index")["jsonl"]
    cfg = dataclasses.replace(default, data=dataclasses.replace(default.data, read_ahead_steps=ahead))
    train, _ = build_datasets(cfg)
    tok = build_tokenizer(cfg)
    whole = RowFeed(train, tok, cfg, data_rank(0, 1), Counter())
    steps = [whole.next_step(4, 2) for _ in range(6)]
    assert len(whole.aheads) == ahead
    reference = RowFeed(train, tok, default, data_rank(0, 1), Counter())
    for step in steps:
        same_rows([r for mb in step for r in mb], [r for mb in reference.next_step(4, 2) for r in mb])
    first = RowFeed(train, tok, cfg, data_rank(0, 1), Counter())
    for _ in range(3):
        first.next_step(4, 2)
    saved = json.loads(json.dumps(first.state_dict()))
    assert saved["rows_read"] == 24 and saved["epoch"] >= 1  # past the end of the first epoch
    plain = RowFeed(train, tok, default, data_rank(0, 1), Counter())
    for _ in range(3):
        plain.next_step(4, 2)
    assert saved == json.loads(json.dumps(plain.state_dict()))
    for rank in (0, 1):
        data = CountingReads(train)
        resumed = RowFeed(data, tok, cfg, data_rank(rank, 2), Counter())
        resumed.load_state_dict(saved)
        assert sum(data.reads.values()) == 0 and data.sized == 0  # nothing read: the index is kept
        for step in steps[3:]:
            same_rows([r for mb in resumed.next_step(2, 2) for r in mb],
                      [r for mb in step for r in rank_share(mb, rank, 2)])
        assert resumed.stats == whole.stats  # the counts of skipped samples continue too


def test_a_sample_whose_reading_disagrees_with_its_index_changes_only_its_own_row(captions, tmp_path):
    """After the index was made, one image is replaced by a larger one (more tokens than indexed) and another by
    bytes that are not an image: the row holding each loses that sample, counted, and every other row, on every
    rank, is as before."""
    import shutil

    folder = tmp_path / "data"
    shutil.copytree(captions.parent, folder)
    cfg = configs(folder / "train.jsonl", tmp_path / "index")["jsonl"]
    train, _ = build_datasets(cfg)
    tok = build_tokenizer(cfg)
    before = [r for mb in RowFeed(train, tok, cfg, data_rank(0, 1), Counter()).next_step(40, 1) for r in mb]
    Image.fromarray(np.zeros((196, 196, 3), np.uint8)).save(folder / "3.png")  # 49 image tokens, not 1
    (folder / "8.png").write_bytes(b"not a png")
    stats = Counter()
    feed = RowFeed(train, tok, cfg, data_rank(0, 1), stats)
    planned, plan_row = [], feed.plan.next_row
    feed.plan.next_row = lambda: planned.append(plan_row()) or planned[-1]
    after = [r for mb in feed.next_step(40, 1) for r in mb]
    planned = planned[:len(after)]  # the rows planned after these are the next step's, read ahead
    changed = {i for i, (a, b) in enumerate(zip(before, after)) if not np.array_equal(a.input_ids, b.input_ids)}
    holding = {sample: {i for i, row in enumerate(planned) if sample in row} for sample in (3, 8)}
    assert holding[8] and holding[8] <= changed <= holding[3] | holding[8]
    assert stats["corrupt_image"] == sum(row.count(8) for row in planned)
    assert stats["length_mismatch"] >= len(changed - holding[8])  # samples left out of rows that overflowed
    for i in set(range(len(before))) - changed:
        same_rows([after[i]], [before[i]])
    for i in holding[8] - holding[3]:  # the row's other samples, as they were
        kept = [d for d in range(len(planned[i])) if planned[i][d] != 8]
        assert int((after[i].token_type_ids != -1).sum()) == sum(int((before[i].doc_ids == d).sum()) for d in kept)


def test_the_index_is_measured_once_kept_and_measured_again_when_the_data_or_settings_change(captions, tmp_path):
    cfg = configs(captions, tmp_path / "index")["jsonl"]
    train, _ = build_datasets(cfg)
    tok = build_tokenizer(cfg)
    data = CountingReads(train)
    RowFeed(data, tok, cfg, data_rank(0, 1), Counter())
    assert data.sized == 40 and sum(data.reads.values()) == 0  # sizes only, never the pixels
    kept = [p for p in (tmp_path / "index").iterdir() if p.name != "offsets"]
    assert len(kept) == 1 and sorted(p.name for p in kept[0].iterdir()) == ["fitted.npy", "lengths.npy",
                                                                              "patches.npy", "reasons.json"]
    assert len(list((tmp_path / "index" / "offsets").glob("*.npy"))) == 1  # the file's line offsets, kept too
    again = CountingReads(train)
    RowFeed(again, tok, cfg, data_rank(0, 1), Counter())
    assert again.sized == 0  # read back
    (kept[0] / "lengths.npy").write_bytes(b"\x93NUMPY garbage")  # a damaged index is measured again
    damaged = CountingReads(train)
    RowFeed(damaged, tok, cfg, data_rank(0, 1), Counter())
    assert damaged.sized == 40
    lengths = np.load(kept[0] / "lengths.npy")  # valid, but not this data's: its digest no longer matches
    np.save(kept[0] / "lengths.npy", np.full_like(lengths, 1))
    wrong = CountingReads(train)
    RowFeed(wrong, tok, cfg, data_rank(0, 1), Counter())
    assert wrong.sized == 40 and np.array_equal(np.load(kept[0] / "lengths.npy"), lengths)
    longer = configs(captions, tmp_path / "index")["jsonl"]
    longer = type(longer)(**{**longer.__dict__, "data": type(longer.data)(**{**longer.data.__dict__,
                                                                            "max_seq_len": 128})})
    RowFeed(CountingReads(train), tok, longer, data_rank(0, 1), Counter())
    assert len([p for p in (tmp_path / "index").iterdir() if p.name != "offsets"]) == 2  # another key


def test_kept_offsets_are_trusted_only_when_they_prove_they_are_whole(captions, tmp_path):
    """The kept line offsets of a JSONL file rewritten as a valid array of 5 of its 40 records are not trusted (the
    run would train on 5 records without a word): their digest no longer matches, the file is scanned again. A FIFO
    in their place is not read (it would block the start): scanned again too."""
    from ernie_moe.data.formats.jsonl import JsonlDataset

    cfg = configs(captions, tmp_path / "index")["jsonl"]
    path = cfg.data.train_files[0]
    assert len(JsonlDataset(path, index_dir=str(tmp_path / "index"))) == 40
    (kept,) = (tmp_path / "index" / "offsets").glob("*.npy")
    whole = np.load(kept)
    np.save(kept, whole[:5])  # a valid int64 array, the first five records' offsets
    assert len(JsonlDataset(path, index_dir=str(tmp_path / "index"))) == 40
    np.save(kept, np.append(whole[:5], whole[5]))  # and one that ends in an offset where the digest was
    assert len(JsonlDataset(path, index_dir=str(tmp_path / "index"))) == 40
    kept.unlink()
    os.mkfifo(kept)
    assert len(JsonlDataset(path, index_dir=str(tmp_path / "index"))) == 40
    assert kept.is_file()  # kept again, over the FIFO


def read_all(dataset) -> dict:
    """Each sample of ``dataset``, or the reason it is skipped."""
    samples = {}
    for i in range(len(dataset)):
        try:
            samples[i] = dataset[i]
        except BadSample as bad:
            samples[i] = bad.reason
    return samples


def test_shards_read_as_their_formats_with_bad_members_counted(shards, tmp_path):
    """The folder's three shards as one source, every sample as written: tar captions from .txt and .json, a chat
    record, documents trained on all their text with the image in its place; a tar key without text and a Parquet
    image cell without bytes are counted skips."""
    cfg = load_config(None, ["data.dataset=jsonl", f"data.train_path={shards}", "model.vocab_size=300",
                             "data.max_seq_len=96"])
    train, _ = build_datasets(cfg)
    assert len(train) == 12 + 10 + 8
    samples = read_all(train)
    assert samples[7] == "missing_text" and samples[12 + 6] == "bad_images"
    assert [c.text for c in samples[1].chunks] == ["", "a tar caption 1"]
    assert samples[2].chunks[1].text == ("a json caption 2 " * 3).strip() and samples[2].images[0].shape == (84, 28, 3)
    assert samples[4].conversation is not None and len(samples[4].images) == 1
    assert [c.text for c in samples[12].chunks] == ["", "parquet text 0"] and samples[13].images[0].shape == (28, 56, 3)
    document = samples[22]
    assert [(c.text, c.image, c.loss) for c in document.chunks] == [("an opening", -1, True), ("", 0, False),
                                                                     ("a closing ", -1, True)]
    stats = Counter()
    rows = list(RowStream(train, build_tokenizer(cfg), cfg, stats, shuffle=False))
    assert dict(stats) == {"missing_text": 1, "bad_images": 1}
    trained = sum(int((r.labels != -100).sum()) for r in rows)
    assert trained > 0


def test_torn_changed_or_vanished_shards_are_a_skip_or_a_line(shards, tmp_path):
    """A tar cut inside a member: the members before it read, the torn one a counted skip; a Parquet row group
    whose page cannot be decoded: its rows counted skips, the others read; a Parquet file whose bytes were
    damaged after it was opened, or a shard removed during the run: a data error naming the file."""
    import shutil

    from ernie_moe.data.formats.sample import DataError
    from ernie_moe.data.formats.sources import source_dataset

    folder = tmp_path / "shards"
    shutil.copytree(shards, folder)
    import tarfile

    with tarfile.open(folder / "a-0000.tar") as tar:
        cut = next(m for m in tar.getmembers() if m.name == "part/0005.png")
    data = (folder / "a-0000.tar").read_bytes()
    (folder / "a-0000.tar").write_bytes(data[: cut.offset_data + cut.size // 2])  # inside the sixth image
    cfg = load_config(None, ["data.dataset=jsonl", f"data.train_path={folder / 'a-0000.tar'}",
                             "model.vocab_size=300"])
    torn = source_dataset(str(folder / "a-0000.tar"), cfg.data)
    reasons = Counter(r for r in read_all(torn).values() if isinstance(r, str))
    assert len(torn) == 6 and reasons == {"torn_tar_member": 1}  # keys 0 to 5, the last cut
    import pyarrow.parquet as pq

    page = pq.ParquetFile(folder / "b-0000.parquet").metadata.row_group(1).column(0).data_page_offset
    data = bytearray((folder / "b-0000.parquet").read_bytes())
    data[page: page + 8] = b"\xff" * 8  # the second row group's first page header
    (folder / "b-0000.parquet").write_bytes(bytes(data))
    parquet = source_dataset(str(folder / "b-0000.parquet"), cfg.data)
    read = read_all(parquet)
    assert [i for i, r in read.items() if r == "bad_parquet_row"] == [3, 4, 5]  # rows of 3 a group
    assert sum(isinstance(r, str) for r in read.values()) == 4  # and the image cell without bytes
    (folder / "b-0000.parquet").write_bytes(b"PAR1" + bytes(100))
    with pytest.raises(DataError, match="b-0000.parquet changed while this run reads it"):
        parquet[5]
    jsonl = source_dataset(str(folder / "c-0000.jsonl"), cfg.data)
    (folder / "c-0000.jsonl").unlink()
    with pytest.raises(DataError, match="c-0000.jsonl cannot be read now"):
        jsonl[0]
    (folder / "gz.tar").write_bytes(b"\x1f\x8b" + bytes(100))
    with pytest.raises(DataError, match="is not an uncompressed tar file"):
        source_dataset(str(folder / "gz.tar"), cfg.data)
    with pytest.raises(DataError, match="matches no file"):
        source_dataset(str(folder / "none-*.tar"), cfg.data)
    # a compressed shard, named, globbed or beside others in a folder: one line saying why, never read as JSONL
    # nor left out without a word
    (folder / "d-0000.tar.gz").write_bytes(b"\x1f\x8b" + bytes(100))
    for entry in (folder / "d-0000.tar.gz", folder / "d-*", folder):
        with pytest.raises(DataError, match="d-0000.tar.gz' is compressed: shards are read at random"):
            source_dataset(str(entry), cfg.data)


def test_a_resumed_run_with_workers_on_jsonl_equals_the_uninterrupted_one(captions, tmp_path):
    """In the trainer, on the captions with two data workers reading three steps ahead: six steps straight,
    against three, a checkpoint and a resume for three more (rows past the end of an epoch): the same losses,
    exactly; the resumed trainer starts at the saved position (its reads before the first step are counted without
    workers above)."""
    from ernie_moe.training import Trainer

    common = [f"data.index_dir={tmp_path / 'index'}", "data.dataset=jsonl", f"data.train_path={captions}",
              "model.vocab_size=300", "data.max_seq_len=96", "data.num_workers=2", "data.read_ahead_steps=3",
              "training.eval_steps=0",
              "training.save_steps=3", "logging.logging_steps=1", "logging.progress_bar=false",
              "logging.visualdl=false", "data.report_samples=0", "training.per_device_train_batch_size=4"]

    def losses(out):
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in records if "loss" in r}

    Trainer(load_config(None, [*common, "training.max_steps=6", f"training.output_dir={tmp_path / 'whole'}"])).train()
    Trainer(load_config(None, [*common, "training.max_steps=3", f"training.output_dir={tmp_path / 'part'}"])).train()
    resumed = Trainer(load_config(None, [*common, "training.max_steps=6", f"training.output_dir={tmp_path / 'part'}",
                                         "training.resume_from_checkpoint=auto"]))
    assert resumed.parts.feed.rows_read == 12 and resumed.parts.feed.plan.epoch >= 1
    resumed.train()
    assert losses(tmp_path / "part") == losses(tmp_path / "whole")
