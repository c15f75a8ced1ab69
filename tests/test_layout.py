"""The tree is what the README says, and its modules import each other without a cycle."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("steps", "workflows", "benchmarks")


def module_files() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _targets(node: ast.AST, modules: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
        return [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules
                else node.module for alias in node.names]
    return []


def import_graph() -> dict[str, set[str]]:
    """Every import anywhere in a module (function bodies too), with the packages that
    importing a submodule runs first (``a.b.c`` also runs ``a.b`` and ``a``)."""
    modules = module_files()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            for target in _targets(node, modules):
                parts = target.split(".")
                for i in range(1, len(parts) + 1):
                    prefix = ".".join(parts[:i])
                    if prefix in modules and prefix != name and not name.startswith(prefix + "."):
                        graph[name].add(prefix)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_steps_never_import_workflows():
    graph = import_graph()
    for name, targets in graph.items():
        if name.startswith("steps"):
            assert not any(t.startswith("workflows") for t in targets), name


@pytest.mark.slow
def test_the_script_loads_each_module_once():
    """``python workflows/unet.py`` runs the CLI (as ``__main__``), which imports the DAG as
    workflows.unet: the file's definitions are executed once, under one name
    (python -X importtime lists each import)."""
    done = subprocess.run([sys.executable, "-X", "importtime", "workflows/unet.py", "render"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("apiVersion: argoproj.io/v1alpha1")
    loaded = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()
              if line.startswith("import time:")]
    ours = [name for name in loaded if name.split(".")[0] in PACKAGES]
    assert "workflows.unet" in ours and "workflows.templates" in ours
    assert len(ours) == len(set(ours)), sorted(n for n in ours if ours.count(n) > 1)


def _layout_table() -> str:
    text = (REPO / "README.md").read_text()
    start = text.index("## Layout")
    return text[start:text.index("\n## ", start + 1)]


def test_readme_layout_names_every_top_level_entry_and_module():
    table = _layout_table()
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split()
    top = {path.split("/")[0] for path in tracked} - {".gitignore", ".dockerignore", "README.md"}
    missing = [entry for entry in sorted(top) if f"`{entry}" not in table]
    assert not missing, f"README layout table lacks {missing}"
    for folder in ("steps", "workflows", "workflows/local"):
        for path in sorted((REPO / folder).glob("*.py")):
            if path.stem not in ("__init__", "__main__"):
                assert f"`{path.stem}" in table, f"README layout table lacks {folder}/{path.name}"
