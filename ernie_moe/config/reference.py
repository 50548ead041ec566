"""Print the config reference as Markdown: ``python -m ernie_moe.config.reference``.

The README embeds this output; a test keeps the two identical.
"""

from __future__ import annotations

import dataclasses

from .schema import Config


def reference() -> str:
    lines = []
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
