"""ERNIEKit's SFT records (VL ``image_info`` / ``text_info``, text ``src`` / ``tgt``), thinking and tool calls:
encoded as ERNIEKit encodes them, against its rules written out here from its published source
(``data_processor/steps/input_ids_messaging``: ``prepare_train_data`` and ``apply_chat_training_template``;
``ernie/dataset/vl_sft_reader``: the think prefix) and PaddleFormers' ERNIE-4.5-VL processor fed piece by piece,
as ERNIEKit tokenizes each piece on its own."""

import copy
import json
from collections import Counter

import numpy as np
import pytest
from support.ernie import BUDGET, assert_same_visuals, ernie_config, make_ernie_tokenizer, paddleformers, picture
from support.runs import ROOT

from ernie_moe.config import load_config
from ernie_moe.data.encoding.packing import Encoder
from ernie_moe.data.feeding.loader import build_tokenizer, source_dataset
from ernie_moe.data.formats.chat import ERNIE_VL_TEMPLATE
from ernie_moe.data.formats.sample import BadSample
from ernie_moe.training.trainer import Trainer

EMPTY_THINK = "<think>\n\n</think>\n\n"
BOS, EOS = "<|begin_of_sentence|>", "<|end_of_sentence|>"  # ERNIE-4.5-VL's cls and sep tokens


def erniekit_pieces(record: dict, thinking: bool) -> list:
    """ERNIEKit's encoding of a record as pieces (["text", text, trained], ["image", url], ["video", urls]),
    transliterated from its source. A text record is its VL form with ``is_system``; frames are a video as
    ERNIEKit's ``is_video`` correction marks them. Three places where this package writes what ERNIEKit means
    rather than what its code does are marked DIVERGES."""
    record = copy.deepcopy(record)
    if "src" in record:
        src, tgt = ([v] if isinstance(v, str) else v for v in (record["src"], record["tgt"]))
        label = record.get("label", [1] * len(src))
        text_info = [t for s, a, lab in zip(src, tgt, label)
                     for t in ({"text": s, "tag": "mask"}, {"text": a, "tag": "no_mask", "label": lab})]
        if record.get("system"):
            text_info = [{"text": record["system"], "tag": "mask"}, {"text": "", "tag": "no_mask"}] + text_info
            record["is_system"] = 1
        record["text_info"] = text_info
    texts = [dict(t, text=t["text"].strip()) for t in record["text_info"]]
    images = [dict(i) for i in record.get("image_info", [])]
    if record.get("is_video"):  # utterance_processing: "Video 1:" and the start before the frames, the end after
        first = images[0]["matched_text_index"]
        texts = texts[:first] + [{"text": "Video 1:", "tag": "mask"}, {"text": "<|VIDEO_START|>", "tag": "mask"}] \
            + texts[first:]
        for image in images:
            image["matched_text_index"] += 2
        last = images[-1]["matched_text_index"]
        texts = texts[:last] + [{"text": "<|VIDEO_END|>", "tag": "mask"}] + texts[last:]
    answers = "".join(t["text"] for t in texts if t["tag"] == "no_mask")
    prefix = EMPTY_THINK if thinking and not ("<think>" in answers and "</think>" in answers) else ""

    # prepare_train_data
    at = {}
    for image in images:
        at.setdefault(image.get("matched_text_index", 0), []).append(image)
    items = [[]]
    for idx, source in enumerate(texts):
        if not (len(items[-1]) == 0 or items[-1][-1]["tag"] == source["tag"]):
            items.append([])
        if idx in at:
            if len(items) % 2 == 0:
                assert len(items[-1]) == 0
                items[-2].append(at[idx])
            else:
                items[-1].append(at[idx])
        items[-1].append(source)
    if prefix:
        items[-1].insert(0, {"text": prefix, "tag": "mask"})
        for n, item in enumerate(items):
            for sub in item:
                if "text" in sub:
                    sub["label"] = int(n == len(items) - 1)

    # apply_chat_training_template
    is_system = bool(record.get("is_system"))
    out, pic = [], 1

    def text(value, tag):
        out.append(["text", value, tag == "no_mask"])

    for item_id, item in enumerate(items):
        if item_id == 0:
            text(BOS, "mask")
            # DIVERGES: ERNIEKit's prepare_train_data does not pass the record's tools on to the template
            if record.get("tools"):
                tools = record["tools"]
                text("\n<tool_list>\n", "mask")
                text(tools if isinstance(tools, str) else json.dumps(tools), "mask")
                text("\n</tool_list>\n", "mask")
        if item_id % 2 == 0 and not (is_system and item_id == 0):
            text("User: ", "mask")
        if item_id == 1 and is_system:
            continue
        label = 1
        for k, sub in enumerate(item):
            if isinstance(sub, list):
                if k + 1 < len(item) and item[k + 1].get("tool_response") is True:
                    text("\n<tool_output>\n", "mask")
                frames = [i["image_url"] for i in sub if i.get("image_type") == "video"]
                for image in sub:
                    if image.get("image_type", "image") != "video":
                        text(f"Picture {pic}:", "mask")
                        pic += 1
                        out.append(["image", image["image_url"]])
                if frames:  # the processor's video step writes the start and end the correction put around them
                    out.append(["video", frames])
                continue
            if item_id % 2 == 1:
                label = sub.get("label", 1)
                if label == 0:
                    sub["tag"] = "mask"
            calls = sub.pop("tool_calls", None)
            calls = json.loads(calls) if isinstance(calls, str) else calls
            for call in ([calls] if isinstance(calls, dict) else calls or []):
                call = call["function"] if call.get("type") == "function" else call
                args = call["arguments"] if isinstance(call["arguments"], str) else json.dumps(call["arguments"])
                # DIVERGES: ERNIEKit tags a call no_mask even in a turn its label skips; here the turn's rule holds
                tag = sub["tag"]
                for piece in ('<tool_call>\n{"name": "', call["name"], '", "arguments": ', args, "}\n</tool_call>\n"):
                    text(piece, tag)
            if sub.get("tool_response") is True:
                # DIVERGES: ERNIEKit opens the output only when `k - 1 > 0` (an off-by-one: the first text of a
                # turn gets a closing tag without its opening one); here every output is opened
                if k == 0 or not isinstance(item[k - 1], list):
                    text("\n<tool_output>\n", "mask")
                text(sub["text"], sub["tag"])
                text("\n</tool_output>\n", "mask")
            elif not (record.get("is_video") and sub["text"] in ("<|VIDEO_START|>", "<|VIDEO_END|>")):
                text(sub["text"], sub["tag"])
        if item_id % 2 == 0:
            text("\n" if is_system and item_id == 0 else "\nAssistant: ", "mask")
        else:
            text(EOS, "mask" if label == 0 else "no_mask")
    return [p for p in out if p[0] != "text" or p[1]]  # an empty text tokenizes to nothing


