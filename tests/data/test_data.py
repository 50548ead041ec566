import itertools
import json
from collections import Counter

import numpy as np
import pytest
from PIL import Image
from support.runs import ROOT

from ernie_moe.batch import IGNORE_INDEX as IGNORE
from ernie_moe.config import ConfigError, load_config
from ernie_moe.data import RowStream, build_datasets, build_tokenizer, collate, rank_batches
from ernie_moe.data.encoding.images import patchify
from ernie_moe.data.encoding.packing import BadSample, Encoder
from ernie_moe.data.encoding.tokenizer import SentencePieceTokenizer
from ernie_moe.data.formats.jsonl import JsonlDataset
from ernie_moe.data.formats.sample import Chunk, Sample
from ernie_moe.data.formats.synthetic import SyntheticShapes
from ernie_moe.model.vision import image_token_count, patch_positions


def test_patchify_orders_patches_in_merge_blocks():
    h, w, p = 4 * 14, 6 * 14, 14
    image = np.zeros((h, w, 3), np.float32)
    for r in range(4):
        for c in range(6):
            image[r * p:(r + 1) * p, c * p:(c + 1) * p] = r * 10 + c  # every patch holds its (row, col)
    patches, grid = patchify(image, p, 2)
    assert grid.tolist() == [1, 4, 6] and patches.shape == (24, 3 * 14 * 14)
    ids = patches[:, 0].astype(int)
    positions, owners = patch_positions(grid[None], 2)
    np.testing.assert_array_equal(ids, positions[:, 1] * 10 + positions[:, 2])
    assert ids[:8].tolist() == [0, 1, 10, 11, 2, 3, 12, 13]  # first two 2x2 blocks
    assert (owners == 0).all()
    assert image_token_count(grid, 2, 2) == 6


def test_synthetic_samples_are_deterministic_and_captioned():
    a = SyntheticShapes(7, "train", 100, 84)
    b = SyntheticShapes(7, "train", 100, 84)
    np.testing.assert_array_equal(a[3].images[0], b[3].images[0])
    assert [c.text for c in a[3].chunks] == [c.text for c in b[3].chunks]
    held_out = SyntheticShapes(7, "eval", 100, 84)
    assert not np.array_equal(a[3].images[0], held_out[3].images[0])
    scored = [c.text.strip() for c in a[3].chunks if c.scored]
    d = a.describe(3)
    assert scored and set(scored) <= {d["color"], d["shape"], "top", "middle", "bottom", "left", "center", "right"}
    assert len(scored) == 4 and {c.scored for c in a[3].chunks} == {"", "color", "shape", "row", "column"}
    blank = SyntheticShapes(7, "train", 100, 84, blank_images=True)
    assert blank[3].images[0].max() == 0


def test_packed_rows_label_only_text_and_isolate_documents(tiny_cfg):
    tok = build_tokenizer(tiny_cfg)
    train, _ = build_datasets(tiny_cfg)
    row = next(iter(RowStream(train, tok, tiny_cfg, Counter(), shuffle=True)))
    images = row.token_type_ids == 1
    labelled = row.labels != IGNORE
    # labels are the next token, only where that token is text
    np.testing.assert_array_equal(row.labels[labelled], row.input_ids[1:][labelled[:-1]])
    nxt_is_image = np.append(images[1:], False)
    assert not (labelled & nxt_is_image).any()
    # no label crosses a document boundary
    boundary = np.append(row.doc_ids[1:] != row.doc_ids[:-1], True)
    assert not (labelled & boundary).any()
    assert (row.token_type_ids[row.input_ids == tok.pad_id] == -1).all()
    # text tokens after an image continue one past the image's largest position
    first_doc = row.doc_ids == 0
    pos = row.position_ids[first_doc]
    last_image = np.nonzero(images[first_doc])[0][-1]
    assert pos[last_image + 1, 0] == pos[: last_image + 1].max() + 1


def global_batches(cfg, world: int, steps: int = 3) -> list:
    """The rows of each of the first ``steps`` global batches (4 rows), gathered from ``world`` ranks."""
    tok = build_tokenizer(cfg)
    train, _ = build_datasets(cfg)
    per_rank = []
    for rank in range(world):
        batches = rank_batches(RowStream(train, tok, cfg, Counter(), shuffle=True), 4, rank, world)
        per_rank.append([[r.input_ids.tolist() for r in next(batches)] for _ in range(steps)])
    return [sum((per_rank[r][step] for r in range(world)), []) for step in range(steps)]


