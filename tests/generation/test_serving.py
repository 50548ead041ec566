"""The OpenAI-compatible server, its chat page and the terminal chat, each used as people use them: the real
``openai`` client on the loopback address, Chromium typing into the page, a pseudo-terminal for the chat."""

import base64
import io
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from support.runs import ROOT, launch, start

from ernie_moe.generate import main as generate_main

PROMPT = "What is in the picture?"


def square_png(colour=(220, 30, 30)) -> bytes:
    image = np.full((56, 56, 3), 255, np.uint8)
    image[14:42, 14:42] = colour
    out = io.BytesIO()
    Image.fromarray(image).save(out, "PNG")
    return out.getvalue()


class PieceTokenizer:
    """Decodes ids as indices into a list of text pieces."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids):
        return "".join(self.pieces[i] for i in ids)


def stream_of(pieces, stop):
    from ernie_moe.serving.chat_model import TextStream

    sent = []
    stream = TextStream(PieceTokenizer(pieces), stop, sent.append)
    stopped_at = next((n for n in range(1, len(pieces) + 1) if stream(list(range(n)))), None)
    return stream.finish(), sent, stopped_at


def test_the_text_stream_holds_back_what_may_start_a_stop_string_and_cuts_before_it():
    text, sent, stopped_at = stream_of(["Hello", " wor", "ld", "\n", "Us", "er", ": more"], ("\nUser",))
    assert (text, stopped_at) == ("Hello world", 6) and sent == ["Hello", " wor", "ld"]
    # a held-back start that does not become the stop string goes out with what follows it
    text, sent, stopped_at = stream_of(["a", "\n", "Us", "ed"], ("\nUser",))
    assert (text, stopped_at, sent) == ("a\nUsed", None, ["a", "\nUsed"])
    # a character still incomplete (U+FFFD) waits for its last byte
    text, sent, _ = stream_of(["ab", "\ufffd", "\u00e9"], ())
    assert sent == ["ab", "\ufffd\u00e9"] and "".join(sent) == text


def test_requests_are_checked_field_by_field():
    from ernie_moe.serving.openai_api import ApiError, Limits, parse_request

    def parse(**fields):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
        return parse_request(body, "m", Limits(max_tokens=64), None, 10 ** 6)

    request = parse(max_completion_tokens=5, stop="\n", temperature=0.5, top_p=0.9, seed=3)
    assert request.sampling.max_new_tokens == 5 and request.sampling.stop == ("\n",) and not request.stream
    assert (request.sampling.temperature, request.sampling.top_p, request.sampling.seed) == (0.5, 0.9, 3)
    assert parse().sampling.max_new_tokens == 64  # the server's --max-tokens is the default
    # the Thinking model's switch, as vLLM takes it; else the server's --thinking
    assert parse().conversation.enable_thinking is None
    assert parse(chat_template_kwargs={"enable_thinking": False}).conversation.enable_thinking is False
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert parse_request(body, "m", Limits(), None, 10 ** 6, thinking=True).conversation.enable_thinking is True
    bad = [({"temperature": "hot"}, "temperature"), ({"top_p": 0}, "top_p"), ({"stream": "yes"}, "stream"),
           ({"max_tokens": 65}, "max_tokens"), ({"seed": -1}, "seed"), ({"stop": [""]}, "stop"),
           ({"messages": [{"role": "tool", "content": "x"}]}, "messages"), ({"messages": []}, "messages"),
           ({"model": None}, "model"), ({"chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs"),
           ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs")]
    asked = parse(logprobs=True, top_logprobs=3, return_token_ids=True, return_routed_experts=True)
    assert asked.sampling.logprobs == 3 and asked.return_token_ids and asked.sampling.routes
    assert parse(logprobs=True).sampling.logprobs == 0 and parse().sampling.logprobs is None
    bad += [({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
            ({"logprobs": "yes"}, "logprobs"), ({"logprobs": True, "stream": True}, "logprobs"),
            ({"return_token_ids": True, "stream": True}, "return_token_ids"),
            ({"return_routed_experts": 1}, "return_routed_experts")]
    for fields, param in bad:
        with pytest.raises(ApiError) as err:
            parse(**fields)
        assert err.value.status == 400 and err.value.param == param, fields
    with pytest.raises(ApiError) as err:  # no --image-root: local paths are not read
        parse(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "/etc/hosts"}}]}])
    assert "--image-root" in str(err.value)
    with pytest.raises(ApiError) as err:
        parse(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}])
    assert "no downloads" in str(err.value)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the model folder, the server's base URL, the image folder): a captioning model with a multi-token prediction
    layer trained for 40 steps, served on a free port (drafting with that layer, which a CPU does not by default)
    with local images read from one folder."""
    root = tmp_path_factory.mktemp("served")
    out, _ = launch(root, 1, "training.max_steps=40", "training.eval_steps=0", "data.num_eval_samples=0",
                    "model.num_nextn_predict_layers=1")
    images = root / "images"
    images.mkdir()
    (images / "square.png").write_bytes(square_png())
    later: list[str] = []
    process, found = start([sys.executable, "-m", "ernie_moe.serve", "--model", str(out / "final_model"), "--port",
                            "0", "--served-name", "tiny", "--image-root", str(images), "--max-request-mb", "1",
                            "--max-images", "2", "--max-tokens", "32", "--draft-tokens", "1"], root,
                           r"on (http://\S+) ", later)
    yield out / "final_model", found[1], images
    process.terminate()  # kill's SIGTERM: the server stops with one line, not Paddle's C++ error block
    assert process.wait(timeout=60) == 0
    while not later:  # the drain thread appends once the pipe closes
        time.sleep(0.05)
    assert "stopped (SIGTERM)" in later[0] and "Error" not in later[0], later[0][-3000:]