def records(folder):
    """The issue's cases: each format, images, a video as frames, multi-turn, a skipped turn, a system text,
    thinking and tool calls."""
    img = [picture(folder, f"p{i}.png", h, w, i) for i, (h, w) in enumerate([(70, 100), (330, 60), (112, 84)])]
    frames = [picture(folder, f"f{i}.png", 90, 120, 10 + i) for i in range(4)]

    def q(t, **kw):
        return {"text": t, "tag": "mask", **kw}

    def a(t, **kw):
        return {"text": t, "tag": "no_mask", **kw}

    weather = [{"type": "function", "function": {"name": "weather", "parameters": {"city": {"type": "string"}}}}]
    return [
        {"image_info": [{"image_url": img[0], "matched_text_index": 0}],
         "text_info": [q("What is this?"), a("A red square.")]},
        {"image_info": [{"image_url": img[0], "matched_text_index": 0}, {"image_url": img[1], "matched_text_index": 0},
                        {"image_url": img[2], "matched_text_index": 2}],
         "text_info": [q("Compare "), q(" them."), q("And this one?"), a(" Tall and wide. ")]},
        {"image_info": [{"image_url": img[2], "matched_text_index": 1}],  # names the answer's first text
         "text_info": [q("Describe:"), a("A grid."), q("The colour?"), a("Blue.", label=0), q("Shape?"),
                       a("Round.")]},
        {"is_video": 1, "image_info": [{"image_url": f, "matched_text_index": 0, "image_type": "video",
                                        "video_uid": "clip", "time_stamp": n * 0.5} for n, f in enumerate(frames)],
         "text_info": [q("What happens?"), a("It moves left.")]},
        {"is_system": 1, "image_info": [{"image_url": img[0], "matched_text_index": 2}],
         "text_info": [q("You are brief."), a(""), q("What is it?"), a("A square.")]},
        {"image_info": [{"image_url": img[1], "matched_text_index": 0}],
         "text_info": [q("Think about it."), a("<think>It is tall.</think>A tall thing.")]},
        {"tools": weather,
         "text_info": [q("Weather in Paris?"),
                       a("", tool_calls=[{"type": "function", "function": {"name": "weather",
                                                                             "arguments": {"city": "Paris"}}}]),
                       q('{"sky": "sunny"}', tool_response=True), a("It is sunny.")]},
        {"text_info": [q("Hi"), a("", tool_calls='{"name": "weather", "arguments": "{\\"city\\": \\"Rome\\"}"}'),
                       q("rain", tool_response=True), a("<think>It rains.</think>Take an umbrella.")]},
        {"system": "You are a helper.", "src": ["Hello", "Say more."], "tgt": ["Hi there!", "Gladly."],
         "label": [0, 1]},
        {"src": "One turn", "tgt": "One answer"},
    ]


