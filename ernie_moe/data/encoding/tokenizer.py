"""Tokenizers that need no download: a word vocabulary, raw bytes, or a local SentencePiece model.

All share ids 0-4 for ``<pad> <s> </s> <unk> <image>`` where they define them; the image placeholder
id must equal ``model.im_patch_id``.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Protocol

import numpy as np

from ...json_files import UnreadableJSON, read_json, read_json_object
from ..formats.erniekit import BEGIN_OF_SENTENCE, END_OF_SENTENCE

SPECIALS = ("<pad>", "<s>", "</s>", "<unk>", "<image>")


class Tokenizer(Protocol):
    """What every tokenizer here offers; the data, the trainer and the commands take any of them."""

    pad_id: int
    bos_id: int
    eos_id: int
    unk_id: int
    image_token_id: int

    @property
    def vocab_size(self) -> int: ...

    def placeholder_id(self) -> int: ...

    def token_id(self, token: str) -> int | None: ...

    def identity(self) -> dict: ...

    def encode(self, text: str) -> list[int]: ...

    def encode_with_offsets(self, text: str) -> list[tuple[int, int, int]]: ...

    def decode(self, ids) -> str: ...

    def save(self, directory: Path) -> None: ...


class WordTokenizer:
    """Whitespace-separated words from a fixed vocabulary (the synthetic data's)."""

    def __init__(self, words: list[str]):
        self.vocab = list(SPECIALS) + [w for w in words if w not in SPECIALS]
        self.ids = {w: i for i, w in enumerate(self.vocab)}
        self.pad_id, self.bos_id, self.eos_id, self.unk_id, self.image_token_id = range(5)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def placeholder_id(self) -> int:
        return self.image_token_id

    def token_id(self, token: str) -> None:
        """No special tokens beyond the fixed ids (see :meth:`SentencePieceTokenizer.token_id`)."""
        return None

    def identity(self) -> dict:
        """What its encodings depend on."""
        return {"words": self.vocab}

    def encode(self, text: str) -> list[int]:
        return [self.ids.get(word, self.unk_id) for word in text.split()]

    def encode_with_offsets(self, text: str) -> list[tuple[int, int, int]]:
        """(id, first byte, end byte) of each word, offsets into ``text`` encoded as UTF-8."""
        return [(self.ids.get(m.group(), self.unk_id), len(text[:m.start()].encode("utf-8")),
                 len(text[:m.end()].encode("utf-8"))) for m in re.finditer(r"\S+", text)]

    def decode(self, ids) -> str:
        return " ".join(self.vocab[i] for i in ids)

    def save(self, directory: Path) -> None:
        (Path(directory) / "vocab.json").write_text(json.dumps(self.vocab, indent=0))


class SpecialSplitter:
    """Cuts a text at the special ``tokens`` (the longest first, where one begins another), each kept as a piece of
    its own and no piece empty; without tokens, the text whole. A class, so that a tokenizer holding one pickles
    (data workers receive the tokenizer)."""

    def __init__(self, tokens):
        self.pattern = re.compile("(" + "|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True))
                                  + ")") if tokens else None

    def __call__(self, text: str) -> list[str]:
        return [piece for piece in self.pattern.split(text) if piece] if self.pattern else [text]


PLACEHOLDER_PIECES = ("<|IMAGE_PLACEHOLDER|>", "<image>")
# the special pieces ERNIE's data processors write into a conversation (ERNIEKit's records, its chat layout)
ERNIE_PIECES = (BEGIN_OF_SENTENCE, END_OF_SENTENCE, "<|IMAGE_START|>", "<|IMAGE_END|>", "<|VIDEO_START|>",
                "<|VIDEO_END|>")


class ByteTokenizer:
    """UTF-8 bytes shifted past the special ids: any text, 261 ids. With ``ernie_pieces``, ERNIE's special pieces
    (:data:`ERNIE_PIECES`) are one id each after the bytes, and its sentence markers the begin and end ids: the
    tokenizer that lets a model built here read ERNIEKit's records and ERNIE's chat layout."""

    def __init__(self, ernie_pieces: bool = False):
        self.pad_id, self.bos_id, self.eos_id, self.unk_id, self.image_token_id = range(5)
        first = len(SPECIALS) + 256
        self.pieces = {piece: first + i for i, piece in enumerate(ERNIE_PIECES)} if ernie_pieces else {}
        self._piece_of_id = {i: piece for piece, i in self.pieces.items()}
        self._pieces = SpecialSplitter(self.pieces)
        if self.pieces:
            self.bos_id, self.eos_id = self.pieces[BEGIN_OF_SENTENCE], self.pieces[END_OF_SENTENCE]
        self.chat_template = None  # with ERNIE's pieces: ERNIE-4.5-VL's own layout (``chat.chat_format``)

    @property
    def vocab_size(self) -> int:
        return len(SPECIALS) + 256 + len(self.pieces)

    def placeholder_id(self) -> int:
        return self.image_token_id

    def token_id(self, token: str) -> int | None:
        """The id of one of ERNIE's pieces, when it has them (see :meth:`SentencePieceTokenizer.token_id`)."""
        return self.pieces.get(token)

    def identity(self) -> dict:
        return {"bytes": len(SPECIALS), **({"ernie_pieces": len(self.pieces)} if self.pieces else {})}

    def encode(self, text: str) -> list[int]:
        return [token for token, _, _ in self.encode_with_offsets(text)]

    def encode_with_offsets(self, text: str) -> list[tuple[int, int, int]]:
        """(id, first byte, end byte) of each token, offsets into ``text`` encoded as UTF-8: a byte each, a
        special piece its bytes."""
        out: list[tuple[int, int, int]] = []
        start = 0
        for part in self._pieces(text):
            data = part.encode("utf-8")
            if part in self.pieces:
                out.append((self.pieces[part], start, start + len(data)))
            else:
                out += [(len(SPECIALS) + b, start + i, start + i + 1) for i, b in enumerate(data)]
            start += len(data)
        return out

    def decode(self, ids) -> str:
        text, run = [], bytearray()
        for i in ids:
            if i in self._piece_of_id:
                text.append(run.decode("utf-8", errors="replace") + self._piece_of_id[i])
                run = bytearray()
            elif len(SPECIALS) <= i < len(SPECIALS) + 256:
                run.append(i - len(SPECIALS))
        return "".join(text) + run.decode("utf-8", errors="replace")

    def save(self, directory: Path) -> None:
        config = {"tokenizer_class": "ByteTokenizer", **({"ernie_pieces": True} if self.pieces else {})}
        (Path(directory) / "tokenizer_config.json").write_text(json.dumps(config))


class SentencePieceTokenizer:
    """A local ``tokenizer.model`` with the folder's special tokens (``tokenizer_config.json``,
    ``special_tokens_map.json``, ``added_tokens.json``) and chat template, read as data.

    Text is split at the special tokens first, each of which is one id, and SentencePiece encodes the rest,
    as PaddleFormers' and Hugging Face's tokenizers do. With ERNIE's sentence markers among the special tokens
    they are the begin and end ids; otherwise the SentencePiece model's own.
    """

    def __init__(self, directory: str, image_token_id: int):
        import sentencepiece

        folder = Path(directory)
        path = folder / "tokenizer.model"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.model in '{directory}'")
        self.sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        self.path = path
        self.unk_id = self.sp.unk_id()
        self.special = special_tokens(folder, self.sp)
        self._special_of_id = {i: t for t, i in self.special.items()}
        self.chat_template = chat_template_in(folder)
        self._pieces = SpecialSplitter(self.special)  # text cut at the special tokens, each one piece
        self.pad_id = max(self.sp.pad_id(), 0)
        self.bos_id = self.special.get(BEGIN_OF_SENTENCE, self.sp.bos_id())
        self.eos_id = self.special.get(END_OF_SENTENCE, self.sp.eos_id())
        self.image_token_id = image_token_id

    @property
    def vocab_size(self) -> int:
        return max([self.sp.get_piece_size(), *(i + 1 for i in self.special.values())])

    def placeholder_id(self) -> int | None:
        """Id of the model's own image-placeholder piece, if it has one."""
        for piece in PLACEHOLDER_PIECES:
            piece_id = self.special.get(piece, self.sp.piece_to_id(piece))
            if piece_id != self.unk_id:
                return piece_id
        return None

    def token_id(self, token: str) -> int | None:
        """The id of a special token, or None when this tokenizer has no such token."""
        return self.special.get(token)

    def identity(self) -> dict:
        return {"sentencepiece": hashlib.sha256(self.sp.serialized_model_proto()).hexdigest(),
                "special": self.special, "template": self.chat_template, "ids": [self.bos_id, self.eos_id,
                                                                                 self.image_token_id]}

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for piece in self._pieces(text):
            out += [self.special[piece]] if piece in self.special else self.sp.encode(piece)
        return out

    def encode_with_offsets(self, text: str) -> list[tuple[int, int, int]]:
        """(id, first byte, end byte) of each token, offsets into ``text`` encoded as UTF-8."""
        out, start = [], 0
        for piece in self._pieces(text):
            size = len(piece.encode("utf-8"))
            if piece in self.special:
                out.append((self.special[piece], start, start + size))
            else:
                pieces = self.sp.encode(piece, return_type="proto").pieces
                out += [(p.id, start + p.begin, start + p.end) for p in pieces]
            start += size
        return out

    def decode(self, ids) -> str:
        text: list[str] = []
        run: list[int] = []
        for i in (int(i) for i in ids):
            if i in self._special_of_id:
                text += [self.sp.decode(run), self._special_of_id[i]]
                run = []
            else:
                run.append(i)
        return "".join(text) + self.sp.decode(run)

    def save(self, directory: Path) -> None:
        folder = Path(directory)
        (folder / "tokenizer.model").write_bytes(self.path.read_bytes())
        for name in SPECIAL_FILES:
            source = self.path.parent / name
            if source.is_file() and source.resolve() != (folder / name).resolve():
                (folder / name).write_bytes(source.read_bytes())


# a share of unknown tokens in text above this says the tokenizer's vocabulary does not cover the text
UNKNOWN_WARN_SHARE = 0.05


def unknown_tokens(input_ids, token_type_ids, unk_id: int) -> tuple[int, int]:
    """(the text tokens that are ``unk_id``, the text tokens) of an encoded sample."""
    text = np.asarray(token_type_ids) == 0
    return int((np.asarray(input_ids)[text] == unk_id).sum()), int(text.sum())


def unknown_warning(share: float, what: str) -> str | None:
    """The line a person should see when ``share`` of ``what``'s text tokens are the unknown token, or None."""
    if share <= UNKNOWN_WARN_SHARE:
        return None
    return (f"{share:.0%} of the text tokens of {what} are the tokenizer's unknown token (<unk>): its vocabulary does "
            "not cover this text, so the model reads placeholders; give the model's own tokenizer "
            "(data.tokenizer_path, or a model folder that holds one)")


MAX_TEMPLATE_BYTES = 1 << 20  # a chat template is a few KiB
SPECIAL_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja")


def _json(path: Path) -> dict:
    if not path.is_file():
        return {}
    return read_json_object(path, ValueError)


def special_tokens(folder: Path, sp) -> dict[str, int]:
    """Every special or added token the folder names, with its id: from ``added_tokens.json`` or
    ``added_tokens_decoder``, else the SentencePiece piece of that text. Tokens without an id are left out."""
    config, names = _json(folder / "tokenizer_config.json"), []
    ids = {str(k): int(v) for k, v in _json(folder / "added_tokens.json").items() if isinstance(v, int)}
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise ValueError(f"{folder / 'tokenizer_config.json'}: added_tokens_decoder must map token ids to tokens, "
                         f"not {decoder!r}")
    for key, entry in decoder.items():
        content = entry.get("content") if isinstance(entry, dict) else None
        if isinstance(content, str) and str(key).isdigit():
            ids.setdefault(content, int(key))
    for source in (config, _json(folder / "special_tokens_map.json")):
        for key, value in source.items():
            if key.endswith("_token") or key == "additional_special_tokens":
                names += value if isinstance(value, list) else [value]
    names = [n.get("content") if isinstance(n, dict) else n for n in names]
    out = {}
    for name in [*ids, *names]:
        if isinstance(name, str) and name:
            token_id = ids.get(name, sp.piece_to_id(name))
            if token_id != sp.unk_id() or name == sp.id_to_piece(sp.unk_id()):
                out[name] = token_id
    return out


def chat_template_in(folder: Path) -> str | None:
    """The folder's chat template: ``chat_template.jinja``, or ``chat_template`` in ``tokenizer_config.json``."""
    path = folder / "chat_template.jinja"
    if path.is_file():
        if path.stat().st_size > MAX_TEMPLATE_BYTES:
            raise ValueError(f"{path} is {path.stat().st_size:,} bytes: not a chat template (at most "
                             f"{MAX_TEMPLATE_BYTES:,})")
        try:
            return path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"cannot read {path}: it is not UTF-8 text") from None
    template = _json(folder / "tokenizer_config.json").get("chat_template")
    return template if isinstance(template, str) else None


