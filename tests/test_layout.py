"""The package's layout keeps its rules (docs/architecture.md): no import loops, the serve-time
path (the core and the plugin) imports nothing offline (no tools), nothing in the package imports the
repository's benchmarks/ (an installed package has none), planning is numpy only, no module over ~400
lines, and no file names one machine's own paths.

Imports are read from the source (every `import` statement, those inside functions too), so a
lazy import that would close a loop or reach an offline tool is caught as well."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_gaudi_unified"
ROOT = "vllm_gaudi_unified"

#: Imported while serving: must not reach `tools` (and nothing in the package reaches `benchmarks`).
SERVE_TIME = ("attention", "batch", "copies", "bucket", "graphs", "hpu", "log", "merge", "reference", "warmup", "plan",
              "paths", "bucket_plans", "vllm_plugin", "files", "flags")
#: Loaded or planned on every step and replayed offline: numpy only.
NUMPY_ONLY = ("bucket", "plan", "bucket_plans")
MAX_LINES = 400


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """Every module this file imports (absolute names; `from pkg import mod` resolves to pkg.mod)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return out


@pytest.fixture(scope="module")
def graph():
    mods = _modules()
    return {m: _imports(p, m, set(mods)) for m, p in mods.items()}


def _is(module: str, top: str) -> bool:
    return module == top or module.startswith(top + ".")


def test_no_import_loops(graph):
    """Tarjan's strongly connected components over the package's own imports: all of size one."""
    edges = {m: sorted(d for d in deps if d in graph and d != m) for m, deps in graph.items()}
    index, low, stack, on, loops, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
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
                loops.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    assert not loops, loops


def test_serve_time_imports_nothing_offline(graph):
    for mod, deps in graph.items():
        if any(_is(mod, f"{ROOT}.{top}") for top in SERVE_TIME):
            bad = sorted(d for d in deps if _is(d, f"{ROOT}.tools") or _is(d, "benchmarks"))
            assert not bad, f"{mod} imports {bad}"


def test_planning_modules_are_numpy_only(graph):
    for mod, deps in graph.items():
        if any(_is(mod, f"{ROOT}.{top}") for top in NUMPY_ONLY):
            bad = sorted(d for d in deps if d.split(".")[0] in ("torch", "vllm", "habana_frameworks"))
            assert not bad, f"{mod} imports {bad}"


def test_no_module_over_the_line_limit():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_the_package_imports_nothing_from_benchmarks(graph):
    """An installed package has no `benchmarks/`: no exception (the `bench` command that ran it is gone;
    the device runner is `python -m benchmarks.speed` in a source checkout)."""
    bad = {m: sorted(d for d in deps if _is(d, "benchmarks")) for m, deps in graph.items()}
    assert not {m: d for m, d in bad.items() if d}


#: Absolute paths of one machine (home and work folders, temp files by name); built from pieces so that
#: this file does not hold them.
MACHINE_PATHS = tuple("/" + p + "/" for p in ("work", "root", "home", "Users", "tmp"))


def test_no_machine_paths_in_the_repository():
    """Code, docs and scripts name no machine's own folders: a fresh clone finds its inputs through flags,
    environment variables and paths relative to the checkout. Recorded results (benchmarks/results/: logs
    and JSON as the runs wrote them) are data, not instructions, and are left as written."""
    import re
    import subprocess

    root = PACKAGE.parent
    files = subprocess.run(["git", "ls-files", "*.py", "*.md", "*.sh", "*.ini", "*.toml", "*.cfg", "*.txt",
                            "*.yml", "*.yaml"], cwd=root, capture_output=True, text=True, check=True).stdout.split()
    pattern = re.compile("(?<![\\w.~])(" + "|".join(re.escape(p) for p in MACHINE_PATHS) + ")")
    found = [f"{f}:{i}: {line.strip()}" for f in files if not f.startswith("benchmarks/results/")
             for i, line in enumerate((root / f).read_text(errors="replace").splitlines(), 1) if pattern.search(line)]
    assert not found, "\n".join(found[:20])


#: What a newcomer reads stays small: the benchmark suite, its results and the two long docs.
READER_LIMITS = {"benchmarks modules": 15, "benchmarks lines": 4000, "results bytes": 2_000_000,
                 "docs/benchmarks.md lines": 450, "docs/usage.md lines": 500}


def test_the_repository_around_the_package_stays_small():
    repo = PACKAGE.parent
    modules = sorted((repo / "benchmarks").glob("*.py"))
    sizes = {"benchmarks modules": len(modules),
             "benchmarks lines": sum(len(p.read_text().splitlines()) for p in modules),
             "results bytes": sum(p.stat().st_size for p in (repo / "benchmarks" / "results").rglob("*") if p.is_file()),
             **{f"{doc} lines": len((repo / doc).read_text().splitlines())
                for doc in ("docs/benchmarks.md", "docs/usage.md")}}
    over = {k: (v, READER_LIMITS[k]) for k, v in sizes.items() if v > READER_LIMITS[k]}
    assert not over, f"over the limits (size, limit): {over}"