@pytest.fixture
def client(served):
    from openai import OpenAI

    return OpenAI(base_url=f"{served[1]}/v1", api_key="unused", max_retries=0, timeout=300)


def generated(capsys, folder, *args) -> str:
    assert generate_main(["--model", str(folder), "--max-new-tokens", "12", *args]) == 0
    return capsys.readouterr().out.rstrip("\n")


def ask(client, content, max_tokens=12, **options):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                          max_tokens=max_tokens, **options)


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


@pytest.mark.slow
def test_answers_equal_generates_greedy_answers_for_text_and_an_image(served, client, capsys):
    """The server's speculative answers are those of plain greedy decoding (``generate --draft-tokens 0``), its
    drafts counted in the usage as OpenAI counts predicted outputs."""
    folder, _, images = served
    text = ask(client, PROMPT)
    assert text.choices[0].message.content == generated(capsys, folder, "--prompt", PROMPT, "--draft-tokens", "0")
    assert text.usage.completion_tokens > 0 and text.usage.prompt_tokens > 0
    drafts = text.usage.completion_tokens_details
    assert drafts.accepted_prediction_tokens + drafts.rejected_prediction_tokens >= text.usage.completion_tokens // 2
    # the image as a data URL and as a path under --image-root: the answer generate gives for that image
    expected = generated(capsys, folder, "--prompt", PROMPT, "--image", str(images / "square.png"), "--draft-tokens",
                         "0")
    for source in (data_url(square_png()), "square.png"):
        answer = ask(client, [{"type": "image_url", "image_url": {"url": source}}, {"type": "text", "text": PROMPT}])
        assert answer.choices[0].message.content == expected, source
    assert [m.id for m in client.models.list().data] == ["tiny"]


