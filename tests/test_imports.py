"""The package has no import cycle and its folders are layers: the import graph of
``src/teeny``, read from the source (module-level imports and imports inside functions alike), is
acyclic, and each folder imports only from itself and the folders below it (``LAYERS``)."""

import ast
import os
from pathlib import Path

import pytest

from helpers import run_script

ROOT = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "teeny"


def _modules() -> dict[str, Path]:
    out = {}
    for path in (ROOT / PACKAGE).rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Modules of the package that ``name`` imports anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            # `from . import x` imports the submodule x; `from .m import f` imports m
            targets = [
                f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in modules else prefix for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and target.startswith(PACKAGE):
                found.add(target)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


# bottom first: a module of one folder may import modules of its own folder and those before it
LAYERS = ("core", "ops", "nn", "fusions", "program", "checks", "training", "torch", "aot", "cli")


def _layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":  # the package (lazy exports) and `python -m teeny`
        return len(LAYERS)
    return LAYERS.index(parts[1])


def test_every_module_sits_in_a_layer():
    unplaced = [name for name in _modules() if name.count(".") and name.split(".")[1] not in (*LAYERS, "__main__")]
    assert not unplaced, f"modules outside the layer folders {LAYERS}: {unplaced}"


def test_folders_import_only_from_below():
    modules = _modules()
    upward = []
    for name, path in modules.items():
        for target in _imports(name, path, modules):
            if target != PACKAGE and _layer(target) > _layer(name):
                upward.append(f"{name} -> {target}")
    assert not upward, "imports running up the layers " + " < ".join(LAYERS) + ":\n" + "\n".join(sorted(upward))


def test_no_import_cycle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert not _cycles(graph), f"import cycles: {_cycles(graph)}"


@pytest.mark.parametrize(
    "edge", [("teeny.core.graph", "teeny.ops"), ("teeny.program.accumulate", "teeny.core.runtime")]
)
def test_the_reader_sees_real_edges(edge):
    """The parser finds imports (so an empty graph cannot pass the test above by accident)."""
    modules = _modules()
    src, dst = edge
    assert (dst in _imports(src, modules[src], modules)) == (src != "teeny.core.graph")


@pytest.mark.slow
def test_every_module_imports_first_in_a_fresh_process():
    """Each module, imported first in a fresh Python process, imports: the static graph above
    misses cycles through the package's lazily exported names (``from . import kernel`` reads
    the decorator ``teeny.core.kernel``, which loads the whole package) and modules that import
    triton before ``teeny.core.device`` has chosen interpreter or GPU. (A module that a package
    above it imports while being imported first runs no process of its own: importing it first
    runs the very same imports as importing that package first; see the script.)"""
    names = sorted(name for name in _modules() if not name.endswith("__main__"))
    assert len(names) > 40
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = run_script("import_each_first", *names, env=env, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]", done.stdout
