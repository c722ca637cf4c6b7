"""The import graph of the mptier package: no cycles, no arrows back up, one door into
the workers; and no module past about 400 lines that does not say why. The C files of
the native core likewise: no cycle among their includes and calls, and each calls only
into the floors below it that mptier_native.h names.

Every import counts, also those inside functions and under ``TYPE_CHECKING`` (a type
that needs the importer is a cycle all the same), except a package ``__init__``'s
``TYPE_CHECKING`` block, which only mirrors its lazy exports for type checkers. For C,
a file uses another when it includes it or names a function the other defines (a call,
or a function passed as a pointer), comments and string literals left out.
"""

from __future__ import annotations

import ast
import pathlib
import re

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


# -- the C files of the native core ------------------------------------------------------

NATIVE = PACKAGE / "native"
HEADER = "mptier_native.h"
_C_NOISE = re.compile(r'/\*.*?\*/|//[^\n]*|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'',
                      re.DOTALL)
_C_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
_C_NAME = re.compile(r"\b[A-Za-z_]\w*\b")
_C_WORD = re.compile(r"\w+")


def _c_code(text: str) -> str:
    """The text without comments, and string and character literals emptied (their
    quotes kept: an include's name is read before this)."""
    return _C_NOISE.sub(lambda m: '""' if m.group(0)[0] == '"' else
                        "''" if m.group(0)[0] == "'" else " ", text)


def _close_paren(code: str, start: int) -> int:
    """Index just past the parenthesis that closes the one at ``start``."""
    depth = 0
    for i in range(start, len(code)):
        depth += {"(": 1, ")": -1}.get(code[i], 0)
        if depth == 0:
            return i + 1
    return len(code)


def c_definitions(code: str) -> dict[str, bool]:
    """``{function: exported}`` of the functions a C file defines (``exported``: not
    static): a name at brace depth 0 whose parameter list is followed by a body."""
    found: dict[str, bool] = {}
    depth, since = 0, 0  # since: where the current top-level declaration began
    i = 0
    while i < len(code):
        c = code[i]
        if c in "{}":
            depth += 1 if c == "{" else -1
            since = i + 1
        elif c == ";" and depth == 0:
            since = i + 1
        elif depth == 0 and (c.isalnum() or c == "_"):
            name = _C_WORD.match(code, i).group(0)  # a name, or a number (no "(" after)
            after = i + len(name)
            if name != "__attribute__" and code[after:after + 200].lstrip().startswith("("):
                close = _close_paren(code, code.index("(", after))
                if code[close:].lstrip().startswith("{"):
                    found[name] = "static" not in _C_NAME.findall(code[since:i])
                after = close
            i = after
            continue
        i += 1
    return found


def c_graph(folder: pathlib.Path) -> dict[str, set[str]]:
    """``{file: files it uses}`` over the .c and .h files of ``folder`` (module
    docstring: an include, or a function of the other file named -- by a .c file: a
    header's declarations are no use of the files defining them)."""
    texts = {p.name: p.read_text() for p in sorted(folder.glob("*.[ch]"))}
    codes = {name: _c_code(text) for name, text in texts.items()}
    owner: dict[str, str] = {}
    for name, code in codes.items():
        for function, exported in c_definitions(code).items():
            if exported:
                assert function not in owner, f"{function} defined in {owner[function]} " \
                                              f"and {name}"
                owner[function] = name
    graph: dict[str, set[str]] = {name: set() for name in texts}
    for name, text in texts.items():
        graph[name].update(inc for inc in _C_INCLUDE.findall(text) if inc in texts)
        if name.endswith(".c"):
            used = set(_C_NAME.findall(codes[name]))
            graph[name].update(owner[f] for f in used if f in owner and owner[f] != name)
    return graph


def header_floors(header: str) -> dict[str, int]:
    """The floors the header's file list gives the C files (``  2  block.c  ...``)."""
    return {name: int(floor) for floor, name in
            re.findall(r"^ \*\s+(\d+)\s+(\w+\.c)\s", header, re.MULTILINE)}


def test_the_c_graph_sees_calls_pointers_and_includes(tmp_path):
    (tmp_path / "a.h").write_text("int a_one(void);\nint b_two(int x);\n")
    (tmp_path / "a.c").write_text(
        '#include "a.h"\n/* b_two() in a comment is no call */\n'
        'static int a_local(int x) { return x; }\n'
        'int a_one(void)\n{\n    const char *s = "c_three()";\n    return b_two(1);\n}\n')
    (tmp_path / "b.c").write_text(
        '#include "a.h"\nstatic __attribute__((unused)) int b_local(void) { return 0; }\n'
        'int b_two(int x)\n{\n    int (*f)(void) = c_three;\n    return x + f();\n}\n')
    (tmp_path / "c.c").write_text("int c_three(void) { return 3; }\n")
    assert c_definitions(_c_code((tmp_path / "b.c").read_text())) == {
        "b_local": False, "b_two": True}
    assert c_graph(tmp_path) == {"a.h": set(), "a.c": {"a.h", "b.c"}, "b.c": {"a.h", "c.c"},
                                 "c.c": set()}
    (tmp_path / "c.c").write_text("int c_three(void) { return a_one(); }\n")
    assert cycles(c_graph(tmp_path)) == [["a.c", "b.c", "c.c"]]


def test_no_cycle_among_the_c_files():
    assert cycles(c_graph(NATIVE)) == []


def test_each_c_file_calls_only_into_the_floors_below_it():
    """mptier_native.h lists every C file the build compiles with its floor; a file uses
    files of lower floors only (a file on the same floor is no use of it either)."""
    from mptier.native import build_ffi

    floors = header_floors((NATIVE / HEADER).read_text())
    assert sorted(floors) == sorted(build_ffi.C_FILES) == sorted(
        p.name for p in NATIVE.glob("*.c"))
    upward = {name: sorted(d for d in deps if d.endswith(".c") and floors[d] >= floors[name])
              for name, deps in c_graph(NATIVE).items() if name.endswith(".c")}
    assert {name: deps for name, deps in upward.items() if deps} == {}