@pytest.fixture(scope="module")
def erniekit_side(tmp_path_factory):
    """The records as JSONL, and PaddleFormers' processor outputs for ERNIEKit's pieces of each, with thinking
    off and on."""
    folder = tmp_path_factory.mktemp("erniekit")
    make_ernie_tokenizer(folder / "tokenizer")
    cases = records(folder)
    (folder / "data.jsonl").write_text("\n".join(json.dumps(r) for r in cases) + "\n")
    for thinking in (False, True):
        pieces = [[[k, str(folder / v) if k == "image" else [str(folder / f) for f in v] if k == "video" else v,
                    *rest] for k, v, *rest in erniekit_pieces(r, thinking)] for r in cases]
        (folder / f"cases_{thinking}.json").write_text(json.dumps([{"budget": BUDGET, "pieces": p} for p in pieces]))
        (folder / f"out_{thinking}").mkdir()
        paddleformers("pieces", folder / "tokenizer", folder / f"cases_{thinking}.json", folder / f"out_{thinking}",
                      cwd=folder)
    return folder, cases


def encoder_for(folder, *overrides):
    cfg = ernie_config(folder, *(f"data.{k}={v}" for k, v in BUDGET.items()), *overrides)
    return cfg, Encoder(build_tokenizer(cfg), cfg.model, 4096, "skip", 448, Counter(), cfg.data.pixel_budget,
                        cfg.data.video_budget)


@pytest.mark.slow
@pytest.mark.parametrize("thinking", [False, True], ids=["thinking_off", "thinking_on"])
def test_erniekit_records_encode_as_erniekit_does(erniekit_side, thinking):
    """Ten records (an image; three images, two at one text; an image before an answer; a skipped turn; frames as a
    video; a system text; a thinking answer; tool calls, as objects and as JSON text, and tool outputs; the text
    SFT shape with a system and a label): token ids, token types, 3D positions, grids, pixels and the trained
    tokens equal ERNIEKit's pieces through PaddleFormers' processor, element for element."""
    folder, cases = erniekit_side
    cfg, encoder = encoder_for(folder, f"data.enable_thinking={str(thinking).lower()}")
    data = source_dataset(str(folder / "data.jsonl"), cfg.data)
    for n in range(len(cases)):
        ours, ref = encoder(data[n]), np.load(folder / f"out_{thinking}" / f"{n}.npz")
        where = f"record {n}: {encoder.tok.decode(ours.input_ids)!r}"
        np.testing.assert_array_equal(ours.input_ids, ref["input_ids"], err_msg=where)
        np.testing.assert_array_equal(ours.token_type_ids, ref["token_type_ids"], err_msg=where)
        np.testing.assert_array_equal(ours.position_ids, ref["position_ids"], err_msg=where)
        np.testing.assert_array_equal(ours.target, ref["trained"], err_msg=where)
        assert_same_visuals(ours, ref, where)


