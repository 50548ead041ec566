"""ERNIE-4.5-VL's inputs: the tokenizer's special tokens, the chat template, images, videos and 3D positions,
against PaddleFormers' own processor (``Ernie4_5_VLProcessor``) on a tokenizer made here."""

import json
import shutil
import subprocess
import sys
from collections import Counter

import numpy as np
import paddle
import pytest
from PIL import Image
from support.ernie import (
    BUDGET,
    SPECIALS,
    VL_MODEL,
    a_font,
    assert_same_visuals,
    ernie_config,
    make_ernie_tokenizer,
    media,
    mtp_logits,
    one_row_batch,
    paddleformers,
    picture,
    text,
    vl_logits,
)
from support.runs import ROOT

from ernie_moe.checkpoint.model_files import save_model
from ernie_moe.checkpoint.pretrained import load_pretrained
from ernie_moe.config import load_config
from ernie_moe.data.encoding.packing import Encoder
from ernie_moe.data.feeding.loader import build_tokenizer
from ernie_moe.data.formats.chat import ERNIE_VL_TEMPLATE
from ernie_moe.data.formats.jsonl import JsonlDataset
from ernie_moe.generation import Decoding, generate_batch, generate_drafting
from ernie_moe.model.mtp import labels_ahead
from ernie_moe.parallel.env import DistEnv
from ernie_moe.training.runner import build_model


def test_a_tokenizer_config_whose_added_tokens_decoder_is_not_a_mapping_is_refused(tmp_path):
    from ernie_moe.data.encoding.tokenizer import tokenizer_in

    folder = make_ernie_tokenizer(tmp_path / "tokenizer")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "added_tokens_decoder": ["<a>"]}))
    with pytest.raises(ValueError, match=r"added_tokens_decoder must map token ids to tokens, not \['<a>'\]"):
        tokenizer_in(folder, 4)


def our_encoder(folder):
    cfg = ernie_config(folder, *(f"data.{k}={v}" for k, v in BUDGET.items()))
    return Encoder(build_tokenizer(cfg), cfg.model, 4096, "skip", 448, Counter(), cfg.data.pixel_budget,
                   cfg.data.video_budget)


def test_the_special_tokens_resolve_to_their_ids(tmp_path):
    import sentencepiece

    make_ernie_tokenizer(tmp_path)
    tokenizer = build_tokenizer(load_config(None, [f"data.tokenizer_path={tmp_path}"]))
    sp = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    for token in SPECIALS:
        assert tokenizer.token_id(token) == sp.piece_to_id(token) != sp.unk_id()
        assert tokenizer.encode(f"a{token}b") == sp.encode("a") + [sp.piece_to_id(token)] + sp.encode("b")
    assert tokenizer.placeholder_id() == sp.piece_to_id("<|IMAGE_PLACEHOLDER|>")
    assert (tokenizer.bos_id, tokenizer.eos_id) == (sp.piece_to_id(SPECIALS[0]), sp.piece_to_id(SPECIALS[1]))
    assert tokenizer.decode(tokenizer.encode("User: a cat<|end_of_sentence|>")) == "User: a cat<|end_of_sentence|>"


@pytest.mark.slow
def test_encoded_conversations_equal_ernies_processor(ernie_side):
    """12 conversations (text only, one image, images of several sizes with a tall, a wide and one above the pixel
    budget, multi-turn, a system prompt, frames as a video, image + video, two videos, text between images,
    non-ASCII text, one below the minimum): input ids, token types, 3D positions, grids and pixels equal
    PaddleFormers' processor's on the text its tokenizer renders with the same chat template; the trained tokens
    are each answer and the end-of-sentence token closing it."""
    folder, cases = ernie_side
    encoder = our_encoder(folder)
    data = JsonlDataset(str(folder / "data.jsonl"))
    tokenizer = encoder.tok
    for n, messages in enumerate(cases):
        ours, ref = encoder(data[n]), np.load(folder / "out" / f"{n}.npz")
        where = f"conversation {n}: {ref['text']!r}"
        np.testing.assert_array_equal(ours.input_ids, ref["input_ids"][0], err_msg=where)
        np.testing.assert_array_equal(ours.token_type_ids, ref["token_type_ids"][0], err_msg=where)
        np.testing.assert_array_equal(ours.position_ids, ref["position_ids"][0], err_msg=where)
        assert_same_visuals(ours, ref, where)
        # the trained tokens, run by run, are the answers, each closed by <|end_of_sentence|>
        runs, run = [], []
        for token, trained in zip(ours.input_ids, ours.target):
            if trained:
                run.append(token)
            elif run:
                runs, run = runs + [run], []
        runs += [run] if run else []
        answers = [m["content"] + "<|end_of_sentence|>" for m in messages if m["role"] == "assistant"]
        assert [tokenizer.decode(r).lstrip(" ") for r in runs] == [a.lstrip(" ") for a in answers], where