def test_sample_order_does_not_depend_on_world_size(tiny_cfg):
    assert global_batches(tiny_cfg, 1) == global_batches(tiny_cfg, 2) == global_batches(tiny_cfg, 4)


def test_collate_builds_a_model_batch(tiny_cfg):
    tok = build_tokenizer(tiny_cfg)
    train, _ = build_datasets(tiny_cfg)
    rows = list(next(rank_batches(RowStream(train, tok, tiny_cfg, Counter(), True), 2, 0, 1)))
    batch = collate(rows)
    assert batch.input_ids.shape == [2, tiny_cfg.data.max_seq_len]
    assert batch.position_ids.shape == [2, tiny_cfg.data.max_seq_len, 3]
    placeholders = int((batch.input_ids == tok.image_token_id).sum())
    assert placeholders == sum(image_token_count(g, 2, 2) for g in batch.grid_thw)
    assert batch.pixel_patches.shape[0] == int(batch.grid_thw.prod(axis=1).sum())


@pytest.fixture
def jsonl_dir(tmp_path):
    Image.fromarray(np.full((40, 60, 3), 200, np.uint8)).save(tmp_path / "ok.png")
    (tmp_path / "broken.png").write_bytes(b"not an image")
    lines = [
        {"image": "ok.png", "text": "a grey picture"},
        {"image": "missing.png", "text": "lost"},
        {"image": "broken.png", "text": "corrupt"},
        {"image": "ok.png", "text": "   "},
        "{not json",
        {"images": ["ok.png"], "messages": [{"role": "user", "content": "<image>\nWhat is it?"},
                                            {"role": "assistant", "content": "Grey."}]},
        {"images": [], "messages": [{"role": "user", "content": "<image> two"},
                                    {"role": "assistant", "content": "x"}]},
        {"image": "ok.png", "text": "word " * 200},
        {"messages": [{"role": "user", "content": "<image> a marker beside parts"},
                      {"role": "assistant", "content": [{"type": "text", "text": "x"}]}]},
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def test_bad_jsonl_records_are_skipped_and_counted(jsonl_dir):
    cfg = load_config(None, ["data.dataset=jsonl", f"data.train_path={jsonl_dir}", "model.vocab_size=300",
                             "data.max_seq_len=128", "data.overlong=skip"])
    stats = Counter()
    rows = list(RowStream(JsonlDataset(str(jsonl_dir)), build_tokenizer(cfg), cfg, stats, shuffle=False))
    assert dict(stats) == {"missing_image": 1, "corrupt_image": 1, "empty_text": 1, "bad_json": 1,
                           "image_count_mismatch": 2, "overlong_skipped": 1}
    docs = sum(int(r.doc_ids.max()) + (0 if (r.token_type_ids == -1).any() else 1) for r in rows)
    assert docs == 2


def test_messages_given_as_text_are_named_as_not_a_list():
    """A Parquet column of JSON text holds each record's messages as a string: not a list of messages, which it is
    called, rather than an empty conversation."""
    from ernie_moe.data.formats.jsonl import parse_messages
    from ernie_moe.data.formats.sample import BadSample

    with pytest.raises(BadSample, match="messages must be a list of messages, not a str") as caught:
        parse_messages('[{"role": "user", "content": "Hi"}]', [], [])
    assert caught.value.reason == "bad_message"
    with pytest.raises(BadSample, match="messages is empty"):
        parse_messages([], [], [])


def test_chat_records_train_only_on_assistant_turns(jsonl_dir):
    cfg = load_config(None, ["data.dataset=jsonl", f"data.train_path={jsonl_dir}", "model.vocab_size=300"])
    tok = build_tokenizer(cfg)
    encoded = Encoder(tok, cfg.model, 512, "truncate", 448, Counter())(JsonlDataset(str(jsonl_dir))[5])
    trained = tok.decode(encoded.input_ids[encoded.target])
    assert trained.startswith("Grey.")
    assert "What is it" not in trained


def test_overlong_samples_are_truncated_and_counted(jsonl_dir):
    cfg = load_config(None, ["data.dataset=jsonl", f"data.train_path={jsonl_dir}", "model.vocab_size=300"])
    stats = Counter()
    encoder = Encoder(build_tokenizer(cfg), cfg.model, 64, "truncate", 448, stats)
    encoded = encoder(JsonlDataset(str(jsonl_dir))[7])
    assert len(encoded) == 64 and stats["overlong_truncated"] == 1
    # an image that does not fit cannot be truncated: the sample is skipped instead
    tiny = Encoder(build_tokenizer(cfg), cfg.model, 8, "truncate", 448, stats)
    big = Sample(images=[np.zeros((112, 112, 3), np.uint8)], chunks=[Chunk(image=0), Chunk(text="x", loss=True)])
    with pytest.raises(BadSample) as err:
        tiny(big)
    assert err.value.reason == "overlong_skipped"


def test_sentencepiece_tokenizer_loads_from_a_local_directory(tmp_path):
    import sentencepiece as spm

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"a red circle number {i} at the top left" for i in range(200)))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "tokenizer"), vocab_size=40,
                                   bos_id=1, eos_id=2, unk_id=3, pad_id=0)
    tok = SentencePieceTokenizer(str(tmp_path), image_token_id=4)
    ids = tok.encode("a red circle")
    assert tok.decode(ids) == "a red circle" and tok.vocab_size == 40 and tok.bos_id == 1
    cfg = load_config(None, [f"data.tokenizer_path={tmp_path}"])
    assert isinstance(build_tokenizer(cfg), SentencePieceTokenizer)
    assert tok.placeholder_id() is None  # this model has no image piece: model.im_patch_id decides


