"""Benchmark files as the field distributes them, read into :class:`Item` records.

- ``mcq``: VLMEvalKit's multiple-choice TSV (MMBench, MMStar, SEED-Bench): ``index, question, [hint], A..E,
  answer, [category], [l2-category], image`` with the image as base64 or, in a short field, the ``index`` of the
  row that holds it. ``mmbench`` is the same file scored with CircularEval: a question counts only when every
  rotation of its options is answered right (rows whose ``index`` is the original's plus k x 1e6 are its
  rotations; a file without them gets the rotations made here).
- ``mmmu``: MMMU's records (``id, question, options, answer, question_type, image_1..image_7``), ``<image N>``
  markers placing the images, multiple-choice and open questions, the subject read from the ``id``.
- ``chartqa``, ``docvqa``, ``infovqa``, ``ocrbench``: a question, its gold answers (a list, a Python-literal list
  or one string) and one image; OCRBench's ``question_type`` is its category.
- ``text_mcq``: MMLU / C-Eval: ``question, A..D, answer`` with a header (``subject`` or ``category`` naming the
  category), or MMLU's headerless six columns (the category then the file's name).

Files are TSV, CSV, JSONL, JSON (a list of records, or an object whose ``data`` is one) or Parquet, one or a folder
or glob of shards read as one benchmark; an image is base64 text, a ``{"bytes": ...}``
record (Hugging Face datasets' layout) or a path relative to the file. A row that cannot be used is a counted
skip by reason; a file that cannot be read at all is a :class:`~ernie_moe.data.DataError`.
"""

from __future__ import annotations

import ast
import base64
import binascii
import csv
import functools
import glob
import itertools
import json
import math
import re
import string
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..config.schema import BENCHMARK_KINDS
from ..data.formats.sample import DataError
from ..json_files import UnreadableJSON, read_json
from ..paths import not_a_file

KINDS = BENCHMARK_KINDS
MAX_FILE_BYTES = 8 * 2 ** 30  # a benchmark file is read whole; MMBench's largest TSV is under 1 GiB
MAX_FIELD_BYTES = 64 * 2 ** 20  # one cell: a base64 image
MAX_ROWS = 1_000_000
# the cells pandas' read_csv reads as missing by default (its na_values), as VLMEvalKit reads a TSV
PANDAS_NA = frozenset({"", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN",
                       "<NA>", "N/A", "NA", "NULL", "NaN", "None", "n/a", "nan", "null"})
CIRCULAR_STEP = 1_000_000  # MMBench: a rotation's index is the original's plus k times this
LETTERS = string.ascii_uppercase[:9]  # MMBench A-E, MMMU up to I
MMMU_IMAGES = 7
SUFFIXES = (".tsv", ".csv", ".jsonl", ".json", ".parquet")
MAX_FILES = 1000  # shards of one benchmark (MMMU's validation split: 30)
MAX_IMAGE_FOLDERS = 64  # sub-folders of a benchmark's folder looked into for a bare image name
MAX_DIRECTORY_ENTRIES = 100_000  # entries of that folder looked at to find them (images may lie beside the file)
# the first bytes of the image files a benchmark's base64 cells hold: PNG, JPEG, GIF, BMP, WebP (RIFF), TIFF
IMAGE_MAGIC = (b"\x89PNG", b"\xff\xd8\xff", b"GIF8", b"BM", b"RIFF", b"II*\x00", b"MM\x00*")


@dataclass(frozen=True)
class Item:
    """One question of a benchmark; ``images`` are encoded files (bytes) or paths."""

    id: str
    question: str
    answers: tuple[str, ...]  # the gold letter (multiple choice) or the gold texts
    options: dict[str, str] = field(default_factory=dict)  # letter -> text, in order; empty for open questions
    images: tuple[bytes | Path, ...] = ()
    hint: str = ""
    category: str = ""
    l2_category: str = ""
    group: str = ""  # CircularEval: the original question's index
    open: bool = False  # an MMMU open question
    markers: tuple[int, ...] = ()  # MMMU: the <image N> numbers of ``images``, in order of first appearance


