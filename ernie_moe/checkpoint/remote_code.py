"""The code an ERNIE-4.5-VL model folder names in ``auto_map``, which transformers runs with ``trust_remote_code``
to read the folder's config, tokenizer and processor (vLLM and SGLang read a folder that way: its ``model_type``
is not one transformers knows). A fine-tune of a folder that has such code keeps it: the modules its ``auto_map``
entries name (and those they import beside them) are copied, its entries and processor classes kept; a folder
without any gets this package's own modules (``hub_code/``)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from ..paths import write_output
from .engines import auto_map_files, json_object
from .errors import CheckpointError

HUB_CODE = Path(__file__).with_name("hub_code")
# this package's module, and the auto_map entries naming it, of config.json, tokenizer_config.json and the processor's
OWN: dict[str, tuple[str, dict[str, Any]]] = {
    "config.json": ("configuration_ernie_moe.py", {"AutoConfig": "configuration_ernie_moe.Ernie4_5_VLMoEConfig"}),
    "tokenizer_config.json": ("tokenization_ernie_moe.py",
                              {"AutoTokenizer": ["tokenization_ernie_moe.Ernie4_5_VLTokenizer", None]}),
    "preprocessor_config.json": ("processing_ernie_moe.py", {
        "AutoProcessor": "processing_ernie_moe.Ernie4_5_VLProcessor",
        "AutoImageProcessor": "processing_ernie_moe.Ernie4_5_VLImageProcessor"}),
}
NEEDED = {"config.json": "AutoConfig", "tokenizer_config.json": "AutoTokenizer",
          "preprocessor_config.json": "AutoProcessor"}
PROCESSOR_CLASSES = ("image_processor_type", "processor_class", "auto_map")  # a base's, kept over the run's
MAX_FILES, MAX_BYTES = 64, 4 << 20  # a folder's remote code is a handful of modules of some KiB


def ship_remote_code(folder, base=None, vl: bool = True) -> None:
    """Give the model folder ``folder`` the remote code its ``auto_map`` names: ``base`` (the folder the run
    started from, or the exported one) gives its ``.py`` modules and processor classes where it has them, this
    package's modules fill what is left. The tokenizer entry only beside a ``tokenizer.model``; a text model
    (``vl`` False, a model type transformers knows) needs only that one."""
    out = Path(folder)
    source = Path(base) if base else None
    if source is not None and source.resolve() != out.resolve():
        base_processor = json_object(source / "preprocessor_config.json")
        if base_processor and (out / "preprocessor_config.json").is_file():
            ours = json_object(out / "preprocessor_config.json")
            kept = {k: base_processor[k] for k in PROCESSOR_CLASSES if k in base_processor}
            _write(out / "preprocessor_config.json", {**base_processor, **ours, **kept})
        present = {p.name: p for p in base_modules(source)}
        for module in _needed(out, present):
            shutil.copyfile(present[module], out / module)
    for name, (module, entries) in OWN.items():
        path = out / name
        if not path.is_file() or (name == "tokenizer_config.json" and not (out / "tokenizer.model").is_file()):
            continue
        if not vl and name != "tokenizer_config.json":
            continue
        config = json_object(path)
        given = config.get("auto_map")
        auto_map: dict = given if isinstance(given, dict) else {}
        if NEEDED[name] in auto_map:
            continue
        _write(path, {**config, "auto_map": {**auto_map, **entries}})
        shutil.copyfile(HUB_CODE / module, out / module)


def base_modules(folder: Path) -> list[Path]:
    """The ``.py`` files at the top of a model folder (its remote code and the modules it imports), bounded."""
    modules = sorted(p for p in folder.glob("*.py") if p.is_file() and not p.is_symlink())
    if len(modules) > MAX_FILES:
        raise CheckpointError(f"{folder} holds {len(modules)} .py files: more than a model folder's remote code "
                              f"(at most {MAX_FILES})")
    large = [p.name for p in modules if p.stat().st_size > MAX_BYTES]
    if large:
        raise CheckpointError(f"{folder}: {', '.join(large)} larger than {MAX_BYTES >> 20} MiB, not remote code")
    return modules


def _needed(folder: Path, present: dict[str, Path]) -> list[str]:
    """The modules of ``present`` that ``folder``'s auto_map entries name, and those they import from beside them."""
    wanted = [module for name in OWN for module in auto_map_files(json_object(folder / name).get("auto_map"))]
    found: list[str] = []
    while wanted:
        module = wanted.pop()
        if module in present and module not in found:
            found.append(module)
            text = present[module].read_text(errors="replace")
            wanted += [f"{m}.py" for m in re.findall(r"^\s*from\s+\.(\w+)\s+import", text, re.MULTILINE)]
    return found


def _write(path: Path, value: dict) -> None:
    write_output(path, json.dumps(value, indent=2))
