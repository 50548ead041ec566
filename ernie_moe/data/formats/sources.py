"""A training source as the config names it (a file, a folder of shards or a glob) and the shard formats: JSONL,
WebDataset tar shards (the LAION / DataComp layout: an image and its ``.txt`` or ``.json`` per key) and Parquet
files with image bytes (Hugging Face datasets' layout).

A source of many shards is one data set, its shards one after another; what each shard keeps in memory is
arrays of offsets (a JSONL file's 8 bytes a record, memory-mapped; a tar's about 40 bytes a sample; a Parquet
file's row-group starts), so a source larger than memory costs little to open. Every shard is
read at random by sample, through the standard library's ``tarfile`` and pyarrow's Parquet reader.
"""

from __future__ import annotations

import glob
import json
import tarfile
from pathlib import Path

import numpy as np

from .jsonl import JsonlDataset
from .sample import BadSample, DataError

SHARD_SUFFIXES = (".jsonl", ".tar", ".parquet")
COMPRESSED_SUFFIXES = (".gz", ".tgz", ".bz2", ".xz", ".zst", ".zip", ".7z")
IMAGE_SUFFIXES = ("jpg", "jpeg", "png", "webp", "bmp")
CAPTION_KEYS = ("caption", "text", "txt")


def shard_files(entry: str) -> list[Path]:
    """The files of one ``train_path`` entry: the file itself, a folder's shards (by name), or a glob's matches
    (sorted); DataError when it names none, or a compressed one."""
    path = Path(entry)
    if path.is_dir():
        packed = sorted(p.name for p in path.iterdir() if p.name.endswith(COMPRESSED_SUFFIXES) and p.is_file())
        if packed:  # left out, its samples would be missing from the run without a word
            raise DataError(_compressed(path / packed[0]))
        files = sorted(p for p in path.iterdir() if p.suffix in SHARD_SUFFIXES and p.is_file())
        if not files:
            raise DataError(f"data folder '{entry}' holds no shard ({', '.join(SHARD_SUFFIXES)} files)")
        return files
    if glob.has_magic(entry):
        files = sorted(Path(p) for p in glob.glob(entry, recursive=True) if Path(p).is_file())
        if not files:
            raise DataError(f"data pattern '{entry}' matches no file")
    else:
        files = [path]
    compressed = [f for f in files if f.name.endswith(COMPRESSED_SUFFIXES)]
    if compressed:
        raise DataError(_compressed(compressed[0]))
    return files


def _compressed(path: Path) -> str:
    return (f"'{path}' is compressed: shards are read at random (tar members and JSONL lines at their offsets), "
            "which a compressed file does not allow; decompress it (gunzip, or tar's own shards uncompressed)")


def open_shard(path: Path, data_cfg, preference: bool = False):
    """One shard, read as its suffix says (a ``.jsonl`` file, and any other name, as JSONL)."""
    from .preference import PreferenceJsonl

    d = data_cfg
    kind = {".tar": TarShard, ".parquet": ParquetShard}.get(path.suffix, PreferenceJsonl if preference else
                                                            JsonlDataset)
    if preference and kind is not PreferenceJsonl:
        raise DataError(f"'{path}': preference pairs are read from JSONL files")
    return kind(str(path), d.max_image_pixels, d.video_reading, d.format, d.enable_thinking, d.index_dir)


def source_dataset(entry: str, data_cfg, preference: bool = False):
    """The data set of one ``train_path`` (or ``text_path``, ``eval_path``) entry."""
    shards = [open_shard(path, data_cfg, preference) for path in shard_files(entry)]
    return shards[0] if len(shards) == 1 else Shards(shards, entry)


class Shards:
    """Several shards as one data set, one after another."""

    def __init__(self, shards: list, name: str):
        self.shards, self.path = shards, name
        self.starts = np.cumsum([0] + [len(s) for s in shards])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _locate(self, index: int) -> tuple:
        shard = int(np.searchsorted(self.starts, index, side="right") - 1)
        return self.shards[shard], index - int(self.starts[shard])

    def __getitem__(self, index: int):
        shard, inner = self._locate(index)
        return shard[inner]

    def shapes(self, index: int):
        shard, inner = self._locate(index)
        return shard.shapes(inner)

    def identity(self) -> dict:
        return {"shards": [s.identity() for s in self.shards]}


class ScannedShard(JsonlDataset):
    """A shard whose samples are found by reading its headers or footer each time it is opened (cheap: no file
    is read whole), not kept like a JSONL file's offsets."""

    def _open(self, index_dir: str) -> np.ndarray:
        return self._scan()


