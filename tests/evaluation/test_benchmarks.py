"""Benchmarks in the field's formats: each reader (bad rows counted), each answer-extraction rule and metric on
hand-written answers, where the harnesses disagree, and the figures (CircularEval, categories)."""

import base64
import io
import json
import os
import shutil

import numpy as np
import pytest
from PIL import Image

from ernie_moe.data import DataError
from ernie_moe.evaluation import read_benchmark
from ernie_moe.evaluation.answers import (
    can_infer,
    eval_open,
    extract_numbers,
    parse_multi_choice_response,
    parse_open_response,
)
from ernie_moe.evaluation.formats import Item
from ernie_moe.evaluation.metrics import anls, levenshtein, ocrbench_hit, relaxed_accuracy, relaxed_correctness
from ernie_moe.evaluation.scoring import figures, judge, prompt_text, user_content

ABCD = {"A": "red", "B": "green", "C": "blue", "D": "yellow"}


def png_base64(color=(200, 30, 30), size=28) -> str:
    buffer = io.BytesIO()
    Image.fromarray(np.full((size, size, 3), color, np.uint8)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


# -- VLMEvalKit's can_infer --------------------------------------------------------------------------------

@pytest.mark.parametrize("reply, letter", [
    ("B", "B"),
    ("(C)", "C"),
    ("The answer is D.", "D"),
    ("B. green", "B"),  # the letter stands alone once, among the last four words
    ("A B", None),  # two letters named: undecided, and no option's text is in it either
    ("B is what I would say after looking closely at it", None),  # the letter is too early (index 0 of 10 words)
    ("I looked at the image and it is B", "B"),
    ("it is blue", "C"),  # no letter: the one option whose text the reply holds
    ("red or green", None),  # two options' texts
    ("blue " * 20, None),  # over twice the options' texts in length: no text match
    ("Cannot determine the answer", "Z"),
    ("Z", "Z"),
])
def test_vlmevalkit_can_infer(reply, letter):
    assert can_infer(reply, dict(ABCD)) == letter


def test_can_infer_reads_the_last_four_words_as_the_code_does():
    """``splits.index(ch) > len(splits) - 5``: the letter must be one of the last four words."""
    assert can_infer("w w w w B w w w", dict(ABCD)) == "B"  # index 4 of 8 > 3
    assert can_infer("w w w B w w w w", dict(ABCD)) is None  # index 3 of 8: not > 3


# -- MMMU's parsers ----------------------------------------------------------------------------------------

MMMU_OPTIONS = {"A": "Paris", "B": "London", "C": "Rome", "D": "Berlin"}


@pytest.mark.parametrize("reply, letter", [
    ("(B)", "B"),
    ("The answer is (A), not (C).", "C"),  # several bracketed: the last one
    ("C", "C"),
    ("I think C is right.", "C"),
    ("A or maybe D", "D"),  # letters between spaces: the last
    ("the capital of Italy is Rome of course", "C"),  # over five words: the option text
    ("It is an ELISA test", None),  # lmms-eval's copy reads 'A ' in 'ELISA ' as A; MMMU's rule finds no letter
    ("B. Paris is correct", None),  # lmms-eval's copy takes 'B.'; MMMU's finds no letter in four words
])
def test_mmmu_multi_choice_parsing(reply, letter):
    got = parse_multi_choice_response(reply, MMMU_OPTIONS, "validation_Art_1")
    if letter is None:  # MMMU then draws a letter at random: here seeded by the item's id, the same every time
        assert got in MMMU_OPTIONS
        assert got == parse_multi_choice_response(reply, MMMU_OPTIONS, "validation_Art_1")
    else:
        assert got == letter


def test_mmmu_draws_for_a_reply_without_a_letter_depend_on_the_item():
    draws = {parse_multi_choice_response("no idea", MMMU_OPTIONS, f"validation_Art_{i}") for i in range(40)}
    assert draws == set(MMMU_OPTIONS)


def test_mmmu_open_parsing_and_judgement():
    # MMMU's three patterns in turn; the plain one also finds a thousands group's tail and a mantissa's
    # integer part, as MMMU's regular expressions do
    assert extract_numbers("it costs 1,234 dollars, or 1.5e3, or -7.25") == ["1,234", "1.5e3", "234", "1", "-7.25"]
    parsed = parse_open_response("The area is 12.50 square metres")
    assert 12.5 in parsed and "12.50 square metres" in parsed
    assert eval_open(["12.5"], parsed)
    assert not eval_open(["13"], parsed)
    # the shortest tail after a key phrase of each sentence; '=' only in the last
    assert parse_open_response("x = 4") == [4.0]  # the tail after '=', a number, normalised once
    assert eval_open(["blue"], parse_open_response("Therefore the colour is blue"))
    # a one-letter gold answer is padded, so it does not match inside a word
    assert not eval_open(["a"], parse_open_response("it is cat"))
    assert eval_open(["a"], parse_open_response("the answer is a"))


# -- metrics -----------------------------------------------------------------------------------------------

def test_chartqa_relaxed_accuracy():
    assert relaxed_correctness("100", "104.9") and not relaxed_correctness("100", "105.1")
    assert relaxed_correctness("50%", "0.52")  # a percentage is divided by 100
    assert relaxed_correctness("0", "0") and not relaxed_correctness("0", "0.0")  # a zero gold: strings equal
    assert relaxed_correctness("Yes", "yes")
    # VLMEvalKit strips the prediction (followed here); lmms-eval does not, and scores this 0
    assert relaxed_accuracy(["yes"], "Yes\n") == 1.0
    assert relaxed_accuracy(["12", "twelve"], "Twelve") == 1.0


def test_anls_against_the_definition():
    assert levenshtein("kitten", "sitting") == 3 and levenshtein("", "abc") == 3
    assert anls(["abd"], "abc") == pytest.approx(2 / 3)
    # normalised lengths: trailing whitespace scores as the bare reply (lmms-eval and VLMEvalKit give 0.833)
    assert anls(["abd"], "abc  \n") == pytest.approx(2 / 3)
    assert anls(["ab"], "ac") == 0.5  # exactly the threshold counts
    assert anls(["abc"], "xyz") == 0.0  # below it: 0
    assert anls(["New  York"], "new york") == 1.0
    assert anls(["nope", "Paris"], "paris!") == pytest.approx(5 / 6)  # the best gold answer


def test_ocrbench_containment():
    assert ocrbench_hit(["STOP"], "The sign says stop.\n") == 1.0
    assert ocrbench_hit(["two words"], "two\nwords") == 1.0  # newlines read as spaces
    hme = "Handwritten Mathematical Expression Recognition"
    assert ocrbench_hit(["x ^ 2"], "x^2", hme) == 1.0  # spaces removed, case kept
    assert ocrbench_hit(["X^2"], "x^2", hme) == 0.0


# -- readers -----------------------------------------------------------------------------------------------

def write_tsv(path, header, rows):
    path.write_text("\t".join(header) + "\n" + "".join("\t".join(map(str, row)) + "\n" for row in rows))


def test_vlmevalkit_tsv_with_shared_images_and_bad_rows(tmp_path):
    header = ["index", "question", "hint", "A", "B", "C", "D", "answer", "category", "l2-category", "image"]
    image = png_base64()
    rows = [
        [0, "What colour?", "", "red", "green", "blue", "yellow", "A", "colour", "perception", image],
        [1, "Which one?", "look", "red", "green", "", "", "B", "colour", "perception", "0"],  # the image of row 0
        [2, "Bad answer", "", "red", "green", "", "", "C", "colour", "perception", image],  # C is no option
        [3, "Lost image", "", "red", "green", "", "", "A", "colour", "perception", "77"],  # no row 77
        [4, "", "", "red", "green", "", "", "A", "colour", "perception", image],  # no question
    ]
    write_tsv(tmp_path / "mmstar.tsv", header, rows)
    bench = read_benchmark(tmp_path / "mmstar.tsv", "mcq")
    assert [item.id for item in bench.items] == ["0", "1"]
    assert bench.items[1].images == bench.items[0].images and bench.items[1].hint == "look"
    assert bench.items[1].options == {"A": "red", "B": "green"}
    assert dict(bench.skipped) == {"answer_not_an_option": 1, "missing_image": 1, "no_question": 1}
    assert prompt_text("mcq", bench.items[1]) == ("Hint: look\nQuestion: Which one?\nOptions:\nA. red\nB. green\n"
                                                  "Please select the correct answer from the options above. \n")
    assert user_content("mcq", bench.items[1]).startswith("<image>Hint: look")


def test_a_short_base64_image_is_an_image_and_a_missing_path_a_counted_skip(tmp_path):
    """A small PNG is under 200 base64 characters: read as the image, not as a file name; a path that names no
    file is skipped as a missing image when the question is asked."""
    from ernie_moe.data.formats.sample import BadSample
    from ernie_moe.evaluation.answering import item_sample

    tiny = png_base64(size=4)
    assert len(tiny) < 200
    header = ["index", "question", "A", "B", "answer", "image"]
    write_tsv(tmp_path / "b.tsv", header, [[0, "q", "x", "y", "A", tiny], [1, "q", "x", "y", "B", "9"]])
    bench = read_benchmark(tmp_path / "b.tsv", "mcq")
    assert bench.items[0].images == (base64.b64decode(tiny),) and dict(bench.skipped) == {"missing_image": 1}
    assert item_sample(bench, 0, 10 ** 6).images[0].shape == (4, 4, 3)
    rows = [{"question": "q", "answers": ["a"], "image": tiny}, {"question": "q", "answers": ["a"], "image": "no.png"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    bench = read_benchmark(tmp_path / "d.jsonl", "docvqa")
    assert item_sample(bench, 0, 10 ** 6).images[0].shape == (4, 4, 3)
    with pytest.raises(BadSample) as caught:
        item_sample(bench, 1, 10 ** 6)
    assert caught.value.reason == "missing_image"


def test_mmbench_circular_eval(tmp_path):
    header = ["index", "question", "A", "B", "C", "answer", "category", "image"]
    image = png_base64()
    write_tsv(tmp_path / "mmbench.tsv", header, [[7, "q1", "x", "y", "z", "B", "c1", image],
                                                 [8, "q2", "x", "y", "z", "C", "c2", image]])
    bench = read_benchmark(tmp_path / "mmbench.tsv", "mmbench")
    assert len(bench.items) == 6  # each question rotated over its three options
    first = [item for item in bench.items if item.group == "7"]
    assert [item.options["A"] for item in first] == ["x", "y", "z"]
    assert [item.answers[0] for item in first] == ["B", "A", "C"]  # 'y' wherever it went
    # a question counts only when every rotation is right
    scores = {i: 1.0 for i in range(6)}
    scores[4] = 0.0  # one rotation of the second question wrong
    result = figures("mmbench", bench.items, scores)
    assert result["score"] == 0.5 and result["count"] == 2
    assert result["category/c1"] == 1.0 and result["category/c2"] == 0.0
    assert figures("mcq", bench.items, scores)["score"] == pytest.approx(5 / 6)  # plain accuracy
    # a file holding the rotations (index + k x 1e6) is taken as it is
    write_tsv(tmp_path / "rotated.tsv", header, [[7, "q1", "x", "y", "z", "B", "c1", image],
                                                 [1000007, "q1", "y", "z", "x", "A", "c1", image]])
    rotated = read_benchmark(tmp_path / "rotated.tsv", "mmbench")
    assert [item.group for item in rotated.items] == ["7", "7"]


def test_mmmu_records(tmp_path):
    image = png_base64()
    records = [
        {"id": "validation_Art_1", "question": "Compare <image 1> and <image 2>.", "options": "['left', 'right']",
         "answer": "B", "question_type": "multiple-choice", "image_1": image, "image_2": png_base64((0, 0, 200))},
        {"id": "validation_Math_2", "question": "What is 2 + 2?", "options": "[]", "answer": "4",
         "question_type": "open"},
        {"id": "validation_Math_3", "question": "<image 9> broken", "options": "[]", "answer": "1",
         "question_type": "open"},
        {"id": "validation_Math_4", "question": "bad", "options": "[__import__('os')]", "answer": "A"},
    ]
    (tmp_path / "mmmu.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    bench = read_benchmark(tmp_path / "mmmu.jsonl", "mmmu")
    assert [item.category for item in bench.items] == ["Art", "Math"]
    assert len(bench.items[0].images) == 2 and bench.items[1].open
    assert dict(bench.skipped) == {"bad_image_marker": 1, "bad_options": 1}  # literal_eval runs no code
    assert user_content("mmmu", bench.items[0]) == ("Compare <image> and <image>.\nA. left\nB. right\n\n"
                                                    "Answer with the option's letter from the given choices directly.")
    assert judge("mmmu", bench.items[1], "2 + 2 = 4") == ("4.0", 1.0)
    assert judge("mmmu", bench.items[0], "(B)") == ("B", 1.0)


def test_vqa_sets_and_text_multiple_choice(tmp_path):
    image = png_base64()
    rows = [{"question": "What is the total?", "answer": "['120', '120.0']", "image": image, "type": "human_test"},
            {"question": "Where?", "answers": ["Paris"], "image": {"bytes": base64.b64decode(image)}},
            {"question": "Nothing", "answers": [], "image": image}]
    (tmp_path / "chartqa.jsonl").write_text("".join(json.dumps(r, default=str) + "\n" for r in rows[::2]))
    chart = read_benchmark(tmp_path / "chartqa.jsonl", "chartqa")
    assert chart.items[0].answers == ("120", "120.0") and dict(chart.skipped) == {"no_answer": 1}
    assert judge("chartqa", chart.items[0], " 123 ") == ("123", 1.0)
    assert prompt_text("chartqa", chart.items[0]) == ("What is the total?\nAnswer the question using a single "
                                                      "word or phrase.")
    (tmp_path / "images").mkdir()
    Image.fromarray(np.zeros((20, 20, 3), np.uint8)).save(tmp_path / "images" / "a.png")
    (tmp_path / "docvqa.json").write_text(json.dumps([{"question": "Who?", "answers": ["Ann"],
                                                      "image": "images/a.png", "questionId": 9}]))
    doc = read_benchmark(tmp_path / "docvqa.json", "docvqa")
    assert doc.items[0].images == (tmp_path / "images" / "a.png",) and doc.items[0].id == "9"
    # MMLU's headerless CSV: question, A-D, answer; the category from the file's name
    (tmp_path / "anatomy_test.csv").write_text('"Which, of these?",w,x,y,z,C\nbroken,w,x,y,z,E\n')
    mmlu = read_benchmark(tmp_path / "anatomy_test.csv", "text_mcq")
    assert [(i.question, i.answers, i.category) for i in mmlu.items] == [("Which, of these?", ("C",), "anatomy")]
    assert dict(mmlu.skipped) == {"answer_not_an_option": 1}
    assert judge("text_mcq", mmlu.items[0], "C") == ("C", 1.0)
    # C-Eval: a header
    (tmp_path / "ceval.csv").write_text("id,question,A,B,C,D,answer,explanation\n0,q,a,b,c,d,D,\n")
    assert read_benchmark(tmp_path / "ceval.csv", "text_mcq").items[0].answers == ("D",)


def parquet(path, rows) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for row in rows for k in row))  # every row every column, as datasets writes them
    pq.write_table(pa.Table.from_pylist([{k: row.get(k) for k in keys} for row in rows]), str(path))


def same_items(a, b) -> None:
    """Two readings of one benchmark: the same questions, answers, options, images (their bytes) and categories."""
    def read(image):
        return image if isinstance(image, bytes) else image.read_bytes()

    assert len(a.items) == len(b.items) > 0
    for x, y in zip(a.items, b.items):
        assert (x.question, x.answers, x.options, x.category) == (y.question, y.answers, y.options, y.category)
        assert [read(i) for i in x.images] == [read(i) for i in y.images]


def test_the_original_releases_read_as_the_harnesses_copies_of_them(tmp_path):
    """ChartQA's test_human.json (images in png/), DocVQA's and InfographicVQA's val_v1.0.json (an object whose
    data is the records; InfographicVQA names a bare image file), OCRBench.json (image_path, answers a string or
    a list, one beginning with '['), MMLU's parquet (choices, the answer's number): the same items as the layout
    read before."""
    png = base64.b64decode(png_base64())
    (tmp_path / "png").mkdir()
    (tmp_path / "png" / "c1.png").write_bytes(png)
    (tmp_path / "test_human.json").write_text(json.dumps([{"imgname": "c1.png", "query": "Total?", "label": "12"}]))
    (tmp_path / "chartqa.jsonl").write_text(json.dumps({"question": "Total?", "answer": "12",
                                                        "image": png_base64()}) + "\n")
    same_items(read_benchmark(tmp_path / "test_human.json", "chartqa"), read_benchmark(tmp_path / "chartqa.jsonl",
                                                                                      "chartqa"))
    (tmp_path / "documents").mkdir()
    (tmp_path / "documents" / "d.png").write_bytes(png)
    (tmp_path / "infographicsvqa_images").mkdir()
    (tmp_path / "infographicsvqa_images" / "i.jpeg").write_bytes(png)
    (tmp_path / "val_v1.0.json").write_text(json.dumps({"dataset_name": "docvqa", "dataset_version": "1.0", "data": [
        {"questionId": 7, "question": "Who?", "answers": ["Ann", "ann"], "image": "documents/d.png"}]}))
    (tmp_path / "infographicsVQA_val_v1.0.json").write_text(json.dumps({"dataset_name": "infographicVQA", "data": [
        {"questionId": 8, "question": "How many?", "answers": ["3"], "image_local_name": "i.jpeg"}]}))
    (tmp_path / "docvqa.jsonl").write_text(json.dumps({"question": "Who?", "answers": ["Ann", "ann"],
                                                       "image": png_base64()}) + "\n")
    same_items(read_benchmark(tmp_path / "val_v1.0.json", "docvqa"), read_benchmark(tmp_path / "docvqa.jsonl",
                                                                                    "docvqa"))
    info = read_benchmark(tmp_path / "infographicsVQA_val_v1.0.json", "infovqa")
    assert info.items[0].images == (tmp_path / "infographicsvqa_images" / "i.jpeg",) and info.items[0].id == "8"
    (tmp_path / "OCRBench_Images").mkdir()
    (tmp_path / "OCRBench_Images" / "o.png").write_bytes(png)
    (tmp_path / "OCRBench.json").write_text(json.dumps([
        {"dataset_name": "IIIT5K", "id": 0, "image_path": "OCRBench_Images/o.png", "question": "Text?",
         "answers": "STOP", "type": "Regular Text Recognition"},
        {"dataset_name": "FUNSD", "id": 20952, "image_path": "OCRBench_Images/o.png", "question": "Key?",
         "answers": ["[No. 5"], "type": "Key Information Extraction"},
        {"dataset_name": "FUNSD", "id": 3, "image_path": "OCRBench_Images/o.png", "question": "Mark?",
         "answers": "[Note", "type": "Key Information Extraction"}]))
    ocr = read_benchmark(tmp_path / "OCRBench.json", "ocrbench")
    assert [(i.id, i.answers, i.category) for i in ocr.items] == [
        ("0", ("STOP",), "Regular Text Recognition"), ("20952", ("[No. 5",), "Key Information Extraction"),
        ("3", ("[Note",), "Key Information Extraction")]
    assert dict(ocr.skipped) == {}
    parquet(tmp_path / "mmlu" / "test-00000-of-00001.parquet", [
        {"question": "Which, of these?", "subject": "anatomy", "choices": ["w", "x", "y", "z"], "answer": 2}])
    (tmp_path / "anatomy_test.csv").write_text('"Which, of these?",w,x,y,z,C\n')
    same_items(read_benchmark(tmp_path / "mmlu" / "test-00000-of-00001.parquet", "text_mcq"),
               read_benchmark(tmp_path / "anatomy_test.csv", "text_mcq"))


def mmmu_record(subject, n, question, options, answer, **images) -> dict:
    return {"id": f"validation_{subject}_{n}", "question": question, "options": str(options), "answer": answer,
            "question_type": "multiple-choice", **{k: {"bytes": base64.b64decode(v)} for k, v in images.items()}}


def test_mmmu_as_hugging_face_ships_it_is_one_benchmark_with_its_subjects_as_categories(tmp_path):
    red, blue = png_base64(), png_base64((0, 0, 200))
    parquet(tmp_path / "MMMU" / "Art" / "validation-00000-of-00001.parquet", [
        mmmu_record("Art", 1, "Which is <image 1>?", ["a", "b"], "A", image_1=red),
        # image options, and a marker repeated: each image once, where it first stands
        mmmu_record("Art", 2, "Which is red, <image 1> or <image 2>? Look at <image 1>.",
                    ["<image 1>", "<image 2>"], "A", image_1=red, image_2=blue)])
    parquet(tmp_path / "MMMU" / "Math" / "validation-00000-of-00001.parquet", [
        mmmu_record("Math", 1, "2 + 2?", ["3", "4"], "B")])
    for given in (tmp_path / "MMMU", tmp_path / "MMMU" / "*" / "validation-*.parquet"):
        bench = read_benchmark(given, "mmmu")
        assert bench.path == tmp_path / "MMMU" and bench.path.stem == "MMMU"
        assert [(i.id, i.category) for i in bench.items] == [
            ("validation_Art_1", "Art"), ("validation_Art_2", "Art"), ("validation_Math_1", "Math")]
    item = bench.items[1]
    assert [base64.b64encode(i).decode() for i in item.images] == [red, blue]
    assert user_content("mmmu", item) == ("Which is red, <image> or <image>? Look at <image 1>.\nA. <image 1>\n"
                                          "B. <image 2>\n\nAnswer with the option's letter from the given choices "
                                          "directly.")
    scores = {0: 1.0, 1: 0.0, 2: 1.0}
    assert figures("mmmu", bench.items, scores) == {"score": 2 / 3, "count": 3, "category/Art": 0.5,
                                                    "category/Math": 1.0}
    with pytest.raises(DataError, match="names no file"):
        read_benchmark(tmp_path / "MMMU" / "*" / "test-*.parquet", "mmmu")


def test_a_folder_or_glob_of_too_many_files_is_refused_before_it_is_listed_whole(tmp_path, monkeypatch):
    from ernie_moe.evaluation import formats

    monkeypatch.setattr(formats, "MAX_FILES", 2)
    for n in range(3):
        (tmp_path / f"part{n}.jsonl").write_text(json.dumps({"question": "q", "answer": "a", "image": "x.png"}) + "\n")
    for given in (tmp_path, tmp_path / "part*.jsonl"):
        with pytest.raises(DataError, match="names more than 2 files"):
            read_benchmark(given, "chartqa")


def test_vlmevalkits_missing_cells_are_missing_options_as_pandas_reads_them(tmp_path):
    header = ["index", "question", "A", "B", "C", "D", "answer", "image"]
    rows = [[0, "Which?", "red", "green", "N/A", "None", "B", png_base64()],
            [1, "Which?", "red", "NA", "", "", "A", png_base64()]]
    write_tsv(tmp_path / "na.tsv", header, rows)
    bench = read_benchmark(tmp_path / "na.tsv", "mcq")
    assert [i.options for i in bench.items] == [{"A": "red", "B": "green"}]
    assert dict(bench.skipped) == {"too_few_options": 1}


@pytest.mark.parametrize("name, content, kind, message", [
    ("missing.tsv", None, "mcq", "does not exist"),
    ("bench.xlsx", "x", "mcq", "read as its suffix says"),
    ("bench.tsv", "index\tquestion\n", "mcq", "holds no usable mcq question"),
    ("bench.jsonl", "{not json\n", "mmmu", "line 1 is not JSON"),
    ("bench.json", '{"a": 1}', "docvqa", "must hold a JSON list"),
    ("bench.json", '[{"q": "x", "answer": "1"}]', "chartqa", "a chartqa record has question \\(or query\\)"),
    ("bench.json", "[" * 100000, "docvqa", "cannot be read: it is nested too deep"),
    ("bench.jsonl", "[" * 100000 + "\n", "chartqa", "line 1 is nested too deep to read"),
    ("bench.jsonl", '{"question": "q"}\n', "nonsense", "unknown benchmark kind"),
    ("bench.jsonl", '{"id": "x", "question": "q", "answer": "1", "image": "a.png"}\n' * 2, "chartqa",
     "item id 'x' appears 2 times"),
])
def test_files_that_cannot_be_read_are_one_clear_error(tmp_path, name, content, kind, message):
    if content is not None:
        (tmp_path / name).write_text(content)
    with pytest.raises(DataError, match=message):
        read_benchmark(tmp_path / name, kind)


def test_figures_per_category_and_l2_category():
    items = [Item(str(i), "q", ("A",), dict(ABCD), category="c" + str(i % 2), l2_category="l") for i in range(4)]
    result = figures("mcq", items, {0: 1.0, 1: 0.0, 2: 1.0, 3: 1.0})
    assert result == {"score": 0.75, "count": 4, "category/c0": 1.0, "category/c1": 0.5, "l2_category/l": 0.75}
    assert figures("mcq", items, {}) == {}


# -- before and after --------------------------------------------------------------------------------------

def test_the_paired_interval_against_numpy():
    from ernie_moe.evaluation.report import paired, verdict

    rng = np.random.default_rng(0)
    before = {str(i): float(v) for i, v in enumerate(rng.integers(0, 2, 200))}
    after = {k: float(v if rng.random() < 0.8 else 1 - v) for k, v in before.items()}
    after.pop("0")  # a question one side did not answer is left out of the pairs
    d = np.array([after[k] - before[k] for k in sorted(after)])
    half = 1.959963984540054 * d.std(ddof=1) / np.sqrt(len(d))
    assert paired(before, after) == pytest.approx((199, d.mean(), d.mean() - half, d.mean() + half))
    assert verdict(-0.2, -0.01) == "regression" and verdict(0.01, 0.2) == "improvement"
    assert verdict(-0.1, 0.1) == "within noise"
    # one question, or too few equal differences, tell nothing
    assert paired({"a": 1.0}, {"a": 0.0})[2:] == (-1.0, 1.0)
    assert paired({str(i): 1.0 for i in range(5)}, {str(i): 0.0 for i in range(5)})[2:] == (-1.0, 1.0)
    assert verdict(*paired({str(i): 1.0 for i in range(20)}, {str(i): 0.0 for i in range(20)})[2:]) == "regression"


def results(scores: dict[str, list[float]]) -> dict:
    """An evaluate --out file's benchmarks: each benchmark's items, category 'c' + the item's parity."""
    return {"benchmarks": {name: {"kind": "mcq", "items": [
        {"id": str(i), "unit": str(i), "category": f"c{i % 2}", "l2_category": "", "score": s,
         "reply": "yes" if s else "no", "gold": ["yes"]}
        for i, s in enumerate(values)]} for name, values in scores.items()}}


def test_compare_writes_the_report_and_flags_regressions(tmp_path, capsys):
    from ernie_moe import compare

    (tmp_path / "base.json").write_text(json.dumps(results({"kept": [1.0] * 40, "lost": [1.0] * 40})))
    (tmp_path / "tuned.json").write_text(json.dumps(results({"kept": [1.0] * 39 + [0.0], "lost": [0.0] * 40})))
    argv = ["--before", str(tmp_path / "base.json"), "--after", str(tmp_path / "tuned.json"), "--out",
            str(tmp_path / "report")]
    assert compare.main(argv) == 0
    assert compare.main([*argv, "--fail-on-regression"]) == 1
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    rows = {(r["benchmark"], r["scope"]): r for r in report["rows"]}
    assert rows["kept", "overall"]["verdict"] == "within noise" and rows["kept", "overall"]["after"] == 0.975
    assert rows["lost", "overall"]["verdict"] == "regression" and rows["lost", "category/c1"]["questions"] == 20
    assert report["regressions"] == ["lost overall", "lost category/c0", "lost category/c1"]
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert "| lost | overall | 40 | 1.000 | 0.000 | -1.000 (-1.000 to -1.000) | 40 | 0 | **regression** |" in markdown
    assert "| kept | overall | 40 | 1.000 | 0.975 | " in markdown and "| 1 | 0 | within noise |" in markdown
    # the changed answers, and what the interval means
    assert "kept: answers that got worse\n\n| question | gold | before | after |\n|---|---|---|---|\n" \
           "| 39 | yes | yes (1) | no (0) |" in markdown
    assert "Where every question changed alike the interval has no width" in markdown
    assert report["changed_answers"]["lost"]["worse"][0] == {"unit": "0", "gold": ["yes"], "before": "yes",
                                                             "after": "no", "scores": [1.0, 0.0]}
    assert len(report["changed_answers"]["lost"]["worse"]) == 3 and report["changed_answers"]["lost"]["better"] == []
    assert Image.open(tmp_path / "report" / "report.png").size[1] > 100
    assert "regressions: lost overall" in capsys.readouterr().out
    (tmp_path / "not_results.json").write_text("[1, 2]")
    assert compare.main(["--before", str(tmp_path / "not_results.json"), "--after", str(tmp_path / "tuned.json"),
                         "--out", str(tmp_path / "x")]) == 2
    assert "is not a results file" in capsys.readouterr().err


# -- a model answering: the shape tasks, in training and from the command line -----------------------------

TASK_STEPS = 300


@pytest.fixture(scope="module")
def captioner(tmp_path_factory):
    """(the shape tasks' folder, a run trained on the captions conversations with both tasks' benchmarks scored at
    its last evaluation)."""
    from support.runs import ROOT

    from ernie_moe.config import load_config
    from ernie_moe.data.shape_tasks import write_task, write_tokenizer
    from ernie_moe.training import Trainer

    tasks = tmp_path_factory.mktemp("tasks")
    write_tokenizer(tasks)
    for task in ("captions", "where"):
        write_task(tasks, task, seed=0, image_size=84, count=1200, benchmark_count=48)
    out = tasks / "run"
    Trainer(load_config(ROOT / "configs" / "vl_moe.yaml", [
        "data.dataset=jsonl", f"data.train_path={tasks / 'captions' / 'train.jsonl'}",
        f"data.tokenizer_path={tasks / 'tokenizer'}", f"training.output_dir={out}", f"training.max_steps={TASK_STEPS}",
        f"training.eval_steps={TASK_STEPS}", "logging.progress_bar=false", "data.report_samples=0",
        f"training.eval_benchmarks={benchmark_specs(tasks)}"])).train()
    return tasks, out


def benchmark_specs(tasks) -> str:
    return f"[ocrbench:{tasks / 'captions' / 'captions.jsonl'},ocrbench:{tasks / 'where' / 'where.jsonl'}]"


def test_the_shape_tasks_are_written_as_conversations_and_benchmarks(tmp_path):
    from ernie_moe.data.shape_tasks import example, main

    assert main(["--out", str(tmp_path), "--count", "3", "--benchmark-count", "2", "--image-size", "56"]) == 0
    record = json.loads((tmp_path / "where" / "train.jsonl").read_text().splitlines()[0])
    image, question, answer, category = example("where", 0, "train", 0, 56)
    assert record["messages"] == [{"role": "user", "content": f"<image>{question}"},
                                  {"role": "assistant", "content": answer}]
    assert question == f"where is the {category}" and answer.split()[2] == category
    assert np.array_equal(np.asarray(Image.open(tmp_path / "where" / record["images"][0])), image)
    bench = read_benchmark(tmp_path / "captions" / "captions.jsonl", "ocrbench")
    assert len(bench.items) == 2 and bench.items[0].question == "describe"
    vocab = json.loads((tmp_path / "tokenizer" / "vocab.json").read_text())
    assert {"User:", "Assistant:", "describe", "where", "is"} <= set(vocab)


@pytest.mark.slow
def test_benchmarks_scored_in_training_equal_the_evaluate_commands_scores(captioner, tmp_path, capsys):
    """The captioner describes held-out shapes (its benchmark scored in training) better than it answers 'where' (it
    never saw three shapes); python -m ernie_moe.evaluate gives the same figures from the final model, and its results
    file holds every answer with its score as the rule gives it."""
    from ernie_moe import evaluate
    from ernie_moe.evaluation.metrics import ocrbench_hit

    tasks, out = captioner
    last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if "eval_bench/captions" in line][-1]
    print("in training:", {k: round(v, 3) for k, v in last.items() if k.startswith("eval_bench/")})
    # 300 steps: the whole caption right for about 0.3 of the images, where's questions about 0.02
    assert last["eval_bench/captions"] > last["eval_bench/where"] + 0.1
    assert {"eval_bench/captions/category/dot", "eval_bench/where/category/ring"} <= set(last)
    from visualdl import LogReader  # the same figures on VisualDL's scalars page, the benchmark's group

    (log,) = (out / "visualdl").glob("vdlrecords.*.log")
    logged = LogReader(file_path=str(log)).get_data("scalar", "eval_bench/captions")
    assert [(r.id, r.value) for r in logged] == [(TASK_STEPS, pytest.approx(last["eval_bench/captions"]))]
    specs = [f"ocrbench:{tasks / t / f'{t}.jsonl'}" for t in ("captions", "where")]
    assert evaluate.main(["--model", str(out / "final_model"), "--benchmark", specs[0], "--benchmark", specs[1],
                          "--out", str(tmp_path / "results.json"), "--no-progress"]) == 0
    assert "captions (ocrbench): score" in capsys.readouterr().out
    results = json.loads((tmp_path / "results.json").read_text())["benchmarks"]
    for name in ("captions", "where"):
        bench = results[name]
        assert bench["score"] == pytest.approx(last[f"eval_bench/{name}"])
        assert bench["count"] == 48 and bench["decoding"]["greedy"] and bench["rule"].startswith("question as given")
        for item in bench["items"]:
            assert item["score"] == ocrbench_hit(item["gold"], item["reply"], item["category"])
        assert bench["category/dot"] == pytest.approx(last[f"eval_bench/{name}/category/dot"])


@pytest.mark.slow
def test_each_data_rank_answers_its_share_and_two_ranks_give_one_processes_figures(captioner, tmp_path):
    """Two data ranks scoring the benchmarks in training (one step at a rate of 1e-12 from the captioner, so its
    answers are the captioner's): the figures of python -m ernie_moe.evaluate answering every question alone."""
    from support.runs import launch

    from ernie_moe.evaluation.results import benchmark_results
    from ernie_moe.generation import folder_run_config

    tasks, out = captioner
    specs = [f"ocrbench:{tasks / t / f'{t}.jsonl'}" for t in ("captions", "where")]
    alone = benchmark_results(out / "final_model", specs, folder_run_config(out / "final_model"), 8, None,
                              progress=False)
    two, _ = launch(tmp_path, 2, "data.dataset=jsonl", f"data.train_path={tasks / 'captions' / 'train.jsonl'}",
                    f"training.model_name_or_path={out / 'final_model'}", "training.learning_rate=1e-12",
                    "training.min_lr=0", "training.max_steps=1", "training.eval_steps=1", "data.max_seq_len=64",
                    f"training.eval_benchmarks={benchmark_specs(tasks)}")
    last = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()
            if "eval_bench/captions" in line][-1]
    assert alone["captions"]["score"] > 0
    for name in ("captions", "where"):
        assert last[f"eval_bench/{name}"] == pytest.approx(alone[name]["score"])
        assert last[f"eval_bench/{name}/category/bar"] == pytest.approx(alone[name]["category/bar"])



