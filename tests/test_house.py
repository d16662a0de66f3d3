"""The package's own rules: small modules, and no import cycle between its modules, counting imports
inside functions (a lazy import that only dodges a cycle is still a cycle)."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "pipetrain"
MAX_LINES = 500


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules ``name`` imports anywhere in its file, with the subpackages their import
    runs first (not ``name``'s own packages, which Python has begun before ``name``)."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[:len(package.split(".")) - node.level + 1], *filter(None, [base])])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for target in filter(known.__contains__, targets):
            parts = target.split(".")
            found.add(target)
            found |= {p for k in range(2, len(parts)) if (p := ".".join(parts[:k])) in known
                      and not name.startswith(p + ".")}
    found.discard(name)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as the list of its modules, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_module_is_over_500_lines() -> None:
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these by concern: {long}"


def test_no_import_cycle_between_the_package_modules() -> None:
    known = modules()
    graph = {name: imports(name, path, known) - {"pipetrain"} for name, path in known.items() if name != "pipetrain"}
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import(tmp_path) -> None:
    """Guards the test above: an import inside a function counts."""
    (tmp_path / "a.py").write_text("from pipetrain.b import x\n")
    (tmp_path / "b.py").write_text("def f():\n    from pipetrain.a import y\n")
    known = {"pipetrain.a": tmp_path / "a.py", "pipetrain.b": tmp_path / "b.py"}
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert find_cycle(graph) == ["pipetrain.a", "pipetrain.b", "pipetrain.a"]