def test_erniekits_facts_hold_on_an_image_and_a_non_thinking_answer(tmp_path):
    """What ERNIEKit's source shows, checked directly: an answer without think tags gets the empty think block
    (not trained on); image start, placeholders and end carry token type 1; the image tokens share one t
    position and take the merged grid's rows and columns; text resumes at the largest plus one."""
    make_ernie_tokenizer(tmp_path / "tokenizer")
    image = picture(tmp_path, "a.png", 56, 84, 0)  # a 4 x 6 patch grid: 2 x 3 merged
    record = {"image_info": [{"image_url": image}], "text_info": [{"text": "What?", "tag": "mask"},
                                                                    {"text": "A cat.", "tag": "no_mask"}]}
    (tmp_path / "d.jsonl").write_text(json.dumps(record) + "\n")
    cfg, encoder = encoder_for(tmp_path, "data.enable_thinking=true")
    e = encoder(source_dataset(str(tmp_path / "d.jsonl"), cfg.data)[0])
    tok = encoder.tok
    start, end = tok.token_id("<|IMAGE_START|>"), tok.token_id("<|IMAGE_END|>")
    s, t = list(e.input_ids).index(start), list(e.input_ids).index(end)
    assert t - s - 1 == 6 and set(e.token_type_ids[s:t + 1]) == {1}
    p = e.position_ids[s + 1:t]
    assert set(p[:, 0]) == {s + 1} and sorted(set(p[:, 1])) == [s + 1, s + 2] and sorted(set(p[:, 2])) == \
        [s + 1, s + 2, s + 3]
    assert e.position_ids[t].tolist() == [s + 4] * 3 and e.position_ids[t + 1].tolist() == [s + 5] * 3
    trained = tok.decode(e.input_ids[e.target])
    assert trained == "A cat." + EOS
    assert tok.decode(e.input_ids).endswith("Assistant: " + EMPTY_THINK + "A cat." + EOS)


BAD = [
    ({"image_info": [{"image_url": "a.png", "matched_text_index": 2}],
      "text_info": [{"text": "Q", "tag": "mask"}, {"text": "A", "tag": "no_mask"}]}, "image_index_past_text"),
    ({"text_info": [{"text": "Q", "tag": "question"}, {"text": "A", "tag": "no_mask"}]}, "bad_tag"),
    ({"text_info": [{"text": "Q", "tag": "mask"}, {"text": "", "tag": "no_mask", "tool_calls": "{not json"}]},
     "bad_tool_call"),
    ({"text_info": [{"text": "Q", "tag": "mask"},
                    {"text": "", "tag": "no_mask", "tool_calls": [{"name": "f", "arguments": "{bad"}]}]},
     "bad_tool_call"),
    ({"text_info": [{"text": "Q", "tag": "mask"}, {"text": "<think>never closed. A", "tag": "no_mask"}]},
     "unclosed_think"),
    ({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A</think> <think>B"}]},
     "unclosed_think"),
    ({"text_info": [{"text": "A", "tag": "no_mask"}, {"text": "Q", "tag": "mask"}]}, "bad_turns"),
    ({"image_info": [{"image_url": "a.png", "matched_text_index": 2}],
      "text_info": [{"text": "Q", "tag": "mask"}, {"text": "A", "tag": "no_mask"}, {"text": "B", "tag": "no_mask"}]},
     "image_in_answer"),
    ({"src": ["a", "b"], "tgt": ["c"]}, "bad_turns"),
    ({"src": ["a"], "tgt": ["c"], "label": [1, 0]}, "bad_turns"),
    ({"src": ["a"], "tgt": ["  "]}, "empty_text"),
    ({"text_info": [{"text": "Q", "tag": "mask"}, {"text": "A", "tag": "no_mask", "label": 0}]}, "empty_text"),
    ({"text_info": [{"text": "Q", "tag": "mask"}, {"text": "A", "tag": "no_mask"}], "enable_thinking": "yes"},
     "bad_record"),
    # tools in chat messages
    ({"messages": [{"role": "user", "content": "Q"},
                   {"role": "assistant", "content": "A", "tool_calls": [{"name": "f", "arguments": "{no"}]}]},
     "bad_tool_call"),
    ({"messages": [{"role": "user", "content": "Q", "tool_calls": [{"name": "f", "arguments": {}}]},
                   {"role": "assistant", "content": "A"}]}, "bad_message"),
    ({"tools": 3, "messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]},
     "bad_record"),
]


def test_bad_erniekit_records_are_counted_skips_with_their_own_reasons(tmp_path):
    make_ernie_tokenizer(tmp_path / "tokenizer")
    picture(tmp_path, "a.png", 28, 28, 0)
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r, _ in BAD) + "\n")
    cfg, encoder = encoder_for(tmp_path)
    data = source_dataset(str(tmp_path / "d.jsonl"), cfg.data)
    for n, (record, reason) in enumerate(BAD):
        with pytest.raises(BadSample) as caught:
            encoder(data[n])
        assert caught.value.reason == reason, (record, str(caught.value))


