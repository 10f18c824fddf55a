"""The package has no import cycles, counting imports inside functions too (a lazy import that
closes a circle still ties the two modules together; only `if TYPE_CHECKING:` blocks, which never
run, are left out), and the core does not import what it does not use."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# installed package name -> source folder (pyproject's package-dir)
PACKAGES = {
    "kvblocks": ROOT / "kvblocks",
    "kvblocks.adapters": ROOT / "adapters",
    "kvblocks.specdec": ROOT / "specdec",
}


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that `name` imports anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    type_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for inner in ast.walk(node)
    }
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}".rstrip(".")
            for alias in node.names:
                full = f"{base}.{alias.name}"
                targets.add(full if full in known else base)
    return {t for t in targets if t in known and t != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
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


def test_the_package_has_no_import_cycles():
    found = modules()
    assert "kvblocks.bench.harness" in found and "kvblocks.specdec.generator" in found
    graph = {name: imports_of(name, path, set(found)) for name, path in found.items()}
    assert "kvblocks.errors" in graph["kvblocks.cli.commands"]  # the graph sees imports inside functions too
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_core_does_not_load_the_spill_codec_or_the_benchmarks():
    """Importing the trie and the generator (the core) loads neither the Redis tier and its record codec
    (msgpack, cryptography) nor the benchmarks; the HTTP-only CLI commands load no torch."""
    unwanted = (
        "msgpack",
        "cryptography",
        "redis",
        "kvblocks.spill.records",
        "kvblocks.spill.redis_tier",
        "kvblocks.bench",
    )
    code = (
        "import sys, kvblocks.cache.trie, kvblocks.generate.generator\n"
        f"print(sorted(m for m in {unwanted!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    code = "import sys, kvblocks.cli.commands, kvblocks.cli.client\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_the_core_imports_neither_the_adapters_nor_the_server():
    """The arrow points outwards: the cache and the engine take layer specs and tensors, and only
    `adapters/` knows transformers' caches (imports inside functions count, type-only ones do not)."""
    found = modules()
    core = [name for name in found if name.startswith(("kvblocks.cache", "kvblocks.engine"))]
    assert "kvblocks.cache.trie" in core and "kvblocks.engine.batch" in core
    outward = {
        name: sorted(t for t in imports_of(name, found[name], set(found)) if t.startswith(FORBIDDEN))
        for name in core
    }
    assert {name: targets for name, targets in outward.items() if targets} == {}


FORBIDDEN = ("kvblocks.adapters", "kvblocks.server")


BENCH_DOOR = {"kvblocks.cli.commands": ["kvblocks.bench"]}  # `kvblocks bench` builds the suites' parser


def bench_imports(found: dict[str, Path]) -> dict[str, list[str]]:
    """Every module outside `kvblocks.bench` that imports the benchmarks, with what it imports."""
    inward = {
        name: sorted(
            t
            for t in imports_of(name, path, set(found))
            if t == "kvblocks.bench" or t.startswith("kvblocks.bench.")
        )
        for name, path in found.items()
        if name != "kvblocks.bench" and not name.startswith("kvblocks.bench.")
    }
    return {name: targets for name, targets in inward.items() if targets}


def test_the_product_does_not_import_the_benchmarks():
    """The wall between product and benchmarks: the suites import the product (the fleet, Redis and
    serve launchers live in `kvblocks.launch`), never the reverse. The one door is the CLI's
    `kvblocks bench` command, which reaches the package's parser and nothing deeper."""
    found = modules()
    assert "kvblocks.launch.fleet" in found and "kvblocks.bench.fleet" in found
    assert bench_imports(found) == BENCH_DOOR


def test_the_wall_check_sees_a_product_module_that_imports_a_suite(tmp_path):
    (tmp_path / "leak.py").write_text("def f():\n    from kvblocks.bench.harness import Report\n")
    found = modules() | {"kvblocks.leak": tmp_path / "leak.py"}
    assert bench_imports(found) == BENCH_DOOR | {"kvblocks.leak": ["kvblocks.bench.harness"]}
