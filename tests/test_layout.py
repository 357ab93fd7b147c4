"""The package's shape: no import circles, arrows one way, no oversized modules (read from the source, not run)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import replicator

PACKAGE = Path(replicator.__file__).resolve().parent
# Rooms above the core: they may import the core, never the other way round.
OUTER_ROOMS = ("replicator.cli", "replicator.report", "replicator.testing", "replicator.demo", "replicator.launch")
NEVER_IMPORTED_BY_THE_CORE = (*OUTER_ROOMS, "examples", "benchmarks")
MAX_MODULE_LINES = 500
MAX_FACADE_LINES = 350
MAX_CONSTRUCTOR_LINES = 35


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str) -> set[str]:
    """The modules `name` imports, at module level, inside functions or for type checking only."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                # `from pkg import module` is an arrow to the module; `from pkg import name`, to pkg.
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return found


def import_graph() -> dict[str, set[str]]:
    return {name: {target for target in imports_of(name) if target in MODULES and target != name} for name in MODULES}


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (circle := walk(target)):
                return circle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (circle := walk(start)):
            return circle
    return None


def test_the_circle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_circle(graph) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set()}) is None


def test_no_import_circle_in_the_package() -> None:
    circle = find_circle(import_graph())
    assert circle is None, "import circle: " + " -> ".join(circle or [])


def test_the_core_never_imports_the_rooms_above_it() -> None:
    wrong = []
    for name in MODULES:
        if name.startswith(OUTER_ROOMS):
            continue
        for target in imports_of(name):
            if target.startswith(NEVER_IMPORTED_BY_THE_CORE):
                wrong.append(f"{name} imports {target}")
    assert not wrong, "the core imports a room above it: " + "; ".join(wrong)


def test_modules_stay_small() -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    too_long = {name: lines for name, lines in sizes.items() if lines > MAX_MODULE_LINES}
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines: {too_long}"
    assert sizes["replicator.replicator"] <= MAX_FACADE_LINES, "the facade should only hand off"


def test_every_module_says_what_it_is() -> None:
    undocumented = [name for name, path in MODULES.items()
                    if path.read_text().strip() and not ast.get_docstring(ast.parse(path.read_text()))]
    assert not undocumented, f"modules without a docstring: {undocumented}"


def facade_class() -> ast.ClassDef:
    tree = ast.parse(MODULES["replicator.replicator"].read_text())
    return next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Replicator")


def test_the_facade_constructor_only_hands_off() -> None:
    init = next(node for node in facade_class().body if isinstance(node, ast.FunctionDef) and node.name == "__init__")
    body_lines = init.body[-1].end_lineno - init.body[0].lineno + 1  # type: ignore[operator]
    assert body_lines <= MAX_CONSTRUCTOR_LINES, f"Replicator.__init__'s body has {body_lines} lines"


def test_the_facade_leaves_the_modes_to_their_regimes() -> None:
    """A mode's details (DiLoCo's outer loop, the servers' settings, actor–learner's roles) live behind the regime
    that the mode builds: the facade's code names none of them (its docstrings may; rp.DiLoCo, the config, it may)."""
    source = MODULES["replicator.replicator"].read_text()
    code = ast.unparse(_without_docstrings(ast.parse(source)))
    named = sorted(set(re.findall(r"\b(diloco|settings|roles)\b", code)))
    assert not named, f"replicator/replicator.py names {named} outside its docstrings"


def _without_docstrings(tree: ast.Module) -> ast.Module:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(node) is not None:
            node.body = node.body[1:] or [ast.Pass()]
    return tree


def test_the_asynchronous_modes_send_nothing_point_to_point_by_hand() -> None:
    """The asynchronous regimes talk over the peer link (comm.peer_link, or its Gloo fallback in comm): no raw
    torch.distributed send or receive of their own, whose one-sided waits cannot name a dead peer."""
    raw = re.compile(r"\bdist\.(i?send|i?recv)\(")
    offenders = [name for name, path in MODULES.items()
                 if name.startswith("replicator.asynchronous") and raw.search(path.read_text())]
    assert not offenders, f"raw point-to-point calls in {offenders}"


def test_process_groups_are_made_in_one_place() -> None:
    """Every process group comes from topology.group_of_mine: new_group is collective over the whole job, and one
    builder keeps the rule (every process, the same partition, in the same order) in one place."""
    offenders = [name for name, path in MODULES.items()
                 if name != "replicator.topology" and re.search(r"\bnew_(sub)?groups?\(", path.read_text())]
    assert not offenders, f"process groups made outside replicator.topology in {offenders}"