@dataclass
class Benchmark:
    kind: str
    path: Path
    items: list[Item]
    skipped: Counter = field(default_factory=Counter)

    @property
    def circular(self) -> bool:
        return self.kind == "mmbench"


class RowSkip(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def read_benchmark(path: str | Path, kind: str) -> Benchmark:
    """The items of the benchmark ``path`` read as ``kind`` (one of :data:`KINDS`): a file, or a folder or glob of
    shards (MMMU as Hugging Face ships it: a folder per subject) read as one benchmark named by the folder."""
    if kind not in KINDS:
        raise DataError(f"unknown benchmark kind '{kind}': one of {', '.join(KINDS)}")
    path, files = benchmark_files(path)
    _sub_folders.cache_clear()  # listed once per read: folders made since an earlier read are seen
    bench = Benchmark(kind, path, [])
    for file in files:
        if file.stat().st_size > MAX_FILE_BYTES:
            raise DataError(f"benchmark file '{file}' is over {MAX_FILE_BYTES // 2 ** 30} GiB")
        rows = list(_rows(file, headerless=kind == "text_mcq"))
        if kind in ("mcq", "mmbench"):
            items = _mcq_items(rows, file, bench.skipped)
            bench.items += _with_rotations(items) if kind == "mmbench" else items
            continue
        reader = {"mmmu": _mmmu_item, "text_mcq": _text_mcq_item}.get(kind, _vqa_item)
        for number, row in enumerate(rows, start=1):
            try:
                bench.items.append(reader(row, number, file))
            except RowSkip as skip:
                bench.skipped[skip.reason] += 1
    if not bench.items:
        raise DataError(f"benchmark file '{path}' holds no usable {kind} question (skipped: "
                        f"{dict(bench.skipped) or 'none'}; a {kind} record has {EXPECTED[kind]})")
    ids = Counter(item.id for item in bench.items)
    repeated = [i for i, n in ids.items() if n > 1]
    if repeated:
        raise DataError(f"benchmark file '{path}': item id '{repeated[0]}' appears {ids[repeated[0]]} times")
    return bench


def benchmark_files(given: str | Path) -> tuple[Path, list[Path]]:
    """(the benchmark's path, which names it; its files): one file, every file of a readable suffix under a
    folder, or the files a glob matches (its folder names it), in order; DataError when there are none."""
    parts = Path(given).parts
    wild = next((i for i, part in enumerate(parts) if any(c in part for c in "*?[")), None)
    if wild is not None:
        base = Path(*parts[:wild]) if wild else Path(".")
        found: Iterator[Path] = (Path(p) for p in glob.iglob(str(given), recursive=True))
    else:
        base = Path(given)
        if not base.is_dir():
            problem = not_a_file(base)
            if problem is not None:
                raise DataError(f"benchmark file '{base}' {problem}")
            return base, [base]
        found = (p for p in base.rglob("*") if p.suffix.lower() in SUFFIXES)
    # at most one past the bound is held: a glob or folder far too wide is said before it is listed whole
    files = sorted(itertools.islice((p for p in found if p.is_file()), MAX_FILES + 1))
    if not files:
        raise DataError(f"benchmark '{given}' names no file ({', '.join(SUFFIXES)})")
    if len(files) > MAX_FILES:
        raise DataError(f"benchmark '{given}' names more than {MAX_FILES} files")
    return base, files


# -- rows --------------------------------------------------------------------------------------------------

def _rows(path: Path, headerless: bool = False) -> Iterator[dict]:
    suffix = path.suffix.lower()
    try:
        if suffix in (".tsv", ".csv"):
            yield from _delimited(path, "\t" if suffix == ".tsv" else ",", headerless)
        elif suffix == ".jsonl":
            with path.open("rb") as f:
                for number, line in enumerate(f, start=1):
                    if line.strip():
                        yield _record(line, f"{path} line {number}")
        elif suffix == ".json":
            try:
                records = read_json(path, MAX_FILE_BYTES)
            except UnreadableJSON as err:
                raise DataError(f"benchmark file '{path}' cannot be read: {err}") from None
            if isinstance(records, dict) and isinstance(records.get("data"), list):
                records = records["data"]  # DocVQA's and InfographicVQA's releases: {dataset_name, ..., data}
            if not isinstance(records, list):
                raise DataError(f"benchmark file '{path}' must hold a JSON list of records (or an object whose "
                                "'data' is one, as DocVQA's release)")
            for number, record in enumerate(records, start=1):
                if not isinstance(record, dict):
                    raise DataError(f"benchmark file '{path}' record {number} is not an object")
                yield record
        elif suffix == ".parquet":
            yield from _parquet(path)
        else:
            raise DataError(f"benchmark file '{path}': read as its suffix says, one of .tsv .csv .jsonl .json "
                            ".parquet")
    except (UnicodeDecodeError, json.JSONDecodeError, csv.Error) as err:
        raise DataError(f"benchmark file '{path}' cannot be read: {err}") from None


def _record(line: bytes, where: str) -> dict:
    try:
        record = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"{where} is not JSON: {err}") from None
    except RecursionError:
        raise DataError(f"{where} is nested too deep to read") from None
    if not isinstance(record, dict):
        raise DataError(f"{where} is not a JSON object")
    return record