def tokenizer_in(directory, image_token_id: int):
    """The tokenizer a model folder holds (as ``save`` wrote it, or a SentencePiece ``tokenizer.model``), or
    None when it holds none. Raises ValueError for tokenizer files that cannot be read."""
    folder = Path(directory)
    if (folder / "tokenizer.model").is_file():
        try:
            return SentencePieceTokenizer(str(folder), image_token_id)
        except (RuntimeError, OSError) as err:  # sentencepiece's word for a file that is not its model
            raise ValueError(f"'{folder / 'tokenizer.model'}' is not a SentencePiece model") from err
    if (folder / "vocab.json").is_file():
        try:
            words = read_json(folder / "vocab.json")
        except UnreadableJSON as err:
            raise ValueError(f"cannot read {folder / 'vocab.json'}: {err}") from None
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            raise ValueError(f"{folder / 'vocab.json'} is not a list of words")
        return WordTokenizer(words)
    config = folder / "tokenizer_config.json"
    if config.is_file():
        try:
            kind = read_json(config).get("tokenizer_class")
        except (UnreadableJSON, AttributeError) as err:
            raise ValueError(f"cannot read {config}: {err}") from None
        if kind == "ByteTokenizer":
            return ByteTokenizer(ernie_pieces=read_json(config).get("ernie_pieces") is True)
    return None
