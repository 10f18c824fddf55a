"""Every program in examples/ runs as a user runs it (a subprocess, short settings) and says what it
promises: cached tokens on later agents, outputs equal to uncached runs, tool calls that parse.

The library examples run on the tiny random-weight model with SmolLM2's tokenizer, except
speculative decoding, which runs on the default model (a random model's drafts are rarely
accepted). The server examples share one real `kvblocks serve` on SmolLM2-135M-Instruct (a
random model never produces tool calls); the Redis ones share one real Redis server, which in
CI must start (KVBLOCKS_CI=1 turns a missing Redis into a failure, not a skip).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from server_proc import start_server, stop_cleanly, tiny_model_dir

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TESTED = {
    "shared_system_prompt.py",
    "openai_agents.py",
    "redis_two_processes.py",
    "speculative_decoding.py",
    "agent_tools_json.py",
    "lmcache_interop.py",
}


def run_example(name: str, *args: str, timeout: float = 120) -> str:
    """Run examples/NAME with ARGS; its stdout, once it exited 0."""
    env = os.environ | {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=EXAMPLES.parent,
    )
    assert done.returncode == 0, f"{name} exited {done.returncode}:\n{done.stdout}\n{done.stderr[-3000:]}"
    return done.stdout


def agent_turns(out: str) -> dict[tuple[int, int], tuple[int, int]]:
    """{(agent, turn): (prompt tokens, cached tokens)} from the agents' lines."""
    found = re.findall(r"agent (\d+) turn (\d+): +(\d+) prompt tokens, +(\d+) cached", out)
    return {(int(a), int(t)): (int(p), int(c)) for a, t, p, c in found}


def check_agents_share_the_prompt(turns: dict, agents: int, first_may_hit: bool = False) -> None:
    assert set(turns) == {(a, t) for a in range(1, agents + 1) for t in (1, 2)}, turns
    if not first_may_hit:
        assert turns[1, 1][1] == 0
    for agent in range(2, agents + 1):
        prompt, cached = turns[agent, 1]
        assert cached > prompt // 2, f"agent {agent} found too little of the system prompt: {turns}"
    # The second turn hits the first turn's prompt, but for its last token ("assistant\n"), which
    # the tokenizer may merge with the start of the reply when the history is rendered again.
    for agent in range(1, agents + 1):
        assert turns[agent, 2][1] >= turns[agent, 1][0] - 1, turns


@pytest.fixture(scope="module")
def redis_url(module_redis_server):
    return module_redis_server.url


@pytest.fixture(scope="module")
def smollm2_server():
    server = start_server("--capacity", "8192")
    yield server
    stop_cleanly(server)


def test_every_example_is_tested_listed_in_the_readme_and_says_how_to_run_it():
    programs = {p.name for p in EXAMPLES.glob("*.py")}
    assert programs == TESTED
    readme = (EXAMPLES / "README.md").read_text()
    for name in programs:
        assert name in readme
        text = (EXAMPLES / name).read_text()
        doc = text.split('"""')[1]
        assert "Run" in doc and "Output" in doc and f"python examples/{name}" in doc, name
        assert "torch.set_num_threads(1)" in text or "import torch" not in text, name


def test_shared_system_prompt_agents_hit_the_cache():
    out = run_example(
        "shared_system_prompt.py", "--model", str(tiny_model_dir()), "--agents", "3", "--max-tokens", "4"
    )
    check_agents_share_the_prompt(agent_turns(out), 3)
    rate = re.search(r"hit rate: ([\d.]+)% of prompt tokens came from the cache \((\d+) of (\d+)\)", out)
    assert rate and float(rate[1]) > 50, out
    assert re.search(r"trie: \d+ nodes, [1-9]\d* resident tokens", out), out


def test_openai_agents_report_cached_tokens_from_the_server(smollm2_server):
    base_url = f"{smollm2_server.url}/v1"
    out = run_example("openai_agents.py", "--base-url", base_url, "--agents", "3", "--max-tokens", "4")
    assert "server model: SmolLM2-135M-Instruct" in out
    turns = agent_turns(out)
    check_agents_share_the_prompt(turns, 3, first_may_hit=True)
    total = re.search(r"6 requests: (\d+) prompt tokens, (\d+) cached", out)
    assert total, out
    assert int(total[1]) == sum(p for p, _ in turns.values())
    assert int(total[2]) == sum(c for _, c in turns.values())


