from __future__ import annotations

import os

import pytest
import torch
from redis_server import module_redis_server, redis_server, redis_url  # noqa: F401  (fixtures)

from kvblocks.generate.text import IdTokenizer  # noqa: F401  (the tests import it from here)

torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The files that take longest (over a minute each in CI) run first: pytest-xdist hands files to its
# workers in collection order (`scripts/test`), so a long one started last would run alone at the
# end while the other workers sit idle. Tests keep their order within a file.
LONGEST_FIRST = (
    "test_specdec_sampling.py",
    "test_soak.py",
    "test_fleet.py",
    "test_bench_suites.py",
    "test_server_agents.py",
    "test_kv_events.py",
    "test_trie_spill_race.py",
    "test_examples.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept


def tiny_llama(dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """A 2-layer random-weight llama (no download), for tests that need any real model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    fields = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=512,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    fields.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**fields)).to(dtype).eval()


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the real default model, SmolLM2-135M-Instruct, float32 on CPU."""
    from kvblocks import models

    return models.load(None, "float32", "cpu")