def test_data_format_keeps_only_its_records_and_erniekit_needs_ernies_tokenizer(tmp_path):
    make_ernie_tokenizer(tmp_path / "tokenizer")
    rows = [{"text_info": [{"text": "Q", "tag": "mask"}, {"text": "A", "tag": "no_mask"}]},
            {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg, encoder = encoder_for(tmp_path, "data.format=erniekit")
    data = source_dataset(str(tmp_path / "d.jsonl"), cfg.data)
    assert encoder.tok.decode(encoder(data[0]).input_ids) == f"{BOS}User: Q\nAssistant: A{EOS}"
    with pytest.raises(BadSample, match="is a messages record, but data.format is erniekit") as caught:
        data[1]
    assert caught.value.reason == "wrong_format"
    plain = load_config(None, ["data.dataset=jsonl", f"data.train_path={tmp_path / 'd.jsonl'}"])
    bytes_encoder = Encoder(build_tokenizer(plain), plain.model, 256, "skip", 448, Counter())
    with pytest.raises(BadSample) as caught:
        bytes_encoder(source_dataset(str(tmp_path / "d.jsonl"), plain.data)[0])
    assert caught.value.reason == "needs_ernie_tokenizer"


def test_erniekit_records_without_an_ernie_tokenizer_stop_naming_the_fix_that_trains(tmp_path, capsys, monkeypatch):
    """Only ERNIEKit records, and no ERNIE tokenizer: the run stops with one line that says what to give it, and
    the overrides it names train the default model on them (bytes and ERNIE's pieces), each record encoded in
    ERNIE's layout."""
    import run_trainer

    monkeypatch.chdir(ROOT)  # the named tokenizer folder is the repository's
    record = {"system": "Be brief.", "src": ["Hi"], "tgt": ["Hello."], "label": [1]}
    (tmp_path / "d.jsonl").write_text(json.dumps(record) + "\n")
    run = ["--config", str(ROOT / "configs" / "vl_moe.yaml"), "data.dataset=jsonl",
           f"data.train_path={tmp_path / 'd.jsonl'}", "training.max_steps=1", "training.eval_steps=0",
           "logging.progress_bar=false"]
    assert run_trainer.main([*run, f"training.output_dir={tmp_path / 'out'}", "data.report_samples=0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("data error: the training data has no usable sample") and len(err.splitlines()) == 1
    assert "'needs_ernie_tokenizer': 1" in err and "training.model_name_or_path" in err
    fix = err.strip().removesuffix(".").rsplit(": ", 1)[1].split()
    assert fix == ["data.tokenizer_path=configs/tokenizers/ernie_bytes"]
    assert run_trainer.main([*run, *fix, f"training.output_dir={tmp_path / 'fixed'}"]) == 0
    report = json.loads((tmp_path / "fixed" / "data_report.json").read_text())
    shown = json.dumps(report)
    assert "<|begin_of_sentence|>" in shown and "Hello.<|end_of_sentence|>" in shown, shown[:2000]


# The Thinking model's chat template, written as a tokenizer folder's chat_template.jinja: another hand than the
# built-in template's (a macro, string tests), the same structure.
THINKING_JINJA = """{%- macro visual(part, n) -%}
{%- if part.type == 'image' -%}Picture {{ n }}:<|IMAGE_START|><|image@placeholder|><|IMAGE_END|>
{%- else -%}Video {{ n }}:<|VIDEO_START|><|video@placeholder|><|VIDEO_END|>{%- endif -%}
{%- endmacro -%}
{%- set count = namespace(image=0, video=0) -%}
{{- bos_token -}}
{%- for message in messages -%}
  {%- if message.role == 'system' -%}{{- message.content + '\n' -}}
  {%- elif message.role == 'user' -%}{{- 'User: ' -}}
    {%- if message.content is string -%}{{- message.content -}}
    {%- else -%}{%- for part in message.content -%}
      {%- if part.type == 'text' -%}{{- part.text -}}
      {%- elif part.type == 'image' -%}{%- set count.image = count.image + 1 -%}{{- visual(part, count.image) -}}
      {%- else -%}{%- set count.video = count.video + 1 -%}{{- visual(part, count.video) -}}{%- endif -%}
    {%- endfor -%}{%- endif -%}{{- '\n' -}}
  {%- else -%}{{- 'Assistant: ' -}}
    {%- set thinks = message.content.find('</think>') >= 0 -%}
    {%- if enable_thinking is defined and enable_thinking and not thinks -%}
      {{- '<think>\\n\\n</think>\\n\\n' -}}
    {%- endif -%}
    {{- message.content + eos_token -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- 'Assistant: ' -}}
  {%- if enable_thinking is defined and not enable_thinking -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}
{%- endif -%}"""


@pytest.mark.parametrize("thinking", [False, True], ids=["thinking_off", "thinking_on"])
def test_the_thinking_template_of_the_folder_and_the_built_in_one_give_the_same_samples(tmp_path, thinking):
    """Conversations with and without reasoning, multi-turn, an image: the folder's Thinking template and the
    built-in one render the same text and ids and train the same tokens; with thinking on an answer without
    reasoning opens with the empty think block, which is not trained on, and a record's own enable_thinking
    wins over data.enable_thinking."""
    make_ernie_tokenizer(tmp_path / "builtin")
    make_ernie_tokenizer(tmp_path / "folder", chat_template=None)
    (tmp_path / "folder" / "chat_template.jinja").write_text(THINKING_JINJA)
    picture(tmp_path, "a.png", 56, 56, 0)
    rows = [
        {"messages": [{"role": "user", "content": "Why?"},
                      {"role": "assistant", "content": "<think>Because.</think>It is so."}]},
        {"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text",
                                                                                         "text": "What?"}]},
                      {"role": "assistant", "content": "A square."}, {"role": "user", "content": "Sure?"},
                      {"role": "assistant", "content": "<think>Check.</think>Yes."}]},
        {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}],
         "enable_thinking": not thinking},
    ]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    encoded = {}
    for name in ("builtin", "folder"):
        cfg = load_config(None, [f"data.tokenizer_path={tmp_path / name}", "model.vocab_size=400",
                                 f"data.enable_thinking={str(thinking).lower()}"])
        tok = build_tokenizer(cfg)
        cfg = load_config(None, [f"data.tokenizer_path={tmp_path / name}", "model.vocab_size=400",
                                 f"model.im_patch_id={tok.placeholder_id()}",
                                 f"data.enable_thinking={str(thinking).lower()}"])
        encoder = Encoder(build_tokenizer(cfg), cfg.model, 1024, "skip", 448, Counter())
        data = source_dataset(str(tmp_path / "d.jsonl"), cfg.data)
        encoded[name] = [encoder(data[n]) for n in range(len(rows))]
    assert (tmp_path / "folder" / "chat_template.jinja").read_text() != ERNIE_VL_TEMPLATE
    for ours, theirs in zip(encoded["builtin"], encoded["folder"]):
        np.testing.assert_array_equal(ours.input_ids, theirs.input_ids)
        np.testing.assert_array_equal(ours.target, theirs.target)
    tok = encoder.tok
    second = encoded["folder"][1]
    text = tok.decode(second.input_ids)
    trained = tok.decode(second.input_ids[second.target])
    assert ("Assistant: " + EMPTY_THINK + "A square." in text) == thinking
    # the answer's first token may hold the space of "Assistant: " before it (it is trained: it overlaps the answer)
    assert trained.lstrip(" ") == "A square." + EOS + "<think>Check.</think>Yes." + EOS
    last = tok.decode(encoded["folder"][2].input_ids)
    assert (EMPTY_THINK in last) == (not thinking)  # the record's own setting


