"""The code's layering (docs/design.md, "Layering of the code"), checked on the source's imports.

Every ``muse_spark`` module is read (not imported) and each ``import``/``from … import`` of a
``muse_spark`` module, at the top or inside a function, is an edge. The rules:

* a module imports only modules of its own layer or the layers below it;
* the builder and the runtime, one layer, never import each other;
* plugins never import the models (the reference functions live with their op);
* no cycle among the modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"muse_spark": "muse_spark", "muse_spark.builder": "builder", "muse_spark.plugins": "plugins",
           "muse_spark.runtime": "runtime", "muse_spark.serving": "serving"}

# bottom to top: a module may import from its own rank and the ranks below
LAYERS = [
    ("muse_spark.config", "muse_spark.options", "muse_spark.process", "muse_spark.schedule"),
    ("muse_spark.plugins",),
    ("muse_spark.models",),
    ("muse_spark.checkpoint",),
    ("muse_spark.engine_format", "muse_spark.graphs", "muse_spark.sharding"),
    ("muse_spark.builder", "muse_spark.runtime"),
    ("muse_spark.serving", "muse_spark.cli"),
]
INDEPENDENT = [("muse_spark.builder", "muse_spark.runtime")]


def modules() -> dict[str, Path]:
    out = {}
    for package, folder in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            if folder == "muse_spark" and rel.parts[0] in ("builder", "plugins", "runtime", "serving"):
                continue
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The ``muse_spark`` modules ``name`` imports (a ``from pkg import mod`` names the module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base
                                                                                                   else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out |= {t for t in targets if t.startswith("muse_spark") and t != name}
    return out


def rank(module: str) -> int:
    for i, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{module} is in no layer: add it to LAYERS (and to docs/design.md)")


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: {t for t in imports(name, path, known) if t in known or t.rpartition(".")[0] in known}
            for name, path in mods.items() if name != "muse_spark"}


def test_every_module_has_a_layer(graph):
    for name in graph:
        rank(name)


def test_imports_go_down_the_layers(graph):
    upward = sorted(f"{m} → {t}" for m, ts in graph.items() for t in ts
                    if t != "muse_spark" and rank(t) > rank(m))
    assert not upward, "imports that go up a layer:\n" + "\n".join(upward)


def test_builder_and_runtime_are_independent(graph):
    crossing = sorted(f"{m} → {t}" for m, ts in graph.items() for t in ts for a, b in INDEPENDENT
                      if (m.startswith(a) and t.startswith(b)) or (m.startswith(b) and t.startswith(a)))
    assert not crossing, "\n".join(crossing)


def test_plugins_never_import_models_or_runtime(graph):
    bad = sorted(f"{m} → {t}" for m, ts in graph.items() if m.startswith("muse_spark.plugins") for t in ts
                 if t.startswith(("muse_spark.models", "muse_spark.runtime")))
    assert not bad, "\n".join(bad)


def test_no_import_cycles(graph):
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []
    cycles = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                cycles.append(" → ".join(path[path.index(t):] + [t]))
            elif t in graph and not state.get(t):
                visit(t)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if not state.get(m):
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_checker_sees_a_planted_violation(tmp_path):
    """The walk finds an import inside a function (the rules above would otherwise pass vacuously)."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from muse_spark.runtime.engine import EagerEngine\n")
    assert imports("muse_spark.builder.m", src, {"muse_spark.runtime.engine"}) == {"muse_spark.runtime.engine"}
    assert rank("muse_spark.runtime.engine") > rank("muse_spark.models.layers")