@pytest.mark.slow
@pytest.mark.parametrize("capacity", [[8, 8, 8], [1.0, 1.0, 1.0]], ids=["every_token", "capacity_1"])
def test_vl_logits_equal_paddleformers_on_the_processors_output(ernie_side, tmp_path, capacity):
    """Text only; one image; three images of different sizes; an image and a 6-frame video: this package, from the JSONL
    conversation, gives the logits PaddleFormers' Ernie4_5_VLMoeForConditionalGeneration gives on its processor's
    output, on a checkpoint PaddleFormers made (GPU-only kernels replaced as ``paddleformers_cpu.py`` says), with
    room for every token and with capacity 1, where batches with images take PaddleFormers' capacity rule.
    PaddleFormers' ViT takes bfloat16 pixels, so ours are rounded to bfloat16 too: both see the same input."""
    folder, _ = ernie_side
    cases = [0, 1, 2, 6]
    cfg, model, placeholder = paddleformers_vl(folder, tmp_path, "vl_logits", cases, moe_capacity=capacity)
    assert cfg.model.moe_use_aux_free and cfg.model.im_patch_id == placeholder and cfg.model.moe_capacity == capacity
    load_pretrained(model, tmp_path / "model" / "hf")
    model.eval()
    encoder = Encoder(build_tokenizer(cfg), cfg.model, 4096, "skip", 448, Counter(), cfg.data.pixel_budget,
                      cfg.data.video_budget)
    data = JsonlDataset(str(folder / "data.jsonl"))
    for n in cases:
        ours = vl_logits(model, encoder(data[n]))
        theirs = np.load(tmp_path / f"{n}.npy")
        assert ours.shape == theirs.shape == (1, ours.shape[1], 400)
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4, err_msg=f"conversation {n}")


def paddleformers_vl(folder, tmp_path, command: str, cases: list[int], **made):
    """(our config, our model built from it, the image placeholder id) of a tiny ERNIE-4.5-VL checkpoint PaddleFormers
    makes in tmp_path/model (``VL_MODEL`` with ``made`` over it), after its side's ``command`` ran on the processor's
    outputs of ``cases``."""
    placeholder = build_tokenizer(ernie_config(folder)).placeholder_id()
    config = dict(VL_MODEL, im_patch_id=placeholder, **made)
    paddleformers("make", "vl", tmp_path / "model", json.dumps(config), cwd=tmp_path)
    paddleformers(command, tmp_path / "model" / "hf", tmp_path, *(folder / "out" / f"{n}.npz" for n in cases),
                  cwd=tmp_path)
    budget = [f"data.{k}={v}" for k, v in BUDGET.items()]
    cfg = load_config(None, [f"training.model_name_or_path={tmp_path / 'model' / 'hf'}",
                             f"data.tokenizer_path={folder / 'tokenizer'}", *budget])
    return cfg, build_model(cfg.model, DistEnv()), placeholder


