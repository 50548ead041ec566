"""The package's floors: each folder (or top-level module) imports only from floors below its own, so no import
runs up and no two folders import each other. Every import counts, those inside functions too."""

import ast
import re
from pathlib import Path

from support.runs import ROOT

PACKAGE = ROOT / "ernie_moe"
# lowest first; a part may import from any lower floor, and within itself
FLOORS = [
    {"paths"},
    {"json_files"},
    {"batch", "timing", "host_reads", "cli", "faults", "config", "elastic"},
    {"nn", "data"},
    {"moe", "objectives"},
    {"model"},
    {"parallel", "monitor"},
    {"checkpoint", "memory"},
    {"finetune"},
    {"generation"},
    {"evaluation"},
    {"training", "serving"},
    {"doctor", "generate", "evaluate", "compare", "export", "serve", "chat", "__init__"},
]
FLOOR = {part: level for level, parts in enumerate(FLOORS) for part in parts}


def part_of(path: Path, package: Path = PACKAGE) -> str:
    """The folder under ernie_moe/ a file belongs to, or the top-level module's name."""
    relative = path.relative_to(package)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def imported_parts(path: Path, root: Path = ROOT) -> set[str]:
    """The parts of the package a file imports, by relative or absolute import, wherever the import stands."""
    module = path.relative_to(root).with_suffix("").parts  # ("ernie_moe", "moe", "layer")
    package = module[:-1]  # a module's package; an __init__'s is its own folder, which [:-1] also gives
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[: len(package) - node.level + 1])
                target = base + (node.module.split(".") if node.module else [])
                names = [target + [alias.name] for alias in node.names] if not node.module else [target]
            elif node.module:
                names = [node.module.split(".")]
        elif isinstance(node, ast.Import):
            names = [alias.name.split(".") for alias in node.names]
        for target in names:
            if target[0] == "ernie_moe" and len(target) > 1:
                found.add(target[1])
    return found