def test_a_fine_tune_encodes_with_its_base_folders_tokenizer_and_a_word_list_is_a_tokenizer(tmp_path):
    """A model folder's word list (vocab.json, as the default run writes it) is the tokenizer a fine-tune from it
    encodes JSONL data with (before, bytes: ids the base never learned); data.tokenizer_path names such a folder too,
    and one without a tokenizer is one error."""
    from ernie_moe.checkpoint import save_model
    from ernie_moe.config import ConfigError
    from ernie_moe.data.encoding.tokenizer import ByteTokenizer, WordTokenizer
    from ernie_moe.model.ernie_vl import ErnieMoEForConditionalGeneration

    cfg = load_config(None, ["model.vocab_size=32"])
    save_model(ErnieMoEForConditionalGeneration(cfg.model), cfg.model, str(tmp_path / "base"),
               WordTokenizer(["red", "dot", "describe"]), hf_layout=True)
    (tmp_path / "train.jsonl").write_text('{"text": "red dot"}\n')
    jsonl = ["data.dataset=jsonl", f"data.train_path={tmp_path / 'train.jsonl'}", "model.vocab_size=32"]
    tuned = build_tokenizer(load_config(None, [*jsonl, f"training.model_name_or_path={tmp_path / 'base'}"]))
    assert isinstance(tuned, WordTokenizer) and tuned.encode("red describe") == [5, 7]
    named = build_tokenizer(load_config(None, [*jsonl, f"data.tokenizer_path={tmp_path / 'base'}"]))
    assert named.vocab == tuned.vocab
    assert isinstance(build_tokenizer(load_config(None, jsonl)), ByteTokenizer)  # nothing named: bytes
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no tokenizer"):
        load_config(None, [*jsonl, f"data.tokenizer_path={tmp_path / 'empty'}"])


def test_image_placeholder_id_must_match_the_tokenizer(tmp_path):
    import sentencepiece as spm

    from ernie_moe.config import ConfigError
    from ernie_moe.training.startup import check_tokenizer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"a blue ring number {i}" for i in range(100)))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "tokenizer"), vocab_size=30,
                                   bos_id=1, eos_id=2, unk_id=3, pad_id=0, user_defined_symbols=["<image>"])
    cfg = load_config(None, [f"data.tokenizer_path={tmp_path}", "model.im_patch_id=7"])
    with pytest.raises(ConfigError, match="placeholder piece has id 4"):
        check_tokenizer(build_tokenizer(cfg), cfg.model)


