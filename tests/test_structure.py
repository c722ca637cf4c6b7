"""The import graph of the mptier package: no cycles, no arrows back up, one door into
the workers; and no module past about 400 lines that does not say why.

Every import counts, also those inside functions and under ``TYPE_CHECKING`` (a type
that needs the importer is a cycle all the same), except a package ``__init__``'s
``TYPE_CHECKING`` block, which only mirrors its lazy exports for type checkers.
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).parent.parent / "mptier"


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """``{module: modules it imports}`` over mptier's own modules."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        tree = ast.parse(path.read_text())
        mirrored: set[int] = set()
        if path.name == "__init__.py":
            for node in ast.walk(tree):
                if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                    mirrored.update(id(n) for n in ast.walk(node))
        for node in ast.walk(tree):
            if id(node) in mirrored:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    package = name.split(".")
                    if path.name != "__init__.py":
                        package.pop()
                    package = package[:len(package) - node.level + 1]
                    base = ".".join(package + ([node.module] if node.module else []))
                # "from pkg import mod" imports pkg.mod; "from pkg import name", pkg.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base
                           for a in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in paths and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_imports_inside_functions_and_for_types():
    graph = import_graph()
    assert "mptier.workers.caretaker" in graph["mptier.workers.context"]  # in a function
    assert "mptier.workers.session" in graph["mptier.workers.contract"]  # TYPE_CHECKING


def test_cycles_are_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_among_mptier_modules():
    assert cycles(import_graph()) == []


def _importers(graph: dict[str, set[str]], prefix: str, target: str) -> list[str]:
    return sorted(m for m, deps in graph.items() if (m == prefix or m.startswith(prefix + "."))
                  and any(d == target or d.startswith(target + ".") for d in deps))


def test_no_arrows_back_up():
    """The floors below do not import the floors above: storage knows no configuration,
    the workers no engine-side module, the monitor no command line."""
    graph = import_graph()
    assert _importers(graph, "mptier.storage", "mptier.config") == []
    for above in ("mptier.channels", "mptier.manager", "mptier.ledger", "mptier.lookup"):
        assert _importers(graph, "mptier.workers", above) == [], above
    assert _importers(graph, "mptier.monitor", "mptier.cli") == []
    assert _importers(graph, "mptier.native", "mptier.storage") == []


def test_the_engine_side_enters_the_workers_by_their_door():
    graph = import_graph()
    outside = [m for m in graph if not m.startswith("mptier.workers")]
    bypass = {m: sorted(d for d in graph[m] if d.startswith("mptier.workers."))
              for m in outside}
    assert {m: d for m, d in bypass.items() if d} == {}


# A module past this many lines is asking to be split (the house style says about 400);
# one that stays longer says why at its top.
MODULE_LINES = 400
REASON = "Long because"


def long_modules_without_a_reason(package: pathlib.Path) -> list[str]:
    unexplained = []
    for path in sorted(package.rglob("*.py")):
        text = path.read_text()
        n_lines = len(text.splitlines())
        if n_lines > MODULE_LINES and REASON not in (ast.get_docstring(ast.parse(text)) or ""):
            unexplained.append(f"{path.relative_to(package.parent)} ({n_lines} lines)")
    return unexplained


def test_a_long_module_is_found_unless_it_says_why(tmp_path):
    package = tmp_path / "mptier"
    package.mkdir()
    body = "x = 1\n" * MODULE_LINES
    (package / "short.py").write_text('"""Short."""\n' + "x = 1\n" * (MODULE_LINES - 1))
    (package / "long.py").write_text('"""Long."""\n' + body)
    (package / "kept.py").write_text(f'"""Kept.\n\n{REASON} it must be."""\n' + body)
    assert long_modules_without_a_reason(package) == [f"mptier/long.py ({MODULE_LINES + 1} lines)"]


def test_every_module_past_400_lines_says_why_at_its_top():
    """Split it, or write a paragraph starting "Long because" in its docstring."""
    assert long_modules_without_a_reason(PACKAGE) == []
