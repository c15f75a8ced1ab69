"""The tree is what the README says, and its modules import each other without a cycle."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("steps", "workflows", "emulator", "benchmarks")


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


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in graph[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


def test_the_compiler_never_imports_the_emulator():
    """Issue 28: only the CLI's ``run --local`` reaches the emulator; compiling, linting and
    submitting do not, not even through another module."""
    graph = import_graph()
    for name in graph:
        if name.startswith("workflows") and name != "workflows.cli":
            assert not any(t.startswith("emulator") for t in reachable(graph, name)), name
    assert any(t.startswith("emulator") for t in reachable(graph, "workflows.cli"))


# Imports inside functions, each with its reason (stated again where it is made); every other
# import is at the top of its module (issue 28).
LAZY = {
    "steps.model": {"monai"},           # the compiler reads its constants without monai
    "steps.schemas": {"torch"},         # download and storage read metadata without torch
    "steps.report": {"matplotlib"},     # the Agg backend is chosen before pyplot loads
    "steps.quantize": {"nncf", "openvino"},   # optional: the `openvino` extra
    "steps.device_check": {"torch", "steps", "habana_frameworks"},  # the workers' only
    "steps.devices": {"torch"},         # Inductor (0.9 s to import) only where a step compiles
    "steps.compile_cache": {"torch"},   # Dynamo's timers, loaded by torch.compile already
    "workflows.cli": {"emulator"},      # only `run --local` loads the emulator
    "emulator.s3target": {"minio"},     # benchmarks.common loads it where minio is absent
    "benchmarks.quantize": {"openvino"},   # optional, as in steps.quantize
    "benchmarks.preprocess": {"isal"},  # optional: the zlib row runs without it
}


def function_imports(path: Path) -> list[tuple[int, str]]:
    """(line, top-level name) of every import inside a function."""
    out = []
    for fn in ast.walk(ast.parse(path.read_text())):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    out += [(node.lineno, a.name.split(".")[0]) for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    out.append((node.lineno, node.module.split(".")[0]))
    return out


def test_imports_are_at_the_top_unless_listed_with_a_reason():
    found = [f"{name}:{line} imports {target}" for name, path in module_files().items()
             for line, target in function_imports(path)
             if target not in LAZY.get(name, set())]
    assert not found, found


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
    top = {path.split("/")[0] for path in tracked} | {"docs"}   # docs/ even before it is committed
    top -= {".gitignore", ".dockerignore", "README.md"}
    missing = [entry for entry in sorted(top) if f"`{entry}" not in table]
    assert not missing, f"README layout table lacks {missing}"
    for folder in ("steps", "workflows", "emulator"):
        for path in sorted((REPO / folder).glob("*.py")):
            if path.stem not in ("__init__", "__main__"):
                assert f"`{path.stem}" in table, f"README layout table lacks {folder}/{path.name}"


# The README is one screenful for a newcomer; the rest lives in docs/ and benchmarks/README.md,
# and every relative link between them resolves (to a file, and to a heading for an #anchor).
DOCS = ["README.md", "benchmarks/README.md",
        *(f"docs/{path.name}" for path in sorted((REPO / "docs").glob("*.md")))]
FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its rendered text in lower case, every character
    other than a letter, digit, space, hyphen or underscore dropped, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # a link renders as its text
    text = text.replace("`", "").replace("*", "").strip().lower()
    return "".join("-" if c == " " else c for c in text if c.isalnum() or c in " -_")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose_lines(path.read_text()):
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            slug = github_slug(match.group(1))
            out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return out


def relative_links(path: Path) -> list[str]:
    links = []
    for line in _prose_lines(path.read_text()):
        line = re.sub(r"(`+).*?\1", "", line)
        links += [target for target in LINK.findall(line)
                  if not re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target)]
    return links


def test_github_slug():
    assert github_slug("Quickstart (a fresh machine)") == "quickstart-a-fresh-machine"
    assert github_slug("CPU: `python -m benchmarks all`") == "cpu-python--m-benchmarks-all"
    assert github_slug("On Argo's own controller") == "on-argos-own-controller"
    assert github_slug("First, on a new Gaudi or GPU node") == "first-on-a-new-gaudi-or-gpu-node"
    assert github_slug("[What has run where](x.md) now") == "what-has-run-where-now"


def test_readme_is_one_screenful():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) < 250, f"README.md has {len(lines)} lines; move detail to docs/"


@pytest.mark.parametrize("doc", DOCS)
def test_every_relative_link_resolves(doc):
    source = REPO / doc
    broken = []
    for link in relative_links(source):
        target, _, anchor = link.partition("#")
        path = (source.parent / target).resolve() if target else source
        if not path.exists():
            broken.append(f"{link} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{link} (no heading #{anchor} in {path.relative_to(REPO)})")
    assert not broken, f"{doc}: {broken}"


def test_the_readme_links_the_failure_modes_and_what_has_run_where():
    """Other documents point at the README for these two tables, which live in docs/; every
    page of docs/ and benchmarks/README.md is reached from the README."""
    links = relative_links(REPO / "README.md")
    assert "docs/operations.md#failure-modes" in links
    assert any(link.startswith("docs/status.md") for link in links)
    linked = {link.partition("#")[0] for link in links}
    assert not [doc for doc in DOCS if doc != "README.md" and doc not in linked]
    operations = (REPO / "docs/operations.md").read_text()
    assert "| fault | what the pipeline does | what you do |" in operations
    assert "| what | where it ran | how |" in (REPO / "docs/status.md").read_text()


def test_ci_runs_the_readme_test_command_verbatim():
    """CI calls the test command the README gives a user, the same line (.ci/run's last)."""
    readme = (REPO / "README.md").read_text()
    quickstart = readme[readme.index("## Quickstart"):]
    blocks = re.findall(r"```bash\n(.*?)\n```", quickstart, re.S)
    install_and_run, test = blocks[0].strip(), blocks[1].strip()
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith("#")]
    assert ci[-1] == test
    for command in (install_and_run, test):      # the tested versions, as CI and the image
        assert command.startswith("pip install -c .ci/constraints.txt torch=="), command