# -- a harness users already run, against the server ---------------------------------------------------------

EVALSCOPE_VENV = "evalscope-venv"  # .ci/run installs evalscope here, apart: its pins (datasets<=4.8.4) are its own


def evalscope_command() -> str | None:
    from support.runs import ROOT

    beside = ROOT / EVALSCOPE_VENV / "bin" / "evalscope"
    return str(beside) if beside.is_file() else shutil.which("evalscope")


def shape_colour_questions(folder, split: str, count: int):
    """(index, question, options, gold letter, PNG bytes): what colour a synthetic shape is, four colours offered."""
    from ernie_moe.data.formats.synthetic import COLORS, SyntheticShapes

    shapes = SyntheticShapes(0, split, count, 56)
    for index in range(count):
        d = shapes.describe(index)
        rng = np.random.default_rng([5, index, SPLIT_SEEDS[split]])
        options = [*rng.choice([c for c in COLORS if c != d["color"]], 3, replace=False), d["color"]]
        rng.shuffle(options)
        buffer = io.BytesIO()
        Image.fromarray(shapes.draw(d)).save(buffer, format="PNG")
        yield index, "What colour is the shape?", options, "ABCD"[options.index(d["color"])], buffer.getvalue()


SPLIT_SEEDS = {"train": 0, "eval": 1}


