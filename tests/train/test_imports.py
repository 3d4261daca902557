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


def train_imports() -> dict[str, set[str]]:
    """Each module of ``shardzoo.train`` -> the ``shardzoo.train`` modules it imports anywhere
    in its source (a package's ``__init__`` stands for the package). A module of a subpackage
    also imports its package (Python runs the ``__init__`` first), ``shardzoo.train`` aside:
    it is imported before any of its modules."""
    modules = {_module_name(p): p for p in (ROOT / "train").rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        parent = name.rpartition(".")[0]
        found = {parent} if parent in modules and parent != PACKAGE else set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                # ``from pkg import module`` names a module; ``from module import name`` its module
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            found.update(t for t in targets if t in modules and t != name)
        graph[name] = found
    return graph


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


def test_reads_function_local_imports():
    graph = train_imports()
    assert graph, "no modules found under train/"
    assert all(m.startswith(PACKAGE) for m in graph)


def test_train_imports_form_no_cycle():
    cycle = find_cycle(train_imports())
    assert cycle is None, "train/ imports form a circle: " + " -> ".join(cycle)
