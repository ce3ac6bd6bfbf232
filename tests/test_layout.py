"""The shape of the package (docs/design/architecture.md): no import cycles, nothing imports upward, a thin root and
small files.

Read from the source with `ast` (every import, the ones inside functions too), so a cycle hidden behind a lazy
import counts as a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "src" / "oal"

# Bottom-up: a module may import only from its own package or from packages listed before it.
LAYERS = ("oal.errors", "oal.device", "oal.launch", "oal.rundir", "oal.ops", "oal.methods", "oal.data", "oal.models",
          "oal.analysis", "oal.calibration", "oal.evaluate", "oal.adaptation", "oal.artefact", "oal.diagnostics",
          "oal.pipeline", "oal.cli", "oal.__main__", "oal.lm_eval")
MAX_LINES, MAX_CLI_LINES, MAX_ROOT_MODULES = 500, 120, 6


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The oal modules `name` imports (`from a import b` counts as a.b when that is a module, else as a)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, set(mods)) for m, p in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _layer(module: str) -> int | None:
    hits = [i for i, p in enumerate(LAYERS) if module == p or module.startswith(p + ".")]
    return max(hits, key=lambda i: len(LAYERS[i])) if hits else None


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_nothing_imports_upward():
    layered = {m: _layer(m) for m in _modules() if m != "oal"}  # the root package (the public face) is on top
    upward = [(m, t) for m, targets in _graph().items() for t in targets
              if m in layered and t in layered and layered[t] > layered[m]]
    assert upward == []


def test_every_module_has_a_layer():
    assert [m for m in _modules() if m != "oal" and _layer(m) is None] == []


def test_the_root_is_thin():
    assert len(list(ROOT.glob("*.py"))) <= MAX_ROOT_MODULES


@pytest.mark.parametrize("limit,where", [(MAX_LINES, ROOT), (MAX_CLI_LINES, ROOT / "cli")])
def test_small_files(limit, where):
    big = {str(p.relative_to(ROOT)): n for p in where.rglob("*.py")
           if (n := len(p.read_text(encoding="utf-8").splitlines())) > limit}
    assert big == {}


def test_the_checks_can_fail():
    """The cycle finder and the layer order see what they are meant to see."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert _layer("oal.ops.chunked") < _layer("oal.pipeline.report") < _layer("oal.cli.run")