@pytest.mark.slow
def test_evalscope_scores_the_server_as_evaluate_scores_the_folder(tmp_path):
    """evalscope (its general_vmcq benchmark, its OpenAI-API model) against python -m ernie_moe.serve, on questions
    built here: the same replies to the same questions, prompts and greedy decoding as python -m ernie_moe.evaluate
    gives from the folder, and the same score."""
    import subprocess
    import sys

    from support.runs import ROOT, start

    from ernie_moe.evaluation.formats import Item
    from ernie_moe.evaluation.scoring import prompt_text

    command = evalscope_command()
    if command is None:
        pytest.skip(f"evalscope is not installed (.ci/run installs it in {EVALSCOPE_VENV}/)")
    # a model that answers with a letter: 100 steps on such questions (bytes, the training JSONL's conversations)
    (tmp_path / "images").mkdir()
    train = []
    for index, question, options, letter, png in shape_colour_questions(tmp_path, "train", 2000):
        (tmp_path / "images" / f"{index}.png").write_bytes(png)
        text = prompt_text("mcq", Item(str(index), question, (letter,), dict(zip("ABCD", options))))
        train.append({"images": [f"images/{index}.png"], "messages": [
            {"role": "user", "content": f"<image>{text}"}, {"role": "assistant", "content": letter}]})
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    done = subprocess.run([sys.executable, "run_trainer.py", "--config", "configs/vl_moe.yaml", "data.dataset=jsonl",
                           f"data.train_path={tmp_path / 'train.jsonl'}", "model.vocab_size=300",
                           "data.max_seq_len=256", "training.max_steps=100", "training.eval_steps=0",
                           "training.per_device_train_batch_size=8", f"training.output_dir={tmp_path / 'run'}",
                           "logging.progress_bar=false"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    model = tmp_path / "run" / "final_model"
    # the held-out questions: VLMEvalKit's TSV for evaluate, evalscope's general_vmcq JSONL with the same prompt text
    rows, records = [], []
    for index, question, options, letter, png in shape_colour_questions(tmp_path, "eval", 48):
        encoded = base64.b64encode(png).decode()
        rows.append([index, question, *options, letter, "colour", encoded])
        text = prompt_text("mcq", Item(str(index), question, (letter,), dict(zip("ABCD", options))))
        records.append({"question": f"<image 1>{text}", "options": options, "answer": letter,
                        "image_1": f"data:image/png;base64,{encoded}"})
    write_tsv(tmp_path / "colours.tsv", ["index", "question", "A", "B", "C", "D", "answer", "category", "image"], rows)
    (tmp_path / "es").mkdir()
    (tmp_path / "es" / "colours_val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    from ernie_moe import evaluate

    assert evaluate.main(["--model", str(model), "--benchmark", f"mcq:{tmp_path / 'colours.tsv'}", "--max-new-tokens",
                          "16", "--out", str(tmp_path / "ours.json"), "--no-progress"]) == 0
    ours = json.loads((tmp_path / "ours.json").read_text())["benchmarks"]["colours"]
    server, found = start([sys.executable, "-m", "ernie_moe.serve", "--model", str(model), "--port", "0",
                           "--served-name", "m"], tmp_path, r"on (http://\S+) ")
    try:
        harness = subprocess.run([
            command, "eval", "--model", "m", "--api-url", f"{found[1]}/v1", "--api-key", "unused", "--eval-type",
            "openai_api", "--datasets", "general_vmcq", "--dataset-args", json.dumps({"general_vmcq": {
                "local_path": str(tmp_path / "es"), "subset_list": ["colours"], "prompt_template": "{question}"}}),
            "--generation-config", json.dumps({"max_tokens": 16, "temperature": 0}), "--eval-batch-size", "8",
            "--work-dir", str(tmp_path / "evalscope"), "--no-timestamp"], capture_output=True, text=True,
            timeout=900, cwd=tmp_path, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    finally:
        server.terminate()
        server.wait(timeout=60)
    assert harness.returncode == 0, harness.stdout[-3000:] + harness.stderr[-3000:]
    reviews = [json.loads(line) for line in
               (tmp_path / "evalscope" / "reviews" / "m" / "general_vmcq_colours.jsonl").read_text().splitlines()]
    theirs = {r["index"]: r["sample_score"]["score"] for r in reviews}
    assert len(theirs) == len(ours["items"]) == 48
    for item in ours["items"]:  # the same reply to each question, read as the same letter
        assert theirs[int(item["id"])]["prediction"] == item["reply"], item
        assert theirs[int(item["id"])]["extracted_prediction"] == item["extracted"], item
    score = json.loads((tmp_path / "evalscope" / "reports" / "m" / "general_vmcq.json").read_text())["metrics"][0]
    print(f"evalscope {score['score']:.4f}, ernie_moe.evaluate {ours['score']:.4f}")
    assert score["num"] == 48 and score["score"] == pytest.approx(ours["score"], abs=1e-4)  # evalscope rounds to 4
    assert 0 < ours["score"] < 1  # answers both right and wrong: the comparison can fail