@pytest.mark.slow
def test_log_probabilities_token_ids_and_routes_are_the_models_at_the_served_weights(served, client):
    """``logprobs`` / ``top_logprobs`` as the API defines them, the sampled ids (``return_token_ids``) and the
    experts each position went to in every MoE layer (``return_routed_experts``): the same answer as without them,
    each token's log-probability equal to a forward of the prompt and the answer through the model at the served
    weights, as the trainer computes it (the answer's tokens as labels), and the routes those of that forward,
    text positions in the text pool."""
    from ernie_moe.data import collate
    from ernie_moe.generation.decoding import log_softmax
    from ernie_moe.moe.replay import NOT_RECORDED, moe_layer_ids, recording, routes_of_forward
    from ernie_moe.serving.chat_model import ChatModel
    from ernie_moe.serving.openai_api import Limits, parse_request
    from ernie_moe.training.rollouts import answer_row

    folder = served[0]
    plain = ask(client, PROMPT)
    answer = ask(client, PROMPT, logprobs=True, top_logprobs=3,
                 extra_body={"return_token_ids": True, "return_routed_experts": True})
    choice = answer.choices[0]
    assert choice.message.content == plain.choices[0].message.content
    ids, content = choice.model_extra["token_ids"], choice.logprobs.content
    assert len(ids) == len(content) >= answer.usage.completion_tokens > 0
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob
               for t in content)
    assert all(t.top_logprobs[0].token == t.token for t in content)  # greedy: the most likely, every step
    chat = ChatModel(folder)
    request = parse_request({"model": "tiny", "messages": [{"role": "user", "content": PROMPT}]}, "tiny", Limits(),
                            None, 10 ** 6)
    prompt = chat.encode(request.conversation, [])
    start = len(prompt) - 1  # the position whose label is the answer's first token
    batch = collate([answer_row(prompt, ids, len(prompt) + len(ids), chat.tokenizer.pad_id)])
    chat.model.eval()
    with recording(chat.model) as records:
        logits = chat.model(batch, return_logits=True).logits.numpy()[0]
    expected = [log_softmax(logits[start + i], 1.0)[token] for i, token in enumerate(ids)]
    np.testing.assert_allclose([t.logprob for t in content], expected, rtol=0, atol=2e-5)
    assert [t.token for t in content] == [chat.tokenizer.decode([i]) for i in ids]
    sent = choice.model_extra["routed_experts"]
    routes = np.frombuffer(base64.b64decode(sent["data"]), "<i2").reshape(sent["shape"])
    layers, length = moe_layer_ids(chat.cfg), len(prompt) + len(ids)
    assert routes.shape == (len(layers), length, chat.cfg.moe_k) and sent["pools"] == {"text": [0, 4], "vision": [4, 8]}
    forward = routes_of_forward(records, 0, layers, 1, length, chat.cfg.moe_k)[0]
    np.testing.assert_array_equal(routes[:, :-1], forward[:, :-1])  # the last answer token: read by no forward
    assert (routes[:, -1] == NOT_RECORDED).all() and ((routes[:, :-1] >= 0) & (routes[:, :-1] < 4)).all()