def _delimited(path: Path, delimiter: str, headerless: bool) -> Iterator[dict]:
    csv.field_size_limit(MAX_FIELD_BYTES)
    with path.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f, delimiter=delimiter)
        header = next(reader, None)
        if header is None:
            return
        if headerless and "question" not in header and len(header) == 6:  # MMLU: question, A-D, answer
            names = ["question", "A", "B", "C", "D", "answer"]
            yield dict(zip(names, header))
        else:
            names = [name.strip() for name in header]
        for count, row in enumerate(reader, start=1):
            if count > MAX_ROWS:
                raise DataError(f"benchmark file '{path}' has over {MAX_ROWS} rows")
            # VLMEvalKit reads these files with pandas' defaults: such a cell is a missing value there
            yield dict(zip(names, (None if cell in PANDAS_NA else cell for cell in row)))


def _parquet(path: Path) -> Iterator[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"'{path}': reading Parquet needs pyarrow (pip install pyarrow, or the package's [parquet] "
                        "extra)") from None
    try:
        table = pq.ParquetFile(path)
        for group in range(table.num_row_groups):
            yield from table.read_row_group(group).to_pylist()
    except (OSError, ValueError) as err:  # pyarrow's errors derive from these
        raise DataError(f"benchmark file '{path}' cannot be read as Parquet: {err}") from None


# -- fields ------------------------------------------------------------------------------------------------

def _text(row: dict, key: str) -> str:
    """A cell as text; pandas writes a missing value as '' or 'nan' in a TSV."""
    value = row.get(key)
    if value is None or (isinstance(value, float) and value != value):
        return ""
    value = str(value).strip()
    return "" if value.lower() == "nan" else value


def _options(row: dict) -> dict[str, str]:
    options = {}
    for letter in LETTERS:
        text = _text(row, letter)
        if not text:
            break
        options[letter] = text
    return options


def _answer_list(value) -> tuple[str, ...]:
    """Gold answers: a list, a Python-literal or JSON list in a string, or one string."""
    if isinstance(value, str) and value.strip().startswith("["):
        try:
            value = ast.literal_eval(value.strip())  # data only: literal_eval evaluates no code
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            pass  # an answer that begins with '[' (OCRBench's item 20952): the string, as the reference reads it
    values = value if isinstance(value, (list, tuple)) else [value]
    answers = tuple(str(v).strip() for v in values if v is not None and str(v).strip())
    if not answers:
        raise RowSkip("no_answer")
    return answers


