"""YAML + ``section.key=value`` overrides -> a validated :class:`Config`.

Every problem becomes a :class:`ConfigError` whose message is one paragraph a user can act on.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Sequence
from pathlib import Path

import yaml

from .errors import ConfigError, collecting, raise_all, report
from .kinds import fits
from .model_folder import grown_keys, model_config_from, tuning_keys
from .schema import Config
from .validate import problems_of


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (), check_paths: bool = True,
                base: dict | None = None) -> Config:
    """``base``: sections under the YAML file's (a model folder's own settings, which the file overrides)."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file '{path}' does not exist.")
        if not path.is_file():
            raise ConfigError(f"config file '{path}' is not a regular file.")
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"config file '{path}' is {path.stat().st_size} bytes; a config is at most "
                              f"{MAX_CONFIG_BYTES} bytes.")
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as err:
            raise ConfigError(f"config file '{path}' is not UTF-8 text ({err.reason} at byte {err.start}).") from None
        try:
            raw = _plain_yaml(text, f"config file '{path}'")
        except yaml.YAMLError as err:
            raise ConfigError(f"config file '{path}' is not valid YAML: {err}") from None
        if raw is None:
            raise ConfigError(f"config file '{path}' is empty; start from configs/vl_moe.yaml.")
        if not isinstance(raw, dict):
            raise ConfigError(f"config file '{path}' must hold a mapping of sections, not {type(raw).__name__}.")
    raw = _overlay(base or {}, _nested_flat_keys(raw))
    given: dict = {}  # what the command line set, which a model folder's own settings must agree with
    for item in overrides:
        _apply_override(raw, item)
        _apply_override(given, item)
    problems: list[str] = []
    _start_from_checkpoint(raw, given, check_paths, problems)
    cfg = None
    with collecting(problems):
        cfg = build(Config, raw, "")
    if cfg is None:
        raise_all(problems)
    # a key that did not build holds its default: leave out the checks that would judge that
    unbuilt = set(re.findall(r"\b(?:model|data|training|parallel|logging)\.[\w.]+", " ".join(problems)))
    later = problems_of(cfg, check_paths)
    raise_all(problems + [p for p in later if not any(key in p for key in unbuilt)])
    return cfg


MAX_CONFIG_BYTES = 1 << 20
MAX_YAML_DEPTH = 32  # a config is two levels deep (three with vision_config); far past that it is no config


def _plain_yaml(text: str, what: str):
    """YAML of plain values: no anchors or aliases (a few hundred bytes of them expand past any memory) and no
    nesting past :data:`MAX_YAML_DEPTH`, both judged on the parser's events before anything is built.
    ConfigError naming ``what``; yaml.YAMLError for text that is not YAML."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
            raise ConfigError(f"{what} uses a YAML anchor or alias (&name / *name); a config holds plain values: "
                              "write each value out.")
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_YAML_DEPTH:
                raise ConfigError(f"{what} nests more than {MAX_YAML_DEPTH} levels deep: not a config.")
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
    return yaml.load(text, Loader=_UniqueKeyLoader)


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error (PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key '{key}' is given twice",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _start_from_checkpoint(raw: dict, given: dict, check_paths: bool, problems: list[str]) -> None:
    """With ``training.model_name_or_path`` the checkpoint's config.json describes the model, over the config
    file's ``model`` section (which describes a model of its own), except the run's choices (router loss
    weights, capacity, MTP depths: :func:`tuning_keys`). The command line may change the expert layout
    (:func:`grown_keys`, which the loader grows); a command-line key that contradicts the rest of the folder's
    architecture is a problem naming both values. The folder's tokenizer is used unless ``data.tokenizer_path``
    names another. Without ``check_paths`` (the memory planner on another machine) a folder that is not there is
    skipped: the model section describes the model."""
    training = raw.get("training")
    source = training.get("model_name_or_path") if isinstance(training, dict) else None
    if not source or not isinstance(source, str) or (not check_paths and not Path(source).exists()):
        return
    try:
        folder = model_config_from(source)
    except (OSError, ValueError) as err:
        raise ConfigError(f"training.model_name_or_path: {err}") from None
    said, model = given.get("model"), raw.get("model")
    said, model = said if isinstance(said, dict) else {}, model if isinstance(model, dict) else {}
    own = {key: value for key, value in folder.items() if key not in tuning_keys()}
    raw["model"] = _overlay(_overlay(_overlay(folder, model), own), said)
    told = _flat(said)
    for key, value in _flat(own).items():
        if key not in grown_keys() and told.get(key, value) != value:
            problems.append(f"model.{key}={told[key]!r} on the command line contradicts {source}: its config.json "
                            f"gives {key} = {value!r}. A model folder sets its own architecture: leave model.{key} "
                            "out (or start from a folder of that shape).")
    data = raw.setdefault("data", {})
    if isinstance(data, dict) and not data.get("tokenizer_path") and (Path(source) / "tokenizer.model").is_file():
        data["tokenizer_path"] = source


def _flat(section: dict, prefix: str = "") -> dict:
    """``{"vision_config": {"depth": 2}}`` -> ``{"vision_config.depth": 2}``."""
    out = {}
    for key, value in section.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _overlay(base: dict, top: dict) -> dict:
    merged = dict(base)
    for key, value in top.items():
        merged[key] = _overlay(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) \
            else value
    return merged


# the keys of a section inside ``training`` are also read flat, by a prefix: training.dpo_beta is training.dpo.beta
FLAT_PREFIXES = {"dpo_": "dpo", "rl_": "rl"}


def _nested(parts: list[str]) -> list[str]:
    """A key's path with a flat ``training.<prefix><key>`` read as ``training.<section>.<key>``."""
    if len(parts) == 2 and parts[0] == "training":
        for prefix, section in FLAT_PREFIXES.items():
            if parts[1].startswith(prefix) and len(parts[1]) > len(prefix):
                return ["training", section, parts[1][len(prefix):]]
    return parts


