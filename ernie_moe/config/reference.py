"""The config reference page, made from the schema's field docs: ``python -m ernie_moe.config.reference >
docs/config.md``. A test keeps the file identical to this output.
"""

from __future__ import annotations

import dataclasses
import typing

from .schema import Config

INTRO = """# Config reference

Written by `python -m ernie_moe.config.reference > docs/config.md` from the field docs of
`ernie_moe/config/schema.py`; a test fails when this file is not that command's output.

`run_trainer.py --config FILE section.key=value ...` loads the YAML, applies the overrides (YAML types:
`training.max_steps=20`, `model.moe_capacity=[2,2,2]`, `model.vision_config.depth=4`; `parallel.sharding=` empties
a string key) and validates the result.
An unknown key (with the closest valid name), a wrong type, a missing file or values that cannot work together
(heads not divisible by KV heads, `moe_k` above a modality's expert count, a layer range outside the model, ...)
stop it with exit code 2 and one paragraph per problem, every problem of the config in the one launch. The
defaults below are the dataclass defaults; `configs/vl_moe.yaml` sets its own values for some of them.

A run started from a model folder (`training.model_name_or_path`) takes its architecture and its image placeholder
from the folder's `config.json`, whatever the config file's `model` section says (that section describes a model
of its own: the default config's tiny one), so any config file starts any folder. The run's choices still come from
the file and the command line: `moe_capacity`, the router loss weights, `global_aux_loss`,
`num_nextn_predict_layers` and `multi_token_pred_lambda`, `max_position_embeddings`. On the command line the
expert layout may change too (`moe_num_experts`, `moe_intermediate_size`, the MoE layer range, `moe_k`, shared
experts, `moe_use_aux_free`: a dense model is upcycled into experts, a text MoE given vision experts); any other
`model.` key there that contradicts the folder is a problem naming both values.
"""


def reference() -> str:
    """The whole page."""
    lines = [INTRO]
    sections = typing.get_type_hints(Config)
    for section in dataclasses.fields(Config):
        lines += [f"**`{section.name}`**", "", "| key | default | meaning |", "|---|---|---|"]
        lines += _rows(sections[section.name](), "")  # each section's defaults
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