def test_a_rank_left_without_rows_gets_an_unlabelled_copy(tiny_cfg):
    tok = build_tokenizer(tiny_cfg)
    train, _ = build_datasets(tiny_cfg)
    rows = list(itertools.islice(iter(RowStream(train, tok, tiny_cfg, Counter(), shuffle=True)), 5))
    shares = [list(rank_batches(rows, 4, rank, 2, drop_last=False)) for rank in (0, 1)]
    assert [len(b) for b in shares[0]] == [2, 1] and [len(b) for b in shares[1]] == [2, 1]
    assert shares[0][1][0] is rows[4]
    blank = shares[1][1][0]
    np.testing.assert_array_equal(blank.input_ids, rows[4].input_ids)
    assert (blank.labels == IGNORE).all() and not blank.scored.any()


def two_sources(tmp_path, sizes=(30, 10)):
    paths = []
    for name, size in zip("ab", sizes):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"text": f"{name} {i}"}) + "\n" for i in range(size)))
        paths.append(str(path))
    return paths


def test_train_files_mix_by_probability_as_a_function_of_the_index(tmp_path):
    """data.train_path [a, b] with train_probs [0.8, 0.2]: sample i comes from b about 1 time in 5, and which
    sample it is depends on (seed, i) only, however many times the data is built."""
    paths = two_sources(tmp_path)
    overrides = ["data.dataset=jsonl", f"data.train_path=[{paths[0]}, {paths[1]}]", "data.train_probs=[0.8, 0.2]"]
    mixed, _ = build_datasets(load_config(None, overrides))
    again, _ = build_datasets(load_config(None, overrides))
    texts = [mixed[i].chunks[-1].text for i in range(len(mixed))]
    assert len(mixed) == 40 and texts == [again[i].chunks[-1].text for i in range(40)]
    share = np.mean([mixed.source_of(i)[0] for i in range(10_000)])
    assert abs(share - 0.2) < 0.02, share
    other_seed, _ = build_datasets(load_config(None, [*overrides, "training.seed=7"]))
    assert texts != [other_seed[i].chunks[-1].text for i in range(40)]


def test_mixed_train_files_give_the_same_global_batches_on_1_2_4_ranks(tmp_path):
    paths = two_sources(tmp_path)
    cfg = load_config(None, ["data.dataset=jsonl", f"data.train_path=[{paths[0]}, {paths[1]}]",
                             "data.train_probs=[0.6, 0.4]", "data.max_seq_len=16"])
    one = global_batches(cfg, 1, steps=5)
    assert one == global_batches(cfg, 2, steps=5) == global_batches(cfg, 4, steps=5)
    assert len({tuple(row) for batch in one for row in batch}) > 10  # distinct rows, not one repeated


def test_train_files_without_probabilities_follow_one_another(tmp_path):
    paths = two_sources(tmp_path)
    joined, _ = build_datasets(load_config(None, ["data.dataset=jsonl", f"data.train_path=[{paths[0]}, {paths[1]}]"]))
    assert [joined[i].chunks[-1].text for i in (0, 29, 30, 39)] == ["a 0", "a 29", "b 0", "b 9"]


def test_text_files_mix_in_at_the_modality_ratio(tmp_path):
    """ERNIEKit's text_dataset_path and modality_ratio: data.text_path files beside data.train_path, drawn 1 to 3
    (modality_ratio [3, 1]), the text share split over two text files by text_probs [0.5, 0.5]."""
    a, b = two_sources(tmp_path)
    c = tmp_path / "c.jsonl"
    c.write_text("".join(json.dumps({"text": f"c {i}"}) + "\n" for i in range(5)))
    mixed, _ = build_datasets(load_config(None, ["data.dataset=jsonl", f"data.train_path={a}",
                                                 f"data.text_path=[{b}, {c}]", "data.text_probs=[0.5, 0.5]",
                                                 "data.modality_ratio=[3, 1]"]))
    counts = np.bincount([mixed.source_of(i)[0] for i in range(20_000)], minlength=3) / 20_000
    np.testing.assert_allclose(counts, [0.75, 0.125, 0.125], atol=0.015)
    assert {mixed[i].chunks[-1].text.split()[0] for i in range(200)} == {"a", "b", "c"}
    for bad, message in (("data.modality_ratio=[1]", "two weights"), ("data.modality_ratio=[0, 0]", "not both 0"),
                         ("data.text_probs=[1, 0]", "one probability"),
                         (f"data.text_path={tmp_path / 'none.jsonl'}", "does not exist")):
        with pytest.raises(ConfigError, match=message):
            load_config(None, ["data.dataset=jsonl", f"data.train_path={a}", f"data.text_path={b}", bad])