def test_the_fine_tune_config_carries_erniekits_sft_settings_to_the_optimizer(tmp_path):
    """configs/finetune_ernie45_vl_smoke.yaml trains 3 steps on a file mixing ERNIEKit's VL and text records,
    a chat and a caption; its ERNIEKit settings are what the optimizer holds: routers at 0.01 of the learning
    rate, the ViT frozen (and when trained, 0.9 with a layer decay of 0.9), beta2 0.95, no load-balance loss and
    a correction bias that does not move; the data report counts each record."""
    make_ernie_tokenizer(tmp_path / "tokenizer")
    image = picture(tmp_path, "a.png", 56, 56, 0)
    rows = [
        {"image_info": [{"image_url": image}], "text_info": [{"text": "What?", "tag": "mask"},
                                                             {"text": "A red square.", "tag": "no_mask"}]},
        {"src": ["Hello"], "tgt": ["Hi there!"]},
        {"images": [image], "messages": [{"role": "user", "content": "<image>Colour?"},
                                         {"role": "assistant", "content": "Red."}]},
        {"image": image, "text": "a red square"},
        {"text_info": [{"text": "Q", "tag": "nope"}]},
    ]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    tok = build_tokenizer(load_config(None, [f"data.tokenizer_path={tmp_path / 'tokenizer'}"]))
    overrides = [f"data.tokenizer_path={tmp_path / 'tokenizer'}", f"data.train_path={tmp_path / 'd.jsonl'}",
                 "data.max_seq_len=128", "model.vocab_size=400", f"model.im_patch_id={tok.placeholder_id()}",
                 "model.moe_use_aux_free=true", "training.max_steps=3", "training.eval_steps=0",
                 f"training.output_dir={tmp_path / 'out'}", "logging.progress_bar=false"]
    tr = Trainer(load_config(ROOT / "configs" / "finetune_ernie45_vl_smoke.yaml", overrides))
    t, m = tr.cfg.training, tr.cfg.model
    assert (t.moe_gate_lr_ratio, t.vit_lr_ratio, t.visual_ld, t.adam_beta2, t.freeze) == (0.01, 0.9, 0.9, 0.95,
                                                                                          ["vision"])
    assert (m.moe_aux_loss_lambda, m.moe_aux_free_update_coef) == (0.0, 0.0)
    ratios = {p.name: p.optimize_attr["learning_rate"] for p in tr.parts.optimizer._parameter_list}
    named = dict(tr.parts.model.stable_named_parameters())
    assert ratios[named["model.layers.1.mlp.gate.weight"].name] == 0.01
    assert ratios[named["model.norm.weight"].name] == 1.0
    assert not any(n.startswith("vision_model.") and not p.stop_gradient for n, p in named.items())
    assert tr.parts.optimizer._beta2 == 0.95
    bias = [m.moe_statics.e_score_correction_bias.numpy().copy() for m in tr.parts.model.moe_layers()]
    summary = tr.train()
    assert summary["steps"] == 3 and summary["data/bad_tag"] == 1
    for layer, before in zip(tr.parts.model.moe_layers(), bias):
        np.testing.assert_array_equal(layer.moe_statics.e_score_correction_bias.numpy(), before)
    report = json.loads((tmp_path / "out" / "data_report.json").read_text())
    assert report["samples_read"] == 5 and report["skipped"] == {"bad_tag": 1}
    assert report["records_per_source"] == {str(tmp_path / "d.jsonl"): 5}
    assert "[[" in report["first_sample"]["text"] and report["image_token_share"] > 0

    unfrozen = Trainer(load_config(ROOT / "configs" / "finetune_ernie45_vl_smoke.yaml",
                                   [*overrides, "training.freeze=[]", f"training.output_dir={tmp_path / 'vit'}"]))
    ratios = {p.name: p.optimize_attr["learning_rate"] for p in unfrozen.parts.optimizer._parameter_list}
    named = dict(unfrozen.parts.model.stable_named_parameters())
    depth = unfrozen.cfg.model.vision_config.depth
    assert ratios[named["vision_model.ln.weight"].name] == pytest.approx(0.9)
    assert ratios[named["vision_model.blocks.0.attn.qkv.weight"].name] == pytest.approx(0.9 * 0.9 ** depth)


