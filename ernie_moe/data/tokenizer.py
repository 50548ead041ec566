"""Tokenizers that need no download: a word vocabulary, raw bytes, or a local SentencePiece model.

All share ids 0-4 for ``<pad> <s> </s> <unk> <image>`` where they define them; the image placeholder
id must equal ``model.im_patch_id``.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ("<pad>", "<s>", "</s>", "<unk>", "<image>")


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

    def encode(self, text: str) -> list[int]:
        return [self.ids.get(word, self.unk_id) for word in text.split()]

    def decode(self, ids) -> str:
        return " ".join(self.vocab[i] for i in ids)

    def save(self, directory: Path) -> None:
        (Path(directory) / "vocab.json").write_text(json.dumps(self.vocab, indent=0))


class ByteTokenizer:
    """UTF-8 bytes shifted past the special ids: any text, 261 ids."""

    def __init__(self):
        self.pad_id, self.bos_id, self.eos_id, self.unk_id, self.image_token_id = range(5)

    @property
    def vocab_size(self) -> int:
        return len(SPECIALS) + 256

    def placeholder_id(self) -> int:
        return self.image_token_id

    def encode(self, text: str) -> list[int]:
        return [len(SPECIALS) + b for b in text.encode("utf-8")]

    def decode(self, ids) -> str:
        return bytes(i - len(SPECIALS) for i in ids if i >= len(SPECIALS)).decode("utf-8", errors="replace")

    def save(self, directory: Path) -> None:
        (Path(directory) / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "ByteTokenizer"}))


PLACEHOLDER_PIECES = ("<|IMAGE_PLACEHOLDER|>", "<image>")


class SentencePieceTokenizer:
    """A local ``tokenizer.model``; special ids come from the model, the image placeholder from the config."""

    def __init__(self, directory: str, image_token_id: int):
        import sentencepiece

        path = Path(directory) / "tokenizer.model"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.model in '{directory}'")
        self.sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        self.path = path
        self.pad_id = max(self.sp.pad_id(), 0)
        self.bos_id, self.eos_id, self.unk_id = self.sp.bos_id(), self.sp.eos_id(), self.sp.unk_id()
        self.image_token_id = image_token_id

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def placeholder_id(self) -> int | None:
        """Id of the model's own image-placeholder piece, if it has one."""
        for piece in PLACEHOLDER_PIECES:
            piece_id = self.sp.piece_to_id(piece)
            if piece_id != self.unk_id:
                return piece_id
        return None

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def decode(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])

    def save(self, directory: Path) -> None:
        (Path(directory) / "tokenizer.model").write_bytes(self.path.read_bytes())


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
            words = json.loads((folder / "vocab.json").read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"cannot read {folder / 'vocab.json'}: {err}") from None
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            raise ValueError(f"{folder / 'vocab.json'} is not a list of words")
        return WordTokenizer(words)
    config = folder / "tokenizer_config.json"
    if config.is_file():
        try:
            kind = json.loads(config.read_text()).get("tokenizer_class")
        except (OSError, ValueError, AttributeError) as err:
            raise ValueError(f"cannot read {config}: {err}") from None
        if kind == "ByteTokenizer":
            return ByteTokenizer()
    return None