@pytest.mark.slow
def test_streamed_chunks_join_to_the_whole_answer(client):
    whole = ask(client, PROMPT)
    chunks = list(ask(client, PROMPT, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert len(chunks) > 3  # piece by piece, not one block
    # a stop string cuts the answer before it, streamed or not
    cut = whole.choices[0].message.content.split(" ")[1]
    stopped = ask(client, PROMPT, stop=[" " + cut])
    assert stopped.choices[0].message.content == whole.choices[0].message.content.split(" " + cut)[0]
    assert stopped.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in ask(client, PROMPT, stop=[" " + cut], stream=True))
    assert streamed == stopped.choices[0].message.content


@pytest.mark.slow
def test_bad_requests_get_the_apis_errors_and_the_server_goes_on(served, client):
    import openai

    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 404 and err.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, [{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}])
    assert err.value.code == "invalid_image" and "cannot be decoded" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, [{"type": "image_url", "image_url": {"url": "../../etc/passwd"}}])
    assert "outside the server's --image-root" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:  # 4096 positions: this prompt takes more
        ask(client, "square " * 5000)
    assert err.value.code == "context_length_exceeded" and "4096" in err.value.message
    with pytest.raises(openai.APIStatusError) as err:  # over --max-request-mb 1
        ask(client, "x" * (2 * 2 ** 20))
    assert err.value.status_code == 413
    with pytest.raises(openai.BadRequestError) as err:  # --max-images 2
        ask(client, [{"type": "image_url", "image_url": {"url": "square.png"}}] * 3 + [{"type": "text", "text": "a"}])
    assert err.value.code == "too_many_images"
    for bad in ({"temperature": 3}, {"max_tokens": 33}, {"n": 2}, {"stop": ["a", "b", "c", "d", "e"]}):
        with pytest.raises(openai.BadRequestError):
            ask(client, PROMPT, **bad)
    # bodies no client library sends: nested past what JSON's reader survives, or deep inside a message, and an
    # image path with a NUL byte: 400s naming the fault, not 500s
    import urllib.error
    import urllib.request

    deep_content = {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}
    part = deep_content["messages"][0]["content"][0]
    for _ in range(40):
        part["text"] = {"text": part["text"]}
        part = part["text"]
    nul = {"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "square\u0000.png"}}]}]}
    for body, words in ((b"[" * 100_000 + b"]" * 100_000, "nested too deep"),
                        (json.dumps(deep_content).encode(), "nested more than 32 deep"),
                        (json.dumps(nul).encode(), "NUL byte")):
        request = urllib.request.Request(f"{served[1]}/v1/chat/completions", body, {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=60)
        assert err.value.code == 400 and words in json.loads(err.value.read())["error"]["message"]
    assert ask(client, PROMPT).choices[0].message.content  # still answering


HARNESS_CONCURRENCY = 32  # lmms-eval's openai_compatible model sends this many requests at once by default


@pytest.mark.slow
def test_concurrent_clients_as_a_harness_sends_them_are_all_answered_as_if_alone(served, client):
    """32 clients at once (lmms-eval's default), half of them streaming, none retrying: every one answered as
    alone, none refused (503) or reset at connect."""
    from openai import OpenAI

    prompts = (PROMPT, "Describe it.")
    alone = [ask(client, p).choices[0].message.content for p in prompts]
    answers = [None] * HARNESS_CONCURRENCY
    ready = threading.Barrier(HARNESS_CONCURRENCY)

    def one(i):
        other = OpenAI(base_url=f"{served[1]}/v1", api_key="unused", max_retries=0, timeout=600)
        ready.wait()  # all connect together
        try:
            if i % 2:
                answers[i] = "".join(c.choices[0].delta.content or "" for c in ask(other, prompts[i % 2],
                                                                                     stream=True))
            else:
                answers[i] = ask(other, prompts[0]).choices[0].message.content
        except Exception as err:  # noqa: BLE001 (the assertion below names it)
            answers[i] = err

    threads = [threading.Thread(target=one, args=(i,)) for i in range(HARNESS_CONCURRENCY)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == [alone[i % 2] for i in range(HARNESS_CONCURRENCY)]


@pytest.mark.slow
def test_the_chat_page_sends_typed_questions_with_an_uploaded_image_and_renders_the_streamed_answers(
        served, client, tmp_path):
    """Two turns typed into the page (Enter sends), the second with an image picked in its file input: the
    answers the API gives for the same conversation."""
    from support.devtools import Browser

    images = served[2]
    first = ask(client, PROMPT, max_tokens=32).choices[0].message.content  # the page asks for the server's default
    with_image = [{"type": "image_url", "image_url": {"url": data_url((images / "square.png").read_bytes())}},
                  {"type": "text", "text": "And this one?"}]
    second = client.chat.completions.create(model="tiny", messages=[
        {"role": "user", "content": PROMPT}, {"role": "assistant", "content": first},
        {"role": "user", "content": with_image}]).choices[0].message.content
    browser = Browser(served[1] + "/", tmp_path / "profile", width=1100, height=700)
    try:
        browser.wait_for("document.getElementById('model')?.textContent === 'tiny'")
        for turn, text in enumerate((PROMPT, "And this one?")):
            if turn == 1:
                browser.choose_file("#image", images / "square.png")
                browser.wait_for("document.getElementById('picked').textContent === 'square.png'")
            browser.evaluate("document.getElementById('prompt').focus()")
            browser.type(text)
            browser.press_enter()
            browser.wait_for(f"document.querySelectorAll('.assistant')[{turn}]?.dataset.state === 'done'")
        turns = browser.evaluate("[...document.querySelectorAll('.turn')].map(t => [t.className, t.textContent, "
                                 "t.querySelectorAll('img').length])")
        assert turns == [["turn user", PROMPT, 0], ["turn assistant", first, 0], ["turn user", "And this one?", 1],
                         ["turn assistant", second, 0]]
        browser.screenshot(tmp_path / "chat_page.png")
    finally:
        browser.close()
    pixels = np.asarray(Image.open(tmp_path / "chat_page.png").convert("RGB"))
    assert pixels.shape[:2] == (700, 1100) and len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50
    keep = os.environ.get("ERNIE_MOE_SCREENSHOTS")  # a folder to keep it in: the README's picture
    if keep:
        Path(keep, "chat_page.png").write_bytes((tmp_path / "chat_page.png").read_bytes())


@pytest.fixture(scope="module")
def fine_tuned(published, tmp_path_factory):
    """(the conversations' folder, a final model): two steps of the smoke config from the PaddleFormers model."""
    folder, base = published
    out = tmp_path_factory.mktemp("fine_tuned") / "run"
    run_smoke(out, f"training.model_name_or_path={base}", f"data.train_path={folder / 'data.jsonl'}",
              f"data.tokenizer_path={folder / 'tokenizer'}", "training.max_steps=2", "training.eval_steps=0",
              "data.eval_path=")
    return folder, out / "final_model"


def run_smoke(out, *overrides) -> dict:
    done = subprocess.run([sys.executable, "run_trainer.py", "--config", "configs/finetune_ernie45_vl_smoke.yaml",
                           f"training.output_dir={out}", "logging.progress_bar=false", *overrides], cwd=ROOT,
                          capture_output=True, text=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


class Terminal:
    """A command on a pseudo-terminal, read until its prompt comes back."""

    def __init__(self, argv, cwd):
        import pty

        self.fd, child = pty.openpty()
        self.process = subprocess.Popen(argv, cwd=cwd, stdin=child, stdout=child, stderr=child,
                                        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)))
        os.close(child)
        self.output = ""

    def until(self, prompt: str, count: int) -> str:
        """Everything written until ``prompt`` has appeared ``count`` times."""
        import select

        while self.output.count(prompt) < count:
            ready, _, _ = select.select([self.fd], [], [], 300)
            assert ready, "the chat stopped answering:\n" + self.output[-2000:]
            try:
                self.output += os.read(self.fd, 4096).decode(errors="replace")
            except OSError:  # the child closed the terminal
                raise AssertionError("the chat ended:\n" + self.output[-2000:]) from None
        return self.output

    def send(self, line: str) -> None:
        os.write(self.fd, (line + "\n").encode())


@pytest.mark.slow
def test_the_terminal_chat_keeps_the_conversation_and_saves_a_record_that_trains(fine_tuned, tmp_path, capsys):
    """Three turns, an image on the first and a video (its frame files) on the third."""
    folder, model = fine_tuned
    (tmp_path / "square.png").write_bytes(square_png())
    frames = [str(folder / f"clip{i}.png") for i in range(4)]  # a 4-frame video of the conversations' folder
    chat = Terminal([sys.executable, "-m", "ernie_moe.chat", "--model", str(model), "--max-new-tokens", "6"], tmp_path)
    chat.until("you> ", 1)
    lines = ["/image square.png", "What is this?", "And the colour?", "/video " + " ".join(frames), "What happens?",
             "/save talk.jsonl"]
    for n, line in enumerate(lines, start=2):
        chat.send(line)
        chat.until("you> ", n)
    chat.send("/quit")
    assert chat.process.wait(timeout=120) == 0
    answers = [a.strip() for a in re.findall(r"model> (.*?)\r\n", chat.output)]
    assert len(answers) == 3 and "(saved 6 messages to" in chat.output
    record = json.loads((tmp_path / "talk.jsonl").read_text())
    assert record["images"] == ["square.png"]
    assert record["videos"] == [[os.path.relpath(f, tmp_path) for f in frames]]
    assert [(m["role"], m["content"]) for m in record["messages"]] == [
        ("user", "<image>What is this?"), ("assistant", answers[0]), ("user", "And the colour?"),
        ("assistant", answers[1]), ("user", "<video>What happens?"), ("assistant", answers[2])]
    # the first answer is generate's for the same image and question: the chat encodes as training did
    assert generate_main(["--model", str(model), "--image", str(tmp_path / "square.png"), "--prompt",
                          "What is this?", "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out.strip() == answers[0]
    # the saved record is training data: a step on it alone, nothing skipped
    summary = run_smoke(tmp_path / "trained", f"training.model_name_or_path={model}",
                        f"data.train_path={tmp_path / 'talk.jsonl'}", f"data.tokenizer_path={folder / 'tokenizer'}",
                        "training.max_steps=1", "training.eval_steps=0", "data.eval_path=")
    assert summary["trained_steps"] == 1 and not any(k.startswith("data/skipped") for k in summary), summary


@pytest.mark.slow
def test_requests_that_wait_for_the_model_are_answered_together_each_as_if_alone(served):
    """Three requests (other prompts, one with an image, other lengths, one sampled, one streamed) come while the
    model is busy: its next turn answers the three side by side, each as it is answered alone. Of two waiting
    requests, the one whose stream raises (a client gone) ends alone, with its error; the other is answered."""
    from ernie_moe.data.formats.jsonl import parse_messages
    from ernie_moe.serving.chat_model import ChatModel, Sampling

    chat = ChatModel(served[0], draft_tokens=1)
    square = np.asarray(Image.open(io.BytesIO(square_png())).convert("RGB"))
    asks = [(PROMPT, [square], Sampling(max_new_tokens=12)), ("Describe it.", [], Sampling(max_new_tokens=6)),
            ("What colour is the shape at the top?", [], Sampling(max_new_tokens=12, temperature=1.0, seed=4))]
    prompts = []
    for text, images, _ in asks:
        content = [{"type": "image_url", "image_url": {"url": "square.png"}}] * len(images) + [
            {"type": "text", "text": text}]
        conversation, sources, _ = parse_messages([{"role": "user", "content": content}], [], [])
        assert len(sources) == len(images)
        prompts.append(chat.encode(conversation, images))
    assert len({len(p) for p in prompts}) == 3
    alone = [chat.reply(prompt, sampling) for prompt, (_, _, sampling) in zip(prompts, asks)]
    assert chat.turns == {1: 3}

    def together(calls):
        """Each (prompt, sampling, on_text) asked from its own thread while the model is held, then let go."""
        results = [None] * len(calls)

        def one(i, call):
            try:
                results[i] = chat.reply(*call)
            except Exception as err:  # noqa: BLE001
                results[i] = err

        threads = [threading.Thread(target=one, args=(i, call)) for i, call in enumerate(calls)]
        with chat.lock:
            for thread in threads:
                thread.start()
            while len(chat.queued) < len(calls):  # every request is waiting for the model
                threads[0].join(0.05)
        for thread in threads:
            thread.join()
        return results

    pieces = []
    answers = together([(prompt, sampling, pieces.append if i == 1 else None)
                        for i, (prompt, (_, _, sampling)) in enumerate(zip(prompts, asks))])
    assert chat.turns == {1: 3, 3: 1}
    assert answers == alone and "".join(pieces) == alone[1].text

    def gone(piece):
        raise BrokenPipeError("the client hung up")

    answers = together([(prompts[0], asks[0][2], gone), (prompts[2], asks[2][2], None)])
    assert chat.turns == {1: 3, 3: 1, 2: 1}
    assert isinstance(answers[0], BrokenPipeError) and answers[1] == alone[2]


@pytest.mark.slow
def test_a_full_queue_is_answered_503_and_a_client_that_hangs_up_stops_nothing(served):
    """In this process, so that the test can hold the model itself: with --max-queue 0, a request waiting for the
    model makes the next one a 503 (queue_full). A streaming client that closes its connection after the first
    event leaves the server answering the next request."""
    import socket

    import openai
    from openai import OpenAI

    from ernie_moe.serving.chat_model import ChatModel
    from ernie_moe.serving.openai_api import Limits
    from ernie_moe.serving.server import ChatServer

    server = ChatServer(("127.0.0.1", 0), ChatModel(served[0]), "tiny", Limits(max_tokens=32, max_queue=0), None,
                        log_requests=False)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
    try:
        first = []
        with server.chat.lock:  # the model is busy: the first request waits for it
            waiting = threading.Thread(target=lambda: first.append(ask(client, PROMPT)))
            waiting.start()
            while server.waiting < 1:  # the server counts it before it waits
                waiting.join(0.05)
            with pytest.raises(openai.APIStatusError) as err:
                ask(client, PROMPT)
            assert err.value.status_code == 503 and err.value.code == "queue_full"
        waiting.join()
        assert first[0].choices[0].message.content  # answered once the model was free
        # a streaming client that reads the first event and hangs up
        body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "stream": True})
        with socket.create_connection(("127.0.0.1", port)) as raw:
            raw.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
            received = b""
            while b"data: " not in received:  # the headers, then the first event
                chunk = raw.recv(4096)
                assert chunk, received
                received += chunk
        while server.waiting:  # the abandoned answer ends at its next write (or at its last token)
            time.sleep(0.05)
        assert ask(client, PROMPT).choices[0].message.content == first[0].choices[0].message.content
    finally:
        server.shutdown()
        server.server_close()


def control(base: str, route: str, body: dict | None = None, method: str = "POST") -> tuple[int, dict]:
    """A rollout-engine route of the server: (status, its JSON)."""
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"{base}{route}", data, {"Content-Type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=300) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.mark.slow
def test_a_trainer_pauses_the_server_and_gives_it_new_weights_in_four_phases(served, tmp_path, capsys):
    """vLLM's routes, driven as a trainer drives a rollout engine: a folder of safetensors staged (each tensor
    checked; a tensor of another shape refused by name, leaving the model and its version as they were), applied at
    the finish only while paused; a request that comes during the pause waits and is answered after the resume by
    the new weights, with the policy version it was sampled at."""
    from safetensors.numpy import load_file, save_file

    folder = served[0]
    updates = tmp_path / "updates"
    updates.mkdir()
    other, _ = launch(tmp_path, 1, "training.max_steps=40", "training.eval_steps=0", "data.num_eval_samples=0",
                      "model.num_nextn_predict_layers=1", "training.seed=7", name="other")
    shutil.copytree(other / "final_model", updates / "new")
    shutil.copytree(other / "final_model", updates / "bad")  # one of its tensors of another shape
    weight_map = json.loads((updates / "bad" / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.embed_tokens.weight"
    shard = updates / "bad" / weight_map[name]
    save_file({**load_file(str(shard)), name: np.zeros([3], np.float32)}, str(shard))
    process, found = start([sys.executable, "-m", "ernie_moe.serve", "--model", str(folder), "--port", "0",
                            "--served-name", "tiny", "--weight-updates", str(updates), "--max-tokens", "32"],
                           tmp_path, r"on (http://\S+) ")
    base = found[1]
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
    old, new = (generated(capsys, f, "--prompt", PROMPT, "--draft-tokens", "0")
                for f in (folder, other / "final_model"))
    assert old != new
    first = ask(client, PROMPT)
    assert first.choices[0].message.content == old and first.model_extra["policy_version"] == 0
    assert control(base, "/start_weight_update")[0] == 409  # before the transfer is set up
    assert control(base, "/init_weight_transfer_engine", {"init_info": {"backend": "nccl"}})[0] == 400
    assert control(base, "/init_weight_transfer_engine", {"init_info": {"backend": "folder"}}) == \
        (200, {"backend": "folder"})
    assert control(base, "/start_weight_update", {})[0] == 200
    status, refused = control(base, "/update_weights", {"update_info": {"path": "bad"}})
    assert status == 400 and name in refused["error"]["message"] and "shape [3]" in refused["error"]["message"]
    assert control(base, "/update_weights", {"update_info": {"path": "../"}})[0] == 400  # not under the folder
    status, staged = control(base, "/update_weights", {"update_info": {"path": "new"}})
    assert status == 200 and staged["staged"] > 10
    assert control(base, "/finish_weight_update")[0] == 409  # not paused: nothing applied
    assert ask(client, PROMPT).choices[0].message.content == old
    assert control(base, "/pause?mode=later")[0] == 400
    assert control(base, "/pause?mode=wait") == (200, {"is_paused": True, "mode": "wait"})
    waiting: list = []
    asker = threading.Thread(target=lambda: waiting.append(ask(client, PROMPT)))
    asker.start()
    while control(base, "/is_paused", method="GET")[1]["waiting"] < 1:  # the request has come and waits
        time.sleep(0.05)
    assert not waiting
    assert control(base, "/finish_weight_update") == (200, {"policy_version": 1, "tensors": staged["staged"]})
    assert control(base, "/resume") == (200, {"is_paused": False})
    asker.join()
    assert waiting[0].choices[0].message.content == new and waiting[0].model_extra["policy_version"] == 1
    assert control(base, "/is_paused", method="GET")[1] == {"is_paused": False, "waiting": 0, "policy_version": 1}
    process.terminate()
    assert process.wait(timeout=60) == 0


@pytest.mark.slow
def test_a_pause_keeps_a_turn_between_two_tokens_or_aborts_it(served):
    """In the process (no timing): a pause with ``keep`` returns once the answer in flight waits between two tokens
    and it goes on at the resume to the answer it would have given; ``abort`` ends it at its next token."""
    from ernie_moe.serving.chat_model import ChatModel, Sampling
    from ernie_moe.serving.openai_api import Limits, parse_request

    chat = ChatModel(served[0], draft_tokens=0)
    request = parse_request({"model": "m", "messages": [{"role": "user", "content": PROMPT}]}, "m", Limits(), None,
                            10 ** 6)
    prompt = chat.encode(request.conversation, [])
    whole = chat.reply(prompt, Sampling(max_new_tokens=8))
    assert whole.completion_tokens >= 2 and whole.finish_reason in ("stop", "length")
    for mode in ("keep", "abort"):
        first, go, replies = threading.Event(), threading.Event(), []

        def on_text(piece, first=first, go=go):
            if not first.is_set():
                first.set()
                go.wait()  # the answer holds here, after its first token, until the pause is under way

        def answer(replies=replies, on_text=on_text):
            replies.append(chat.reply(prompt, Sampling(max_new_tokens=8), on_text))

        answering = threading.Thread(target=answer)
        answering.start()
        first.wait()
        pausing = threading.Thread(target=chat.pause, args=(mode,))
        pausing.start()
        with chat.turn:  # the pause is in force before the answer goes on
            chat.turn.wait_for(lambda mode=mode: chat.paused == mode)
        go.set()
        pausing.join()  # keep: returns once the turn is parked; abort: once it has ended
        if mode == "keep":
            assert chat.parked and not replies
            chat.resume()
            answering.join()
            assert (replies[0].text, replies[0].finish_reason) == (whole.text, whole.finish_reason)
        else:
            answering.join()
            chat.resume()
            assert replies[0].finish_reason == "abort" and replies[0].completion_tokens < whole.completion_tokens
            assert whole.text.startswith(replies[0].text)