def test_agent_calls_the_tool_answers_with_its_result_and_returns_parsable_json(smollm2_server):
    out = run_example("agent_tools_json.py", "--base-url", f"{smollm2_server.url}/v1")
    call = re.search(r"^step 1: tool call get_weather\((.*)\)$", out, re.M)
    assert call, out
    arguments = json.loads(call[1])
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    result = re.search(r"^tool get_weather -> (.*)$", out, re.M)
    assert result and json.loads(result[1])["city"] == arguments["city"], out
    assert re.search(r"^step 2: answer: \S", out, re.M), out
    report = json.loads(re.search(r"^json: (.*)$", out, re.M)[1])
    assert set(report) == {"city", "temperature_c", "advice"} and isinstance(report["temperature_c"], int)
    assert re.search(r"^parsed: city=", out, re.M), out


def test_redis_two_processes_restore_the_prefix_sealed_and_match(redis_url, tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32))
    out = run_example(
        "redis_two_processes.py",
        "--redis", redis_url,
        "--secret-file", str(secret),
        "--model", str(tiny_model_dir()),
        "--chunk-tokens", "16",
        "--max-tokens", "4",
    )  # fmt: skip
    lines = re.findall(r"process (\d) \(pid (\d+)\): .*?(\d+) cached \((\d+) device, (\d+) Redis\)", out)
    assert [(p, int(c), int(d), int(r)) for p, _, c, d, r in lines][:1] == [("1", 0, 0, 0)], out
    (_, pid1, *_), (_, pid2, cached, device, redis), (_, pid2b, _, device2, redis2) = lines
    assert pid1 != pid2 == pid2b
    assert int(redis) > 0 and int(redis) % 16 == 0 and int(device) == 0 and int(cached) == int(redis)
    assert int(device2) > 0 and int(redis2) == 0
    assert re.search(r"process 1: [1-9]\d* chunk\(s\) written to Redis \(sealed\)", out), out
    assert "outputs match: yes" in out


def test_speculative_decoding_with_lookup_and_trie_drafters_equals_plain_greedy():
    out = run_example("speculative_decoding.py", "--max-tokens", "12", "--gamma", "3")
    lookup_part, trie_part = out.split("-- trie drafter")
    stats = {}
    for name, part in (("lookup", lookup_part), ("trie", trie_part)):
        assert f"{name}: same tokens as plain greedy: yes" in part, out
        m = re.search(rf"{name}: (\d+) rounds, (\d+) drafted, (\d+) accepted, (\d+) rejected", part)
        assert m, out
        rounds, drafted, accepted, rejected = map(int, m.groups())
        assert drafted == accepted + rejected and rounds == len(re.findall(r"^round +\d+:", part, re.M))
        stats[name] = accepted, rejected
    assert stats["lookup"][0] > 0 and stats["lookup"][1] > 0  # the prompt's text is copied, not all of it
    assert re.search(r"^round +\d+: \+ .*  - ", lookup_part, re.M), out
    assert stats["trie"][0] > 0 and stats["trie"][1] == 0  # the cache holds the whole reply


def test_lmcache_interop_fleet_to_kvblocks_kvblocks_to_fleet_and_between_caches(redis_url):
    out = run_example(
        "lmcache_interop.py", "--redis", redis_url, "--model", str(tiny_model_dir()),
        "--chunk-tokens", "16", "--max-tokens", "4",
    )  # fmt: skip
    stored = re.search(r"A: the fleet stored (\d+) chunks \((\d+) of (\d+) tokens\)", out)
    assert stored and int(stored[1]) >= 2, out
    took = re.search(
        r"A: kvblocks took (\d+) of (\d+) prompt tokens from Redis .*\(cached_tokens (\d+)\)", out
    )
    assert took and took[1] == took[3] == stored[2], out
    assert "A: same 4 tokens as without a cache: yes" in out
    written = re.search(r"B: kvblocks wrote (\d+) chunks in LMCache's format", out)
    assert written and int(written[1]) >= 2, out
    chunks = re.findall(r"B: chunk \d+ at key \S+: (\S+)", out)
    assert len(chunks) >= 2 and set(chunks) == {"bit-exact"}, out
    found = re.search(
        r"C: a second cache found (\d+) of \d+ prompt tokens in Redis \(cached_tokens (\d+), (\d+)", out
    )
    assert found and int(found[1]) == int(found[2]) == 16 * int(found[3]) == 16 * len(chunks), out
    assert "C: same tokens as the first cache: yes" in out