def edges() -> dict[tuple[str, str], list[str]]:
    """(importing part, imported part) -> the files that make the import."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        source = part_of(path)
        for target in imported_parts(path) - {source}:
            if target in FLOOR:  # a name imported from the package's __init__ is not a part
                out.setdefault((source, target), []).append(str(path.relative_to(ROOT)))
    return out


def test_every_part_has_a_floor():
    parts = {part_of(p) for p in PACKAGE.rglob("*.py")}
    assert parts <= set(FLOOR), f"parts without a floor: {sorted(parts - set(FLOOR))}"


def test_no_import_runs_up_and_no_two_parts_import_each_other():
    found = edges()
    upward = {f"{a} -> {b}": files for (a, b), files in found.items() if FLOOR[b] >= FLOOR[a]}
    assert not upward, f"imports that run up or sideways: {upward}"
    mutual = sorted({tuple(sorted(pair)) for pair in found if pair[::-1] in found})
    assert not mutual, f"parts that import each other: {mutual}"


# the floors inside a folder, lowest first: its sub-folders, and its own modules (by name; "*": the others) above
ROOMS = {
    "data": [{"formats"}, {"encoding"}, {"feeding"}, {"held_out", "shape_tasks", "__init__"}],
    "training": [{"rollouts"}, {"*"}],
}


def room_edges(folder: str, package: Path = PACKAGE, root: Path = ROOT) -> dict[tuple[str, str], list[str]]:
    """(importing room, imported room) -> the files, for the rooms of ``folder`` (``ernie_moe/<folder>/``)."""
    base = package / folder
    out: dict[tuple[str, str], list[str]] = {}
    for path in sorted(base.rglob("*.py")):
        source = part_of(path, base)
        for module in imported_modules(path, root):
            parts = module.split(".")
            if parts[1:2] != [folder] or len(parts) < 3:
                continue
            target = parts[2]
            if target != source:
                out.setdefault((source, target), []).append(str(path.relative_to(root)))
    return out


def rooms_upward(folder: str, package: Path = PACKAGE, root: Path = ROOT) -> dict[str, list[str]]:
    floor = {room: level for level, rooms in enumerate(ROOMS[folder]) for room in rooms}
    found = room_edges(folder, package, root)
    unknown = {a for pair in found for a in pair} - set(floor)
    assert "*" in floor or not unknown, f"rooms of {folder}/ without a floor: {sorted(unknown)}"
    level = {room: floor.get(room, floor.get("*")) for pair in found for room in pair}
    rooms = {room for room in level if (package / folder / room).is_dir()}  # the sub-folders; the rest: modules
    # the folder's own modules on one floor import each other (the module cycle test holds them)
    return {f"{a} -> {b}": files for (a, b), files in found.items()
            if level[b] > level[a] or (level[b] == level[a] and {a, b} & rooms)}


def test_the_rooms_inside_a_folder_keep_their_floors():
    for folder, rooms in ROOMS.items():
        listed = {part_of(p, PACKAGE / folder) for p in (PACKAGE / folder).rglob("*.py")}
        named = set().union(*rooms) - {"*"}
        assert named <= listed and ("*" in set().union(*rooms) or listed == named), f"{folder}/: {sorted(listed)}"
        assert rooms_upward(folder) == {}, folder


def test_a_room_importing_up_is_found(tmp_path):
    """The room walk finds an import up a folder's floors (formats importing feeding), so the test above can
    fail."""
    for room in ("formats", "feeding"):
        (tmp_path / "ernie_moe" / "data" / room).mkdir(parents=True)
    (tmp_path / "ernie_moe" / "data" / "feeding" / "loader.py").write_text("from ..formats import sample\n")
    (tmp_path / "ernie_moe" / "data" / "formats" / "sample.py").write_text("X = 1\n")
    assert rooms_upward("data", tmp_path / "ernie_moe", tmp_path) == {}
    (tmp_path / "ernie_moe" / "data" / "formats" / "jsonl.py").write_text(
        "def later():\n    from ..feeding.loader import rows\n")
    assert list(rooms_upward("data", tmp_path / "ernie_moe", tmp_path)) == ["formats -> feeding"]


def test_the_walk_sees_relative_absolute_and_deferred_imports(tmp_path):
    """The walk itself finds an import of each kind, so the test above can fail."""
    folder = tmp_path / "ernie_moe" / "nn"
    folder.mkdir(parents=True)
    probe = folder / "probe.py"
    probe.write_text("from . import kernels\nfrom ..moe.layer import MoELayer\nimport ernie_moe.model.blocks\n"
                     "from ernie_moe.parallel import plan\n\n\ndef later():\n    from ..training import Trainer\n"
                     "    from .. import checkpoint\n")
    assert imported_parts(probe, tmp_path) == {"nn", "moe", "model", "parallel", "training", "checkpoint"}
    (folder / "__init__.py").write_text("from .probe import later\nfrom ..data import loader\n")
    assert imported_parts(folder / "__init__.py", tmp_path) == {"nn", "data"}


def imported_modules(path: Path, root: Path = ROOT) -> set[str]:
    """The package's modules a file imports (``ernie_moe.generation.decoding``), wherever the import stands: a
    name imported from a module is that module, one that is itself a module is that one."""
    module = path.relative_to(root).with_suffix("").parts
    package = module[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            stem = base + (node.module.split(".") if node.module else [])
            targets = [stem + [alias.name] for alias in node.names]
        elif isinstance(node, ast.Import):
            targets = [alias.name.split(".") for alias in node.names]
        for target in targets:
            while target and not (root / Path(*target)).with_suffix(".py").is_file():
                target = target[:-1]  # a name in a module, or a package: the module that holds it
            if target and target[0] == "ernie_moe":
                found.add(".".join(target))
    return found


def test_no_two_modules_import_each_other_through_any_path():
    """Within a folder too: no module reaches itself through the modules it imports (package __init__ files,
    which gather their modules' names, left out)."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name != "__init__.py":
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            graph[name] = {m for m in imported_modules(path) if not m.endswith("__init__")} - {name}
    cycles = []

    def visit(node, trail):
        for nxt in graph.get(node, ()):
            if nxt in trail:
                cycles.append(trail[trail.index(nxt):] + [nxt])
            elif nxt not in done:
                visit(nxt, trail + [nxt])
        done.add(node)

    done: set[str] = set()
    for start in sorted(graph):
        if start not in done:
            visit(start, [start])
    assert not cycles, f"modules that import each other: {cycles[:5]}"
    probe = ROOT / "ernie_moe" / "generation" / "speculative.py"
    assert "ernie_moe.generation.decoding" in imported_modules(probe)  # the walk sees a sibling's names


def layout_entries() -> dict[str, str]:
    """The README's Layout block: each entry (``nn/``, ``batch.py``) and its text."""
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("## Layout"):]
    block = block[block.index("```\n") + 4:]
    block = block[: block.index("```")]
    entries, name = {}, None
    for line in block.splitlines()[1:]:  # after "ernie_moe/"
        found = re.match(r"^  (\S+)", line)
        if found:
            name = found[1]
            entries[name] = line
        elif name is not None:
            entries[name] += " " + line.strip()
    return entries


def room_text(entry: str, room: str) -> str:
    """What a folder's entry says of one of its sub-folders: from ``room/`` to the next sub-folder's name."""
    found = re.search(rf"(?:^|\s){re.escape(room)}/\s(.*?)(?=\s\w+/\s|$)", entry)
    return found[1] if found else ""


def test_the_readme_layout_names_every_module_and_the_floors_in_order():
    entries = layout_entries()
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if len(relative.parts) == 1:
            if relative.name != "__init__.py" and relative.name not in entries:
                missing.append(str(relative))
            continue
        if relative.name in ("__init__.py", "__main__.py"):
            continue
        said = entries.get(f"{relative.parts[0]}/", "")
        for room in relative.parts[1:-1]:  # a module in a sub-folder is named under that sub-folder's name
            said = room_text(said, room)
        if not re.search(rf"\b{re.escape(relative.name)}\b", said):
            missing.append(str(relative))
    assert not missing, f"modules the README's Layout does not name: {missing}"
    floors = "; ".join(", ".join(f"`{p}`" for p in sorted(floor)) for floor in FLOORS)
    assert floors in " ".join((ROOT / "README.md").read_text().split()), floors


def test_test_modules_share_helpers_through_support_alone():
    """A test module imports no other test module and not conftest: what they share is in ``tests/support``
    (fixtures in conftest reach tests by name)."""
    tests = ROOT / "tests"
    found = {}
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            wrong = [n for n in names if n.split(".")[0] == "conftest" or n.split(".")[0].startswith("test_")]
            if wrong:
                found.setdefault(str(path.relative_to(tests)), []).extend(wrong)
    assert found == {}
    assert not any(p.name.startswith("test_") for p in (tests / "support").iterdir())