@pytest.mark.parametrize("probs, message", [("[1]", "one probability"), ("[1, -1]", "one probability"),
                                            ("[0, 0]", "sum to 1"), ("[0.7, 0.2]", "sum to 1")])
def test_bad_train_probabilities_are_config_errors(tmp_path, probs, message):
    paths = two_sources(tmp_path)
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["data.dataset=jsonl", f"data.train_path=[{paths[0]}, {paths[1]}]",
                           f"data.train_probs={probs}"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(None, ["data.dataset=jsonl", f"data.train_path=[{paths[0]}, {tmp_path / 'none.jsonl'}]"])


@pytest.mark.parametrize("overlong", ["truncate", "skip"])
def test_background_workers_give_the_same_rows_and_counts(jsonl_dir, overlong):
    """data.num_workers 0, 1 and 2 over two epochs of the records above (bad ones, an overlong one): the same
    rows in the same order and the same skip counts, each bad record counted once."""
    cfg = load_config(None, ["data.dataset=jsonl", f"data.train_path={jsonl_dir}", "model.vocab_size=300",
                             "data.max_seq_len=128", f"data.overlong={overlong}"])
    results = []
    for workers in (0, 1, 2):
        stats = Counter()
        stream = RowStream(JsonlDataset(str(jsonl_dir)), build_tokenizer(cfg), cfg, stats, shuffle=True,
                           workers=workers)
        rows = list(itertools.islice(iter(stream), 6))
        stream.close()
        results.append((rows, dict(stats)))
    (rows0, stats0), *others = results
    assert stats0["bad_json"] == 1 and stats0.get("overlong_skipped", 0) + stats0.get("overlong_truncated", 0) >= 1
    for rows, stats in others:
        assert stats == stats0
        for a, b in zip(rows, rows0, strict=True):
            for name in ("input_ids", "labels", "token_type_ids", "position_ids", "doc_ids"):
                np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
            assert len(a.patches) == len(b.patches) and all(np.array_equal(x, y) for x, y in zip(a.patches, b.patches))


class CountingReads:
    """A data set that counts the samples read from it."""

    def __init__(self, dataset):
        self.dataset, self.reads = dataset, 0

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        self.reads += 1
        return self.dataset[index]


def assert_same_rows(rows, expected):
    for a, b in zip(rows, expected, strict=True):
        for name in ("input_ids", "labels", "token_type_ids", "position_ids", "key_ends"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
        assert len(a.patches) == len(b.patches) and all(np.array_equal(x, y) for x, y in zip(a.patches, b.patches))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_continues_from_its_saved_position_reading_only_its_open_row(jsonl_dir, workers):
    """Rows 0..14 read in one go (three epochs of the records above, bad ones among them), against rows 0..k, the
    position saved, and a new stream given it: the same rows from k on, the same skip counts, and before its first
    row the new stream reads only the samples of the row the old one was filling (at most a row's worth, at any
    k), none of the k rows before."""
    cfg = load_config(None, ["data.dataset=jsonl", f"data.train_path={jsonl_dir}", "model.vocab_size=300",
                             "data.max_seq_len=128"])
    tok = build_tokenizer(cfg)

    def stream(stats):
        return RowStream(CountingReads(JsonlDataset(str(jsonl_dir))), tok, cfg, stats, shuffle=True, workers=workers)

    whole_stats = Counter()
    whole = stream(whole_stats)
    expected = list(itertools.islice(whole, 15))
    whole.close()
    positions = []
    for k in (0, 3, 11):
        first = stream(Counter())
        list(itertools.islice(first, k))
        saved = json.loads(json.dumps(first.state_dict()))  # as a checkpoint keeps it
        first.close()
        stats = Counter()
        resumed = stream(stats)
        resumed.load_state_dict(saved)
        assert resumed.dataset.reads == len(saved["open_row"]) <= 128
        assert_same_rows(list(itertools.islice(resumed, 15 - k)), expected[k:])
        resumed.close()
        assert stats == whole_stats
        positions.append(saved)
    assert positions[0]["open_row"] == [] and positions[0]["position"] == 0  # nothing read yet
    assert positions[2]["epoch"] >= 2 and positions[2]["unusable"]  # a later epoch, past records found bad


def test_a_run_with_background_workers_trains_on_the_same_batches(tmp_path):
    from ernie_moe.training import Trainer

    losses = []
    for workers in (0, 2):
        tr = Trainer(load_config(None, [f"data.num_workers={workers}", f"training.output_dir={tmp_path / str(workers)}",
                                        "training.max_steps=3", "training.eval_steps=0", "logging.visualdl=false",
                                        "logging.progress_bar=false", "data.num_eval_samples=4"]))
        tr.train()
        rows = [json.loads(line) for line in (tmp_path / str(workers) / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in rows if "loss" in r]
        assert all(r["data_wait_s"] >= 0 for r in train)
        losses.append([r["loss"] for r in train])
    assert losses[0] == losses[1]


def test_content_parts_read_as_markers_and_bad_parts_are_counted(jsonl_dir):
    """PaddleFormers / Hugging Face content parts give the sample the string-with-markers form gives."""
    folder = jsonl_dir.parent
    parts = {"messages": [
        {"role": "user", "content": [{"type": "image", "image": "ok.png"}, {"type": "text", "text": "\nWhat is it?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Grey."}]}]}
    url = {"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "ok.png"}},
                                     {"type": "text", "text": "\nWhat is it?"}]},
        {"role": "assistant", "content": "Grey."}]}
    bad = [{"messages": [{"role": "user", "content": [{"type": "audio", "audio": "x.wav"}]},
                         {"role": "assistant", "content": "x"}]},
           {"messages": [{"role": "user", "content": [{"type": "video", "video": []}]},
                         {"role": "assistant", "content": "x"}]},
           {"messages": [{"role": "user", "content": "<video>What happens?"}, {"role": "assistant", "content": "x"}]},
           {"images": ["ok.png"], "messages": parts["messages"]}]
    path = folder / "parts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [parts, url, *bad]) + "\n")
    cfg = load_config(None, ["data.dataset=jsonl", f"data.train_path={path}", "model.vocab_size=300"])
    encoder = Encoder(build_tokenizer(cfg), cfg.model, 512, "truncate", 448, Counter())
    data, reference = JsonlDataset(str(path)), JsonlDataset(str(jsonl_dir))
    expected = encoder(reference[5])  # the same conversation with "<image>" in a string and an images list
    for index in (0, 1):
        got = encoder(data[index])
        np.testing.assert_array_equal(got.input_ids, expected.input_ids)
        np.testing.assert_array_equal(got.target, expected.target)
        np.testing.assert_array_equal(got.patches[0], expected.patches[0])
    stats = Counter()
    rows = list(RowStream(data, build_tokenizer(cfg), cfg, stats, shuffle=False))
    assert rows and dict(stats) == {"bad_message": 1, "video_without_frames": 2, "bad_images": 1}