def _nested_flat_keys(raw):
    """``raw`` with its flat ``training`` keys moved into their sections; a key given both ways is an error."""
    training = raw.get("training") if isinstance(raw, dict) else None
    if not isinstance(training, dict):
        return raw
    for key in [k for k in training if isinstance(k, str)]:
        path = _nested(["training", key])
        if len(path) == 2:
            continue
        inner = training.setdefault(path[1], {})
        if not isinstance(inner, dict):
            continue  # the section given as a value: its build says so
        if path[2] in inner:
            raise ConfigError(f"training.{key} and training.{path[1]}.{path[2]} are one key, given twice; keep one.")
        inner[path[2]] = training.pop(key)
    return raw


def _apply_override(raw: dict, item: str) -> None:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override '{item}' must look like section.key=value (e.g. training.max_steps=20).")
    parts = _nested(key.strip().split("."))
    if len(parts) < 2:
        raise ConfigError(f"override '{item}' names no section; {_override_hint(parts[0], value)}")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override '{item}': '{part}' is a value, not a section.")
    if not value.strip():  # ``key=`` empties a string key (YAML would read nothing as null)
        node[parts[-1]] = ""
        return
    try:
        node[parts[-1]] = _plain_yaml(value, f"override '{item}'")
    except yaml.YAMLError:
        node[parts[-1]] = value  # not YAML: the text itself


def _sections_with(key: str) -> list[str]:
    """The config's sections that have a key of this name."""
    return [name for name, section in typing.get_type_hints(Config).items()
            if key in {f.name for f in dataclasses.fields(section)}]


def _override_hint(key: str, value: str) -> str:
    """How to write ``key=value`` with its section: the sections that have such a key, else what a section is."""
    sections = typing.get_type_hints(Config)
    if key in sections:
        example = dataclasses.fields(sections[key])[0].name
        return f"'{key}' is a section, not a key: write {key}.<key>={value} (e.g. {key}.{example})."
    owners = _sections_with(key)
    if owners:
        return "write " + " or ".join(f"{owner}.{key}={value}" for owner in owners) + "."
    return f"write section.key=value, the section one of {', '.join(sections)}."


def build(cls, raw, where: str):
    """Build dataclass ``cls`` from a mapping, checking every key and type."""
    label = where or "the config"
    if not isinstance(raw, dict):
        raise ConfigError(f"{label} must be a mapping of keys, got {raw!r}.")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in raw.items():
        try:
            values[key] = _build_value(cls, key, value, where, fields, hints)
        except ConfigError as err:
            report(str(err))  # noted, and the other keys built, when the caller collects problems
    return cls(**values)


def _build_value(cls, key, value, where: str, fields: dict, hints: dict):
    """One key of ``cls`` built from ``value`` (a section: built whole); ConfigError naming it."""
    if key not in fields:
        owners = [f"{owner}.{key}" for owner in _sections_with(str(key)) if owner != where]
        close = difflib.get_close_matches(str(key), fields, n=1)
        if owners:  # the key itself, misplaced: its section, before any look-alike here
            hint = f" It is a key of another section: {' or '.join(owners)}."
        else:
            hint = f" Did you mean '{close[0]}'?" if close else f" Valid keys: {', '.join(fields)}."
        raise ConfigError(f"unknown key '{_join(where, key)}'.{hint}")
    name = _join(where, key)
    hint = hints[key]
    if dataclasses.is_dataclass(hint):
        return build(hint, value if value is not None else {}, name)
    choices = fields[key].metadata.get("choices")
    if value is False and choices and "off" in choices:
        value = "off"  # YAML 1.1 reads a bare off as false
    built = _coerce(value, hint, name)
    if choices and built not in choices:
        options = ", ".join(repr(c) for c in choices)
        raise ConfigError(f"{name} = {value!r} is not one of {options}.")
    return built


def _join(where: str, key) -> str:
    return f"{where}.{key}" if where else str(key)


def _coerce(value, hint, name: str):
    """Accept ``value`` when it fits ``hint`` (YAML rules: an int is a valid float, nothing else converts)."""
    for option in _union_members(hint):
        ok, converted = fits(value, option)
        if ok:
            texts = converted if isinstance(converted, list) else [converted]
            if any(isinstance(t, str) and "\x00" in t for t in texts):  # no file name or text holds one
                raise ConfigError(f"{name} = {value!r} holds a NUL byte (\\x00).")
            # no setting is infinite or not a number: one would reach the arithmetic and end the run at its step
            if any(isinstance(t, float) and not math.isfinite(t) for t in texts):
                raise ConfigError(f"{name} = {value!r} is not a finite number.")
            return converted
    raise ConfigError(f"{name} = {value!r} has the wrong type: expected {_describe(hint)}.")


def _union_members(hint):
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _describe(hint) -> str:
    names = []
    for option in _union_members(hint):
        if typing.get_origin(option) is list:
            names.append(f"a list of {typing.get_args(option)[0].__name__}")
        else:
            names.append({bool: "true/false", int: "an integer", float: "a number", str: "a string"}[option])
    return " or ".join(names)