def _image(value, root: Path) -> bytes | Path:
    """An image cell: base64 text, a datasets ``{"bytes", "path"}`` record, or a path under ``root``."""
    if isinstance(value, dict):
        if value.get("bytes"):
            return bytes(value["bytes"])
        value = value.get("path")
    if isinstance(value, bytes):
        return value
    if not isinstance(value, str) or not value.strip():
        raise RowSkip("missing_image")
    value = value.strip()
    if value.startswith("data:") and "," in value:
        value = value.split(",", 1)[1]
    try:  # base64 text whose bytes are an image file (a short one too: a small PNG is 200 characters)
        decoded = base64.b64decode(value, validate=True)
        if decoded.startswith(IMAGE_MAGIC):
            return decoded
    except (binascii.Error, ValueError):
        pass
    return _beside(root, value)


def _beside(root: Path, name: str) -> Path:
    """``name`` under ``root``, or in one of ``root``'s sub-folders (ChartQA's ``png/``, InfographicVQA's image
    folder) where only its file name is given; the first place when it is nowhere (a counted skip later)."""
    first = root / name
    if first.exists() or "/" in name:
        return first
    for folder in _sub_folders(root):
        if (folder / name).is_file():
            return folder / name
    return first


@functools.lru_cache(maxsize=16)
def _sub_folders(root: Path) -> tuple[Path, ...]:
    """``root``'s first sub-folders by name, listed once for all of a file's bare image names."""
    return tuple(sorted(p for p in itertools.islice(root.iterdir(), MAX_DIRECTORY_ENTRIES) if p.is_dir())
                 [:MAX_IMAGE_FOLDERS])


# -- kinds -------------------------------------------------------------------------------------------------

def _mcq_items(rows: list[dict], path: Path, skipped: Counter) -> list[Item]:
    """VLMEvalKit's TSV: an image cell of at most 64 characters names the row that holds the image."""
    images: dict[str, str] = {}
    for row in rows:
        cell = _text(row, "image")
        if len(cell) > 64:
            images[_text(row, "index")] = cell
    items = []
    for number, row in enumerate(rows, start=1):
        try:
            index = _text(row, "index") or str(number)
            options = _options(row)
            answer = _text(row, "answer")
            question = _text(row, "question")
            if not question:
                raise RowSkip("no_question")
            if len(options) < 2:
                raise RowSkip("too_few_options")
            if not answer:
                raise RowSkip("no_answer")
            if answer not in options:
                raise RowSkip("answer_not_an_option")
            if _is_number(index) and not math.isfinite(float(index)):
                raise RowSkip("bad_index")  # MMBench's rotations are numbered from a whole index
            cell = _text(row, "image")
            if len(cell) <= 64 and cell:
                if cell not in images:
                    raise RowSkip("missing_image")
                cell = images[cell]
            image = (_image(cell, path.parent),) if cell else ()
            group = str(int(float(index)) % CIRCULAR_STEP) if _is_number(index) else index
            items.append(Item(index, question, (answer,), options, image, _text(row, "hint"),
                              _text(row, "category"), _text(row, "l2-category") or _text(row, "l2_category"),
                              group))
        except RowSkip as skip:
            skipped[skip.reason] += 1
    return items


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _with_rotations(items: list[Item]) -> list[Item]:
    """MMBench's CircularEval set: each question with its options rotated once per further option, unless the
    file already holds the rotations (rows sharing a group)."""
    if len({item.group for item in items}) < len(items):
        return items
    rotated = []
    for item in items:
        letters, texts = list(item.options), list(item.options.values())
        gold = letters.index(item.answers[0])
        for shift in range(len(letters)):
            options = dict(zip(letters, texts[shift:] + texts[:shift]))
            answer = letters[(gold - shift) % len(letters)]
            item_id = item.id if shift == 0 else f"{item.group}+{shift}x{CIRCULAR_STEP}"
            rotated.append(Item(item_id, item.question, (answer,), options, item.images, item.hint,
                                item.category, item.l2_category, item.group))
    return rotated


