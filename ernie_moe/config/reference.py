"""The config reference page, made from the schema's field docs: ``python -m ernie_moe.config.reference >
docs/config.md``. A test keeps the file identical to this output.
"""

from __future__ import annotations

import dataclasses

from .schema import Config

INTRO = """# Config reference

Written by `python -m ernie_moe.config.reference > docs/config.md` from the field docs of
`ernie_moe/config/schema.py`; a test fails when this file is not that command's output.

`run_trainer.py --config FILE section.key=value ...` loads the YAML, applies the overrides (YAML types:
`training.max_steps=20`, `model.moe_capacity=[2,2,2]`, `model.vision_config.depth=4`; `parallel.sharding=` empties
a string key) and validates the result.
An unknown key (with the closest valid name), a wrong type, a missing file or values that cannot work together
(heads not divisible by KV heads, `moe_k` above a modality's expert count, a layer range outside the model, ...)
stop it with one paragraph and exit code 2. The defaults below are the dataclass defaults; `configs/vl_moe.yaml`
sets its own values for some of them.
"""


def reference() -> str:
    """The whole page."""
    lines = [INTRO]
    for section in dataclasses.fields(Config):
        lines += [f"**`{section.name}`**", "", "| key | default | meaning |", "|---|---|---|"]
        lines += _rows(section.default_factory(), "")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _rows(obj, prefix: str) -> list[str]:
    rows = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            rows += _rows(value, f"{prefix}{f.name}.")
            continue
        meaning = f.metadata.get("doc", "")
        choices = f.metadata.get("choices")
        if choices:
            meaning += " (" + " / ".join(repr(c) if c == "" else str(c) for c in choices) + ")"
        default = "`''`" if value == "" else f"`{value}`"
        rows.append(f"| `{prefix}{f.name}` | {default} | {meaning} |")
    return rows


if __name__ == "__main__":
    print(reference(), end="")