def test_a_pixel_budget_that_cannot_hold_a_merge_block_is_a_config_error():
    with pytest.raises(ConfigError, match="image_min_pixels"):
        load_config(None, ["data.image_min_pixels=100", "data.image_max_pixels=1003520"])
    with pytest.raises(ConfigError, match="image_min_pixels"):
        load_config(None, ["data.image_min_pixels=5000", "data.image_max_pixels=4000"])


def test_records_nested_too_deep_not_text_or_naming_impossible_paths_are_counted_skips(tmp_path):
    """A record nested 100,000 deep, one whose bytes are not UTF-8, one with a lone surrogate escape and one whose
    image path is longer than the system allows are each a counted skip; a first line behind a byte-order mark
    reads as any other."""
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a red dot"}]}
    lines = [b"\xef\xbb\xbf" + json.dumps(good).encode(), b"[" * 100_000 + b"]" * 100_000,
             json.dumps(good).encode().replace(b"red", b"r\xffd"), json.dumps(good).replace("red", "\\ud800").encode(),
             json.dumps({"images": ["x" * 5000 + ".png"], "text": "a dot"}).encode(), json.dumps(good).encode()]
    path = tmp_path / "train.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    cfg = load_config(None, ["data.dataset=jsonl", f"data.train_path={path}", "model.vocab_size=300",
                             "data.max_seq_len=128"])
    stats = Counter()
    rows = list(RowStream(JsonlDataset(str(path)), build_tokenizer(cfg), cfg, stats, shuffle=False))
    assert dict(stats) == {"bad_json": 1, "bad_utf8": 2, "missing_image": 1}
    assert sum(int(r.doc_ids.max()) + (0 if (r.token_type_ids == -1).any() else 1) for r in rows) == 2