@pytest.mark.slow
def test_vl_multi_token_prediction_equals_paddleformers(ernie_side, tmp_path):
    """Two MTP depths on a checkpoint PaddleFormers made: on text, an image, and an image with a video, each depth's
    logits (where PaddleFormers' shortened sequence has them) and its loss (the mean over its labels, as PaddleFormers'
    criterion computes it) equal PaddleFormers' VL model's. The folder's MTP tensors load as they are, go back out as
    PaddleFormers reads them (every tensor as it had them), and the transformers form leaves them out, saying so."""
    folder, _ = ernie_side
    cases, depths = [0, 1, 6], 2
    cfg, model, _ = paddleformers_vl(folder, tmp_path, "vl_mtp", cases, num_nextn_predict_layers=depths,
                                     moe_layer_start_index=2, mtp_loss_scaling_factor=0.3)
    assert cfg.model.num_nextn_predict_layers == depths and cfg.model.multi_token_pred_lambda == 0.3
    report = load_pretrained(model, tmp_path / "model" / "hf")
    assert report["new"] == [] and report["ignored"] == ["lm_head.weight"]  # a tied head's copy
    assert sum(n.startswith("model.mtp_") for n in report["converted"] + report["loaded"]) == depths * 9
    encoder = Encoder(build_tokenizer(cfg), cfg.model, 4096, "skip", 448, Counter(), cfg.data.pixel_budget,
                      cfg.data.video_budget)
    data = JsonlDataset(str(folder / "data.jsonl"))
    for n in cases:
        batch = one_row_batch(encoder(data[n]), labelled=True)
        logits = mtp_logits(model, batch)
        with paddle.no_grad():
            out = model(batch)
        length = batch.input_ids.shape[1] - depths
        theirs = np.load(tmp_path / f"{n}_mtp.npy")
        assert logits.shape[0] == 1 + depths and theirs.shape == (depths, length, 400)
        np.testing.assert_allclose(logits[1:, :length], theirs, rtol=0, atol=1e-4, err_msg=f"conversation {n}")
        counts = (labels_ahead(batch.labels, batch.key_ends, depths) != -100).reshape([depths, -1]).sum(axis=1)
        ours = (out.mtp_sums / counts.astype("float32")).numpy()
        np.testing.assert_allclose(ours, json.loads((tmp_path / f"{n}_mtp.json").read_text())["losses"], rtol=1e-5,
                                   err_msg=f"conversation {n}")

    save_model(model, cfg.model, str(tmp_path / "export"), hf_layout=True)
    paddleformers("dump", "vl", tmp_path / "export", tmp_path / "ours.npz", cwd=tmp_path)
    paddleformers("dump", "vl", tmp_path / "model" / "hf", tmp_path / "theirs.npz", cwd=tmp_path)
    ours, theirs = np.load(tmp_path / "ours.npz"), np.load(tmp_path / "theirs.npz")
    assert sorted(ours.files) == sorted(theirs.files) and sum("mtp" in n for n in theirs.files) == depths * 12
    for name in theirs.files:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(folder / "tokenizer" / name, tmp_path / "export" / name)
    done = subprocess.run([sys.executable, "-m", "ernie_moe.export", str(tmp_path / "export"), str(tmp_path / "hf"),
                           "--format", "transformers"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert f"left out {depths * 9} multi-token prediction tensors" in done.stdout  # q/k/v, gate/up fused
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert index["weight_map"] and not any("mtp" in n for n in index["weight_map"])


@pytest.mark.slow
def test_speculative_greedy_answers_on_images_and_video_are_plain_greedy_answers(ernie_side):
    """Text, one image, three images, an image and a video, side by side, with an untrained MTP layer drafting: the
    answers plain greedy decoding gives (generation.speculative)."""
    folder, _ = ernie_side
    cfg = ernie_config(folder, "model.num_nextn_predict_layers=1", *(f"data.{k}={v}" for k, v in BUDGET.items()))
    paddle.seed(5)
    model = build_model(cfg.model, DistEnv())
    model.eval()
    data = JsonlDataset(str(folder / "data.jsonl"))
    prompts = [our_encoder(folder).prompt(data[n]) for n in (0, 1, 2, 6)]
    assert any(p.token_type_ids.max() == 2 for p in prompts)  # video tokens
    decodings, never = [Decoding(12)] * len(prompts), (cfg.model.im_patch_id,)
    plain = generate_batch(model, prompts, decodings, -1, never=never)
    fast = generate_drafting(model, prompts, decodings, -1, never=never, draft_tokens=3)
    assert [o.ids for o in fast] == [o.ids for o in plain] and all(o.drafted > 0 for o in fast)


@pytest.mark.slow
def test_marker_strings_and_the_built_in_template_give_the_same_samples(ernie_side, tmp_path):
    """``<image>`` / ``<video>`` markers in string contents with "images" / "videos" lists encode as content parts
    do; a tokenizer folder without a chat template gets the built-in ERNIE-4.5-VL one, with the same result."""
    folder, cases = ernie_side
    make_ernie_tokenizer(tmp_path / "tokenizer", chat_template=None)
    parts, built_in = our_encoder(folder), our_encoder(tmp_path)
    assert built_in.tok.chat_template is None
    records = []
    for messages in cases:
        flat = []
        for m in messages:
            content = m["content"]
            if isinstance(content, list):
                content = "".join(p["text"] if p["type"] == "text" else f"<{p['type']}>" for p in content)
            flat.append({"role": m["role"], "content": content})
        records.append({"messages": flat, "images": media(messages, "image"), "videos": media(messages, "video")})
    (folder / "markers.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    marked, data = JsonlDataset(str(folder / "markers.jsonl")), JsonlDataset(str(folder / "data.jsonl"))
    for n in range(len(cases)):
        a, b, c = parts(data[n]), parts(marked[n]), built_in(data[n])
        for other in (b, c):
            np.testing.assert_array_equal(other.input_ids, a.input_ids, err_msg=str(n))
            np.testing.assert_array_equal(other.target, a.target, err_msg=str(n))
            np.testing.assert_array_equal(other.position_ids, a.position_ids, err_msg=str(n))


def test_a_generation_prompt_ends_with_the_assistant_turn_opened(tmp_path):
    from ernie_moe.data.formats.jsonl import parse_messages
    from ernie_moe.data.formats.sample import Sample

    make_ernie_tokenizer(tmp_path / "tokenizer")
    encoder = our_encoder(tmp_path)
    conversation, _, _ = parse_messages([{"role": "user", "content": "what is this?"}], [], [])
    prompt = encoder.prompt(Sample(conversation=conversation))
    assert encoder.tok.decode(prompt.input_ids) == "<|begin_of_sentence|>User: what is this?\nAssistant: "
    assert not prompt.target.any()


def test_bad_chat_templates_are_counted_skips(tmp_path):
    from ernie_moe.data.formats.chat import TemplateChat, check_messages
    from ernie_moe.data.formats.sample import BadSample

    conversation = check_messages([{"role": "user", "content": [{"type": "image"}, text("hi")]},
                                   {"role": "assistant", "content": [text("yo")]}])
    for template, reason in [("{{ messages[0]['content'] + 1 }}", "chat_template_error"),  # fails on the data
                             ("{{ 'no slots' }}{% if add_generation_prompt %}A{% endif %}", "chat_template_error")]:
        with pytest.raises(BadSample) as bad:
            TemplateChat(template).chunks(conversation)
        assert bad.value.reason == reason
    # templates that crash, run away or would take minutes stop quickly, each a counted skip
    runaway = ["{{ range(10**9) | list }}", "{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}", "{{ 1 / 0 }}",
               "{{ 'a' * 200000000 }}", "{{ 7 ** 100000000 }}",
               "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxxxx{% endfor %}{% endfor %}"]
    for template in runaway:
        with pytest.raises(BadSample) as bad:
            TemplateChat(template).chunks(conversation)
        assert bad.value.reason == "chat_template_error", template
    with pytest.raises(ValueError, match="cannot be read"):
        TemplateChat("{% for %}")
    # a template cannot reach Python's internals: the sandbox refuses them, so this otherwise valid one fails
    escaping = ERNIE_VL_TEMPLATE + "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    assert TemplateChat(ERNIE_VL_TEMPLATE).chunks(conversation)
    with pytest.raises(BadSample) as bad:
        TemplateChat(escaping).chunks(conversation)
    assert bad.value.reason == "chat_template_error"


@pytest.mark.slow
def test_video_frames_are_sampled_as_ernies_processor_samples_them(tmp_path):
    """Short, long, very long and few-frame videos: the same frame indices as PaddleFormers' processor picks
    (duration x 2 frames per second, clamped to 16..180 and to the video's length, the middle of each interval)."""
    from ernie_moe.data.formats.video import ERNIE_VIDEO_READING, frame_indices

    cases = [(300, 10.0), (30, 1.0), (9000, 300.0), (10, 0.4), (250, 8.3), (1000, 200.0)]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    paddleformers("frames", tmp_path / "cases.json", tmp_path / "frames.json", cwd=tmp_path)
    expected = json.loads((tmp_path / "frames.json").read_text())
    assert [frame_indices(n, s, ERNIE_VIDEO_READING) for n, s in cases] == expected
    assert [len(e) for e in expected] == [20, 16, 180, 10, 16, 180]


@pytest.mark.slow
def test_frame_times_are_drawn_as_ernies_processor_draws_them(tmp_path):
    """Frames of three sizes at times from 0 s to over an hour: the pixels equal those PaddleFormers' processor
    draws with the same font, and the mark is there (the top-left corner changed, the rest did not)."""
    from ernie_moe.data.formats.video import clock, draw_timestamp

    rng = np.random.default_rng(0)
    times = [0.0, 0.5, 59.999, 61.25, 3725.5, 7.0]
    sizes = [(64, 64), (90, 120), (252, 448), (90, 120), (252, 448), (64, 64)]
    font = a_font(tmp_path)
    for size in set(sizes):
        frames = np.stack([rng.integers(0, 256, (*size, 3), dtype=np.uint8) for s in sizes if s == size])
        chosen = [t for s, t in zip(sizes, times) if s == size]
        np.save(tmp_path / "frames.npy", frames)
        (tmp_path / "times.json").write_text(json.dumps(chosen))
        paddleformers("timestamps", tmp_path / "frames.npy", tmp_path / "times.json", font, tmp_path / "out.npy",
                      cwd=tmp_path)
        theirs = np.load(tmp_path / "out.npy")
        ours = np.stack([draw_timestamp(f, t, font) for f, t in zip(frames, chosen)])
        np.testing.assert_array_equal(ours, theirs)
        changed = (ours != frames).any(axis=-1)
        height = int(min(size) * 0.1) * 2
        assert changed[:, :height].any(axis=(1, 2)).all() and not changed[:, height:].any()
    assert [clock(t) for t in times] == ["00:00:00.00", "00:00:00.50", "00:00:60.00", "00:01:01.25",
                                         "01:02:05.50", "00:00:07.00"]


def test_a_video_file_without_a_decoder_is_a_counted_skip(tmp_path, monkeypatch):
    import sys

    from ernie_moe.data.feeding.loader import RowStream

    monkeypatch.setitem(sys.modules, "av", None)  # PyAV absent, whether or not it is installed
    make_ernie_tokenizer(tmp_path / "tokenizer")
    picture(tmp_path, "still.png", 60, 60, 0)
    good = {"messages": [{"role": "user", "content": [{"type": "image", "image": "still.png"}, text("What?")]},
                         {"role": "assistant", "content": "A still."}]}
    clip = {"messages": [{"role": "user", "content": [{"type": "video", "video": "clip.mp4"}, text("What?")]},
                         {"role": "assistant", "content": "A clip."}]}
    (tmp_path / "data.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(clip) + "\n")
    cfg = ernie_config(tmp_path, "data.dataset=jsonl", f"data.train_path={tmp_path / 'data.jsonl'}",
                       "data.max_seq_len=256")
    stats = Counter()
    rows = list(RowStream(JsonlDataset(str(tmp_path / "data.jsonl")), build_tokenizer(cfg), cfg, stats,
                          shuffle=False))
    assert len(rows) == 1 and dict(stats) == {"video_decoder_missing": 1}


def test_a_video_file_too_large_with_frames_of_two_sizes_or_an_unknown_codec_is_a_counted_skip(tmp_path):
    """An MJPEG stream whose header says 32 x 32 and whose frames alternate between 32 x 32 and 48 x 32: over
    data.max_image_pixels by its header, or by a frame (judged before the frame is converted), it is
    video_too_large; within the cap, bad_video. A stream of a codec no decoder knows is corrupt_video."""
    from fractions import Fraction

    import av

    from ernie_moe.data.formats.jsonl import load_video
    from ernie_moe.data.formats.sample import BadSample

    with av.open(str(tmp_path / "mixed.avi"), "w") as container:
        stream = container.add_stream("mjpeg", rate=5)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuvj420p"
        wider = av.CodecContext.create("mjpeg", "w")
        wider.width, wider.height, wider.pix_fmt, wider.time_base = 48, 32, "yuvj420p", Fraction(1, 5)
        wider.open()
        for i in range(10):
            encoder, width = (stream, 32) if i % 2 == 0 else (wider, 48)
            frame = av.VideoFrame.from_ndarray(np.full((32, width, 3), 20 * i, np.uint8), format="rgb24")
            frame.pts = i
            for packet in encoder.encode(frame):
                packet.stream = stream
                container.mux(packet)
        container.mux(stream.encode())
    skips = []
    for max_pixels in (32 * 32 - 1, 48 * 32 - 1, 48 * 32):
        with pytest.raises(BadSample) as skipped:
            load_video(tmp_path, "mixed.avi", max_pixels)
        skips.append((skipped.value.reason, str(skipped.value)))
    assert [reason for reason, _ in skips] == ["video_too_large", "video_too_large", "bad_video"]
    assert "has frames of 32 x 32 pixels" in skips[0][1]  # the header's size
    assert "has frames of 48 x 32 pixels" in skips[1][1]  # a decoded frame's
    assert "differ in size" in skips[2][1]
    # a Matroska file naming a codec no decoder knows: PyAV gives its stream no codec context
    with av.open(str(tmp_path / "clip.mkv"), "w") as container:
        stream = container.add_stream("mpeg4", rate=5)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for i in range(4):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.full((32, 32, 3), i, np.uint8), "rgb24")))
        container.mux(stream.encode())
    data = (tmp_path / "clip.mkv").read_bytes()
    assert data.count(b"V_MPEG4/ISO/ASP") == 1
    (tmp_path / "clip.mkv").write_bytes(data.replace(b"V_MPEG4/ISO/ASP", b"V_NOPE4/ISO/ASP"))
    with pytest.raises(BadSample, match="names no codec PyAV can decode") as skipped:
        load_video(tmp_path, "clip.mkv", 48 * 32)
    assert skipped.value.reason == "corrupt_video"


def test_a_video_file_is_decoded_and_sampled(tmp_path):
    """A 4-second clip of 20 frames (frame i a flat grey of level 12 i), written with PyAV: 2 frames per second
    gives 8, raised to the minimum of 16; the decoded frames are those the sampler chose, in order (each nearest
    in grey level to its source frame, through the codec's loss), and encode as 8 frame pairs of video tokens."""
    import av

    from ernie_moe.data.formats.video import ERNIE_VIDEO_READING, frame_indices

    with av.open(str(tmp_path / "clip.mp4"), "w") as container:
        stream = container.add_stream("mpeg4", rate=5)
        stream.width, stream.height, stream.pix_fmt = 64, 64, "yuv420p"
        for i in range(20):
            frame = av.VideoFrame.from_ndarray(np.full((64, 64, 3), 12 * i, np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    make_ernie_tokenizer(tmp_path / "tokenizer")
    record = {"messages": [{"role": "user", "content": [{"type": "video", "video": "clip.mp4"}, text("What?")]},
                           {"role": "assistant", "content": "Greys."}]}
    (tmp_path / "data.jsonl").write_text(json.dumps(record) + "\n")
    sample = JsonlDataset(str(tmp_path / "data.jsonl"))[0]
    chosen = frame_indices(20, 4.0, ERNIE_VIDEO_READING)
    assert sample.videos[0].shape == (16, 64, 64, 3) and len(chosen) == 16
    levels = sample.videos[0].mean(axis=(1, 2, 3))
    assert np.abs(levels[:, None] - 12 * np.arange(20)[None]).argmin(axis=1).tolist() == chosen
    cfg = ernie_config(tmp_path, "data.image_max_pixels=12544", "data.video_min_pixels=3136",
                       "data.video_max_pixels=3136")
    encoded = Encoder(build_tokenizer(cfg), cfg.model, 4096, "skip", 448, Counter(), cfg.data.pixel_budget,
                      cfg.data.video_budget)(sample)
    assert (encoded.token_type_ids == 2).sum() == 8 * 2 * 2 and encoded.grids[0].tolist() == [16, 4, 4]
    # with a font, each frame carries its time: frame i of this 5-per-second clip at i / 5 seconds
    from ernie_moe.data.formats.video import VideoReading, draw_timestamp

    font = a_font(tmp_path)
    stamped = JsonlDataset(str(tmp_path / "data.jsonl"), reading=VideoReading(timestamp_font=font))[0].videos[0]
    for frame, plain, index in zip(stamped, sample.videos[0], chosen):
        np.testing.assert_array_equal(frame, draw_timestamp(plain, index / 5, font))
    assert (stamped != sample.videos[0]).any()


def test_a_tokenizer_file_nested_too_deep_is_named_not_the_sentencepiece_model(tmp_path):
    from ernie_moe.data.encoding.tokenizer import tokenizer_in

    folder = make_ernie_tokenizer(tmp_path / "tokenizer")
    (folder / "special_tokens_map.json").write_text('{"bos_token": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ValueError, match=r"special_tokens_map\.json: it is nested too deep"):
        tokenizer_in(folder, 4)


@pytest.mark.slow
def test_images_of_every_mode_are_prepared_as_ernies_processor_prepares_them(tmp_path):
    """Transparent pixels (RGBA, LA, P with a transparent index) pasted on white, 16-bit grey to 8 bits, CMYK
    and EXIF-rotated JPEGs: the pixels PaddleFormers' ERNIE-4.5-VL preparation gives, element for element."""
    from ernie_moe.data.formats.jsonl import load_image

    rng = np.random.default_rng(0)
    colours = rng.integers(0, 256, (40, 56, 3), dtype=np.uint8)
    alpha = np.full((40, 56), 255, np.uint8)
    alpha[:, :20], alpha[:, 20:30] = 0, 128  # transparent (hiding red), half transparent, opaque
    hidden = colours.copy()
    hidden[:, :20] = (255, 0, 0)
    def merged(mode, *planes):
        return Image.merge(mode, [Image.fromarray(p) for p in planes])

    opaque = np.full((40, 56), 255, np.uint8)
    grey16 = Image.fromarray(np.arange(40 * 56, dtype=np.uint16).reshape(40, 56) * 29)
    assert grey16.mode == "I;16"
    made = {"rgba.png": merged("RGBA", *hidden.transpose(2, 0, 1), alpha),
            "opaque_rgba.png": merged("RGBA", *colours.transpose(2, 0, 1), opaque),
            "la.png": merged("LA", colours[..., 0], alpha), "grey16.png": grey16,
            "cmyk.jpg": Image.fromarray(colours).convert("CMYK"), "grey.png": Image.fromarray(colours[..., 1])}
    palette = Image.fromarray(colours).quantize(16)
    palette.info["transparency"] = 3
    made["palette.png"] = palette
    for name, image in made.items():
        image.save(tmp_path / name)
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees to show
    Image.fromarray(colours).save(tmp_path / "rotated.jpg", exif=exif)
    names = [*made, "rotated.jpg"]
    paddleformers("prepared", tmp_path / "theirs.npz", *[tmp_path / n for n in names], cwd=tmp_path)
    theirs = np.load(tmp_path / "theirs.npz")
    for i, name in enumerate(names):
        ours = load_image(tmp_path / name, 10 ** 6)
        np.testing.assert_array_equal(ours, theirs[f"arr_{i}"], err_msg=name)
    rgba = load_image(tmp_path / "rgba.png", 10 ** 6)
    assert (rgba[:, :20] == 255).all()  # white, not the red the transparent pixels hide
    assert load_image(tmp_path / "grey16.png", 10 ** 6).max() == (40 * 56 - 1) * 29 // 256
    assert load_image(tmp_path / "rotated.jpg", 10 ** 6).shape == (40, 56, 3)  # as stored