# the fields of the VQA kinds' files, as their releases and the harnesses' copies name them
VQA_ANSWERS = ("answers", "answer", "label")  # label: ChartQA's release
VQA_IMAGES = ("image", "image_path", "imgname", "image_local_name")  # OCRBench, ChartQA, InfographicVQA releases
EXPECTED = {
    "mcq": "index, question, A, B, ..., answer, image",
    "mmbench": "index, question, A, B, ..., answer, image",
    "mmmu": "id, question, options, answer, question_type, image_1..image_7",
    "text_mcq": "question, A..D (or choices, a list), answer (a letter, or the choice's number)",
    **{kind: f"question (or query), {' / '.join(VQA_ANSWERS)}, {' / '.join(VQA_IMAGES)}"
       for kind in ("chartqa", "docvqa", "infovqa", "ocrbench")},
}
_MMMU_SUBJECT = re.compile(r"^[^_]+_(.+?)_\d+$")


def _mmmu_item(row: dict, number: int, path: Path) -> Item:
    item_id = _text(row, "id") or str(number)
    question = _text(row, "question")
    if not question:
        raise RowSkip("no_question")
    raw = row.get("options", [])
    if isinstance(raw, str):
        try:
            raw = ast.literal_eval(raw) if raw.strip() else []  # MMMU writes its options as a Python list
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            raise RowSkip("bad_options") from None
    if not isinstance(raw, (list, tuple)) or len(raw) > len(LETTERS):
        raise RowSkip("bad_options")
    is_open = _text(row, "question_type") == "open" or not raw
    options = {} if is_open else dict(zip(LETTERS, (str(o) for o in raw)))
    answers = _answer_list(row.get("answer"))
    if not is_open and answers[0] not in options:
        raise RowSkip("answer_not_an_option")
    # the images of the question and of its options (MMMU's image options), each once, in order of appearance
    marked = list(dict.fromkeys(int(n) for text in (question, *options.values())
                                for n in re.findall(r"<image (\d+)>", text)))
    if any(not 1 <= n <= MMMU_IMAGES for n in marked):
        raise RowSkip("bad_image_marker")
    images = tuple(_image(row.get(f"image_{n}"), path.parent) for n in marked)
    match = _MMMU_SUBJECT.match(item_id)
    subject = _text(row, "subject") or (match.group(1) if match else "")
    return Item(item_id, question, answers if is_open else answers[:1], options, images, category=subject,
                open=is_open, markers=tuple(marked))


def _first(row: dict, keys: tuple[str, ...]):
    return next((row[k] for k in keys if row.get(k) is not None), None)


def _vqa_item(row: dict, number: int, path: Path) -> Item:
    question = _text(row, "question") or _text(row, "query")  # ChartQA's release names it query
    if not question:
        raise RowSkip("no_question")
    answers = _answer_list(_first(row, VQA_ANSWERS))
    item_id = _text(row, "index") or _text(row, "id") or _text(row, "questionId") or str(number)
    category = _text(row, "question_type") or _text(row, "category") or _text(row, "type")
    return Item(item_id, question, answers, images=(_image(_first(row, VQA_IMAGES), path.parent),),
                category=category)


def _text_mcq_item(row: dict, number: int, path: Path) -> Item:
    question = _text(row, "question")
    if not question:
        raise RowSkip("no_question")
    options = _options(row)
    answer = _text(row, "answer")
    choices = row.get("choices")
    if not options and isinstance(choices, (list, tuple)) and len(choices) <= len(LETTERS):
        # MMLU as Hugging Face ships it: the options as a list, the answer the right one's number
        options = {letter: str(c).strip() for letter, c in zip(LETTERS, choices)}
        given = row.get("answer")
        if isinstance(given, int) and not isinstance(given, bool) and 0 <= given < len(choices):
            answer = LETTERS[given]
    if len(options) < 2:
        raise RowSkip("too_few_options")
    if answer not in options:
        raise RowSkip("answer_not_an_option")
    item_id = _text(row, "id") or _text(row, "index") or str(number)
    category = _text(row, "subject") or _text(row, "category") or path.stem.removesuffix("_test").removesuffix("_val")
    return Item(item_id, question, (answer,), options, category=category)


