"""The imports inside ``shardzoo.train`` form no circle (top-level and function-local alike)."""

import ast
import pathlib

import shardzoo

ROOT = pathlib.Path(shardzoo.__file__).parent
PACKAGE = "shardzoo.train"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("shardzoo", *parts))


def imports_of(source: str, name: str, is_package: bool, modules) -> set[str]:
    """The ``modules`` that module ``name`` (its ``source``) imports anywhere: at the top, inside
    functions, relative or absolute, as ``from pkg import module`` or ``from module import x``.
    A module of a subpackage also imports its package (Python runs its ``__init__`` first),
    ``shardzoo.train`` aside: it is imported before any of its modules."""
    package = name if is_package else name.rpartition(".")[0]
    parent = name.rpartition(".")[0]
    found = {parent} if parent in modules and parent != PACKAGE else set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def train_imports() -> dict[str, set[str]]:
    """Each module of ``shardzoo.train`` -> the ``shardzoo.train`` modules it imports."""
    modules = {_module_name(p): p for p in (ROOT / "train").rglob("*.py")}
    return {name: imports_of(path.read_text(), name, path.name == "__init__.py", modules)
            for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` as a path that returns to its start, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_reads_function_local_relative_and_package_imports():
    modules = {PACKAGE, f"{PACKAGE}.program", f"{PACKAGE}.tasks", f"{PACKAGE}.tasks.grpo", f"{PACKAGE}.io",
               f"{PACKAGE}.io.sources"}
    source = ("def f():\n    from shardzoo.train.io.sources import open_source\n"
              "from .. import program\nimport shardzoo.train.tasks\n")
    assert imports_of(source, f"{PACKAGE}.tasks.grpo", False, modules) == {
        f"{PACKAGE}.io.sources", f"{PACKAGE}.program", f"{PACKAGE}.tasks"}


def test_train_imports_form_no_cycle():
    graph = train_imports()
    assert f"{PACKAGE}.program" in graph and f"{PACKAGE}.tasks.registry" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "train/ imports form a circle: " + " -> ".join(cycle)
