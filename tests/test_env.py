"""Environment variables are declared once (dspine/env.py) and documented once (docs/environment.md).

- every declared variable has a row in the doc's table with its default, and the table has no other;
- no module under dspine/ but env.py reads `os.environ` / `os.getenv` (an AST scan). Passing the
  whole environment on to a child process (`dict(os.environ)`, `{**os.environ, ...}`,
  `os.environ.copy()`, `env=os.environ`) and writing a variable are not reads.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from dspine import env

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dspine"
DOC = ROOT / "docs" / "environment.md"

# `| `NAME` | default | meaning |`
ROW = re.compile(r"^\|\s*`(?P<name>[A-Z][A-Z0-9_]*)`\s*\|(?P<default>[^|]*)\|(?P<meaning>.*)\|\s*$")


def documented_rows() -> dict[str, tuple[str, str]]:
    rows: dict[str, tuple[str, str]] = {}
    for line in DOC.read_text().splitlines():
        match = ROW.match(line.strip())
        if match:
            assert match["name"] not in rows, f"docs/environment.md lists {match['name']} twice"
            rows[match["name"]] = (match["default"].strip(), match["meaning"].strip())
    return rows


def default_as_documented(value) -> str:
    """How the table writes a declared default: unset, 0/1, comma lists, ~ for the home folder."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{int(value)}`"
    if isinstance(value, tuple):
        return "`" + ",".join(str(v) for v in value) + "`"
    if isinstance(value, Path):
        home = str(Path.home())
        text = str(value)
        return "`" + ("~" + text[len(home):] if text.startswith(home + "/") else text) + "`"
    return f"`{value}`"


def test_every_declared_variable_is_documented_with_its_default():
    rows = documented_rows()
    assert rows, "docs/environment.md has no `| `NAME` | default | meaning |` rows"
    missing = sorted(set(env.REGISTRY) - set(rows))
    undeclared = sorted(set(rows) - set(env.REGISTRY))
    assert not missing, f"declared in dspine/env.py, absent from docs/environment.md: {missing}"
    assert not undeclared, f"in docs/environment.md, not declared in dspine/env.py: {undeclared}"
    for name, var in env.REGISTRY.items():
        default, meaning = rows[name]
        assert default == default_as_documented(var.default), (
            f"docs/environment.md gives {name} the default {default!r}; dspine/env.py: "
            f"{default_as_documented(var.default)!r}")
        assert meaning, f"docs/environment.md: {name} has no meaning"


# --- raw reads ------------------------------------------------------------------------------------
PASS_ON_METHODS = {"copy", "update"}  # os.environ.copy() hands the mapping on; update() writes


def environment_reads(source: str) -> list[tuple[int, str]]:
    """(line, snippet) of every read of the process environment in `source`."""
    tree = ast.parse(source)
    os_names = {"os"}
    environ_names: set[str] = set()
    getenv_names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            os_names |= {a.asname or a.name for a in node.names if a.name == "os"}
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            environ_names |= {a.asname or a.name for a in node.names if a.name in ("environ", "environb")}
            getenv_names |= {a.asname or a.name for a in node.names if a.name in ("getenv", "getenvb")}
    parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}

    def is_environ(node) -> bool:
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "environb"):
            return isinstance(node.value, ast.Name) and node.value.id in os_names
        return isinstance(node, ast.Name) and node.id in environ_names

    def is_getenv(node) -> bool:
        if isinstance(node, ast.Attribute) and node.attr in ("getenv", "getenvb"):
            return isinstance(node.value, ast.Name) and node.value.id in os_names
        return isinstance(node, ast.Name) and node.id in getenv_names

    def passed_on(node) -> bool:
        parent = parents.get(node)
        if isinstance(parent, ast.Dict):  # {**os.environ, ...}: a None key marks the ** entry
            return any(k is None and v is node for k, v in zip(parent.keys, parent.values))
        if isinstance(parent, ast.keyword):  # subprocess.run(..., env=os.environ)
            return parent.arg == "env"
        if isinstance(parent, ast.Call) and parent.args == [node] and not parent.keywords:
            return isinstance(parent.func, ast.Name) and parent.func.id == "dict"
        if isinstance(parent, ast.Attribute):
            return parent.attr in PASS_ON_METHODS
        if isinstance(parent, ast.Subscript):  # os.environ[k] = v / del os.environ[k]: writes
            return not isinstance(parent.ctx, ast.Load)
        return False

    lines = source.splitlines()
    return sorted((node.lineno, lines[node.lineno - 1].strip()) for node in ast.walk(tree)
                  if is_getenv(node) or (is_environ(node) and not passed_on(node)))


@pytest.mark.parametrize("snippet, count", [
    ("import os\nx = os.environ.get('A')", 1),
    ("import os\nx = os.environ['A']", 1),
    ("import os\nx = 'A' in os.environ", 1),
    ("import os\nx = os.getenv('A', '1')", 1),
    ("import os as o\nx = o.environ.get('A')", 1),
    ("from os import environ\nx = environ.get('A')", 1),
    ("from os import getenv as g\nx = g('A')", 1),
    ("import os\ndef f(environ=os.environ):\n    return environ", 1),
    ("import os\nf(os.environ)", 1),
    ("import os\nenv = dict(os.environ if e is None else e)", 1),
    ("import os\nenv = {**os.environ, 'A': '1'}", 0),
    ("import os\nenv = dict(os.environ)", 0),
    ("import os\nenv = os.environ.copy()", 0),
    ("import os, subprocess\nsubprocess.run(['x'], env=os.environ)", 0),
    ("import os\nos.environ['A'] = '1'\ndel os.environ['A']", 0),
    ("environ = {}\nx = environ.get('A')", 0),
])
def test_environment_read_scan(snippet, count):
    assert len(environment_reads(snippet)) == count, environment_reads(snippet)


def test_only_env_module_reads_the_environment():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "env.py":
            continue
        for line, snippet in environment_reads(path.read_text()):
            found.append(f"{path.relative_to(ROOT)}:{line}: {snippet}")
    assert not found, ("read the environment outside dspine/env.py (declare the variable there and "
                       "call its .get()):\n  " + "\n  ".join(found))