def stream_rows(cfg, folder, workers, count=6):
    stats = Counter()
    stream = RowStream(JsonlDataset(str(folder)), build_tokenizer(cfg), cfg, stats, shuffle=True, workers=workers)
    try:
        return list(itertools.islice(iter(stream), count)), dict(stats)
    finally:
        stream.close()


def test_a_data_worker_killed_mid_run_is_replaced_and_the_rows_do_not_change(jsonl_dir, monkeypatch, capsys):
    """kill -9 of a worker as it takes a sample (the kernel's out-of-memory killer does this): a new worker
    redoes its samples and the rows and counts equal an undisturbed run's; a worker that dies again and again
    stops the run with a line naming how, instead of waiting for it."""
    from ernie_moe import faults
    from ernie_moe.data import DataError

    cfg = load_config(None, ["data.dataset=jsonl", f"data.train_path={jsonl_dir}", "model.vocab_size=300",
                             "data.max_seq_len=128"])
    undisturbed = stream_rows(cfg, jsonl_dir, 0)
    monkeypatch.setenv(faults.VARIABLE, "kill_worker@3")
    rows, stats = stream_rows(cfg, jsonl_dir, 2)
    assert "a worker died (killed by signal 9 (SIGKILL))" in capsys.readouterr().out
    assert stats == undisturbed[1]
    for a, b in zip(rows, undisturbed[0], strict=True):
        for name in ("input_ids", "labels", "token_type_ids", "position_ids", "doc_ids"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    monkeypatch.setenv(faults.VARIABLE, "kill_every_worker@3")
    with pytest.raises(DataError, match="a data worker died 4 times"):
        stream_rows(cfg, jsonl_dir, 2)


@pytest.mark.parametrize("kind", ["words", "bytes", "ernie_bytes"])
def test_each_tokenizer_gives_the_byte_offsets_of_the_tokens_it_encodes(kind):
    from ernie_moe.data.encoding.tokenizer import ByteTokenizer, WordTokenizer

    tokenizer = WordTokenizer(["a", "red", "cat"]) if kind == "words" else ByteTokenizer(kind == "ernie_bytes")
    text = "a  réd<|end_of_sentence|> cat"
    with_offsets = tokenizer.encode_with_offsets(text)
    assert [token for token, _, _ in with_offsets] == tokenizer.encode(text)
    data = text.encode("utf-8")
    spans = [data[first:end] for _, first, end in with_offsets]
    if kind == "words":
        assert [span.decode("utf-8") for span in spans] == text.split()
    else:  # the tokens tile the text: a byte each, ERNIE's pieces whole
        assert b"".join(spans) == data and all(len(span) == 1 for span in spans if b"<|" not in span)
        assert (b"<|end_of_sentence|>" in spans) == (kind == "ernie_bytes")


def test_a_conversation_trains_its_answer_with_the_ernie_byte_tokenizer(tmp_path):
    """configs/tokenizers/ernie_bytes reads ERNIE's chat layout: the answer and the end-of-sentence token closing
    it are what trains, a byte a token."""
    from ernie_moe.data.feeding.loader import training_encoder

    record = {"messages": [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "héllo you"}]}
    (tmp_path / "d.jsonl").write_text(json.dumps(record) + "\n")
    cfg = load_config(ROOT / "configs" / "vl_moe.yaml", [
        f"data.tokenizer_path={ROOT / 'configs' / 'tokenizers' / 'ernie_bytes'}", "data.dataset=jsonl",
        f"data.train_path={tmp_path / 'd.jsonl'}"])
    tokenizer = build_tokenizer(cfg)
    encoded = training_encoder(tokenizer, cfg, Counter())(JsonlDataset(str(tmp_path / "d.jsonl"))[0])
    assert tokenizer.decode(encoded.input_ids[encoded.target]).strip() == "héllo you<|end_of_sentence|>"