class TarShard(ScannedShard):
    """A WebDataset shard: members grouped by key (the name up to the first dot of its last part), each sample an
    image member with a ``.txt`` caption, or a ``.json`` holding a ``caption`` / ``text`` or a record of the JSONL
    shapes (``messages``, an interleaved document), whose images are the sample's image members in name order.
    Only the members' headers are read to open it; a sample is read by seeking to its members."""

    def _scan(self) -> np.ndarray:
        """(offset, size) of each sample's text member and of up to its first image members, as arrays."""
        groups: dict[str, dict] = {}
        with self._open_scan() as tar:
            try:
                for member in iter(tar.next, None):
                    if not member.isfile():
                        continue
                    folder, _, name = member.name.rpartition("/")
                    key, _, suffix = name.partition(".")
                    group = groups.setdefault(f"{folder}/{key}", {"images": []})
                    if suffix.lower() in IMAGE_SUFFIXES:
                        group["images"].append((member.name, member.offset_data, member.size))
                    elif suffix.lower() in ("txt", "json"):
                        group["text"] = (suffix.lower(), member.offset_data, member.size)
            except (tarfile.ReadError, EOFError, OSError):  # torn at the end: the members before it are kept
                pass
        texts = [g.get("text", ("", 0, -1)) for g in groups.values()]
        self.text_json = np.array([t[0] == "json" for t in texts], bool)
        self.text_at = np.array([t[1:] for t in texts], np.int64).reshape(-1, 2)
        self.image_starts = np.cumsum([0] + [len(g["images"]) for g in groups.values()])
        images = [(offset, size) for g in groups.values() for _, offset, size in sorted(g["images"])]
        self.image_at = np.array(images, np.int64).reshape(-1, 2)
        return np.arange(len(groups), dtype=np.int64)

    def _open_scan(self):
        try:
            tar = tarfile.open(self.path, "r:")  # an uncompressed tar: its members can be read at their offsets
        except tarfile.ReadError as err:
            raise DataError(f"'{self.path}' is not an uncompressed tar file ({err}): WebDataset shards are read "
                            "by seeking to their members, which a compressed tar does not allow") from None
        self.identity_stat = (self.path.stat().st_size, self.path.stat().st_mtime_ns)
        return tar

    def _record(self, index: int) -> tuple[dict, str]:
        where = f"{self.path.name} sample {index}"
        size = self.identity_stat[0]
        with self._open_unchanged() as f:
            def member(offset, length) -> bytes:
                if length < 0 or offset + length > size:
                    raise BadSample("torn_tar_member", f"{where}: a member runs past the end of the file")
                f.seek(int(offset))
                return f.read(int(length))

            images = [member(*at) for at in self.image_at[self.image_starts[index]: self.image_starts[index + 1]]]
            if self.text_at[index, 1] < 0:
                raise BadSample("missing_text", f"{where} has no .txt or .json member")
            text = member(*self.text_at[index])
        try:
            decoded = text.decode("utf-8")
            record = json.loads(decoded) if self.text_json[index] else {"text": decoded}
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise BadSample("bad_json", f"{where}: its text member is not UTF-8 JSON or text") from None
        if not isinstance(record, dict):
            raise BadSample("bad_json", f"{where}: its .json member is not an object")
        if "messages" not in record and "texts" not in record:
            caption = next((record[k] for k in CAPTION_KEYS if isinstance(record.get(k), str)), "")
            record = {"text": caption}
        if "texts" in record:  # the document's image places take the members in order
            members = iter(images)
            record["images"] = [None if i is None else next(members, None) for i in record.get("images", [])]
        else:
            record["images"] = images
        return record, where


class ParquetShard(ScannedShard):
    """A Parquet file of Hugging Face datasets' layout: an ``image`` column (``{bytes, path}``) or ``images`` (a list
    of them), and ``text`` / ``caption`` or ``messages`` (chat) or ``texts`` (a document, ``images`` beside it).
    Opening reads the file's footer; a sample reads its row group (kept while the next sample is in it too), so
    shards written with small row groups (``datasets`` writes image data 100 rows a group) read fastest."""

    def _scan(self) -> np.ndarray:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"'{self.path}': reading Parquet shards needs pyarrow (pip install pyarrow, or the "
                            "package's [parquet] extra)") from None
        try:
            self.file = pq.ParquetFile(self.path)
        except Exception as err:  # pyarrow reports a damaged footer in several ways
            raise DataError(f"'{self.path}' cannot be read as Parquet: {err}") from None
        self.identity_stat = (self.path.stat().st_size, self.path.stat().st_mtime_ns)
        meta = self.file.metadata
        self.group_starts = np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
        self._group: tuple[int, list] = (-1, [])  # the row group read last, as rows
        return np.arange(int(self.group_starts[-1]), dtype=np.int64)

    def __getstate__(self) -> dict:  # a worker opens the file itself
        return {k: v for k, v in self.__dict__.items() if k not in ("file", "_group")}

    def __setstate__(self, state: dict) -> None:
        import pyarrow.parquet as pq

        self.__dict__.update(state, _group=(-1, None))
        self.file = pq.ParquetFile(self.path)

    def _record(self, index: int) -> tuple[dict, str]:
        where = f"{self.path.name} row {index}"
        group = int(np.searchsorted(self.group_starts, index, side="right") - 1)
        if self._group[0] != group:
            self._check_unchanged()
            try:
                self._group = (group, self.file.read_row_group(group).to_pylist())
            except Exception as err:  # a damaged page: the row group's samples are skipped
                raise BadSample("bad_parquet_row", f"{where}: its row group cannot be read: {err}") from None
        row = self._group[1][index - int(self.group_starts[group])]
        record = {k: v for k, v in row.items() if k in ("text", "caption", "messages", "texts", "tools")}
        if "caption" in record and "text" not in record:
            record["text"] = record.pop("caption")
        images = row.get("images") if "images" in row else [row["image"]] if row.get("image") is not None else []
        record["images"] = [_image_bytes(i, where) for i in images or []]
        return record, where


def _image_bytes(value, where: str) -> bytes | None:
    """An image cell of datasets' Image feature (``{"bytes", "path"}``), or plain bytes; None stays (a document's
    text place)."""
    if value is None or isinstance(value, bytes):
        return value
    if isinstance(value, dict) and isinstance(value.get("bytes"), bytes):
        return value["bytes"]
    raise BadSample("bad_images", f"{where}: an image cell holds no bytes (a path to a file elsewhere is not read)")