def trained_runs(encoded, tok) -> list[str]:
    """The trained tokens, run by run, decoded (a run's first token may hold the space before it)."""
    runs, run = [], []
    for token, trained in zip(encoded.input_ids, encoded.target):
        if trained:
            run.append(int(token))
        elif run:
            runs, run = runs + [run], []
    return [tok.decode(r).lstrip(" ") for r in runs + ([run] if run else [])]


@pytest.mark.parametrize("thinking", [False, True], ids=["thinking_off", "thinking_on"])
def test_tool_calls_in_chat_messages_are_laid_out_as_erniekit_lays_them_out(tmp_path, thinking):
    """A chat with tools, an answer that calls one (OpenAI's form), the tool's output and the final answer:
    the built-in template writes ERNIEKit's text for the same conversation as an ERNIEKit record, and trains the
    call and the answers."""
    make_ernie_tokenizer(tmp_path / "tokenizer")
    kit = records(tmp_path)[6]
    call = kit["text_info"][1]["tool_calls"]
    chat = {"tools": kit["tools"], "messages": [
        {"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "", "tool_calls": call},
        {"role": "tool", "content": '{"sky": "sunny"}'}, {"role": "assistant", "content": "It is sunny."}]}
    (tmp_path / "d.jsonl").write_text(json.dumps(chat) + "\n")
    cfg, encoder = encoder_for(tmp_path, f"data.enable_thinking={str(thinking).lower()}")
    ours = encoder(source_dataset(str(tmp_path / "d.jsonl"), cfg.data)[0])
    # with thinking, a chat's answers each open with the empty block (ERNIEKit's records: the last one only)
    pieces = erniekit_pieces(kit, thinking=False)
    opened = EMPTY_THINK if thinking else ""
    assert encoder.tok.decode(ours.input_ids) == "".join(
        value + (opened if value == "\nAssistant: " else "") for _, value, _ in pieces)
    runs, run = [], ""
    for _, value, trained in pieces:
        if trained:
            run += value
        elif run:
            runs, run = runs + [run], ""
    assert trained_runs(ours, encoder.tok) == runs + ([run] if run else [])



def test_a_prompt_opens_the_turn_as_the_thinking_model_is_asked(tmp_path):
    """``--thinking`` / ``chat_template_kwargs``: thinking off opens the turn to generate with the empty think
    block, on or not given leaves it open; the folder's Thinking template and the built-in one agree."""
    from ernie_moe.data.formats.chat import Conversation
    from ernie_moe.data.formats.sample import Sample

    make_ernie_tokenizer(tmp_path / "builtin")
    make_ernie_tokenizer(tmp_path / "folder", chat_template=None)
    (tmp_path / "folder" / "chat_template.jinja").write_text(THINKING_JINJA)
    for name in ("builtin", "folder"):
        cfg = load_config(None, [f"data.tokenizer_path={tmp_path / name}", "model.vocab_size=400"])
        encoder = Encoder(build_tokenizer(cfg), cfg.model, 1024, "skip", 448, Counter())
        for thinking, ending in ((None, "Assistant: "), (True, "Assistant: "), (False, "Assistant: " + EMPTY_THINK)):
            messages = [{"role": "user", "content": [{"type": "text", "text": "Why?"}]}]
            prompt = encoder.prompt(Sample(conversation=Conversation(messages, enable_thinking=thinking)))
            assert encoder.tok.decode(prompt.input_ids) == f"{BOS}User: Why?\n{ending}", (name, thinking)


def test_frame_time_stamps_are_drawn_on_erniekit_frames_given_a_font(tmp_path):
    """ERNIEKit draws each frame's ``time_stamp`` on it (render_timestamp, the renderer checked against
    PaddleFormers' in test_ernie_inputs): with data.video_timestamp_font the frames carry their times; without,
    they stay as read. Frames with and without times in one video, or a time that is not seconds, are skips."""
    from support.ernie import a_font

    from ernie_moe.data.formats.video import draw_timestamp

    make_ernie_tokenizer(tmp_path / "tokenizer")
    frames = [picture(tmp_path, f"f{i}.png", 90, 120, i) for i in range(2)]

    def record(stamps):
        return {"image_info": [{"image_url": f, "image_type": "video", "video_uid": "v", **s}
                               for f, s in zip(frames, stamps)],
                "text_info": [{"text": "Q", "tag": "mask"}, {"text": "A", "tag": "no_mask"}]}

    rows = [record([{"time_stamp": 0.5}, {"time_stamp": 61.25}]), record([{"time_stamp": 1}, {}]),
            record([{"time_stamp": "1s"}, {"time_stamp": 2}])]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    font = a_font(tmp_path)
    cfg, _ = encoder_for(tmp_path, f"data.video_timestamp_font={font}")
    drawn = source_dataset(str(tmp_path / "d.jsonl"), cfg.data)[0].videos[0]
    plain = source_dataset(str(tmp_path / "d.jsonl"), encoder_for(tmp_path)[0].data)[0].videos[0]
    np.testing.assert_array_equal(drawn, np.stack([draw_timestamp(f, t, font) for f, t in zip(plain, (0.5, 61.25))]))
    assert (drawn != plain).any()
    data = source_dataset(str(tmp_path / "d.jsonl"), cfg.data)
    for n, reason in ((1, "bad_video"), (2, "bad_images")):
        with pytest.raises(BadSample) as caught:
            data[n]
        assert caught.value.reason == reason, str(caught.value)
