"""A fleet for tests: real `kvblocks serve` replicas (tiny model) behind a real router, on 127.0.0.1.

The machinery is `kvblocks.launch.fleet`, the workload `kvblocks.bench.fleet` (the `kvblocks bench
fleet` suite runs the same fleet and load): `Fleet` starts the replicas (extra arguments for all of them and for each one), an optional shared
Redis or Redis Cluster with one secret, and `start_router(kind, policy, args)` puts sglang-router or
vllm-router in front; `fleet.replicas[i]` can be `stop`ped, `kill`ed and `restart`ed on its own
port, and gives its `stats()` and `metrics()`. This module adds the tests' model and sizes.
"""

from __future__ import annotations

from pathlib import Path

from server_proc import tiny_model_dir

from kvblocks.bench.fleet import (
    Job,
    Outcome,
    Sent,
    Tenant,
    drive,
    ideal_hits,
    make_jobs,
    make_tenants,
    send,
    tokenize_jobs,
)
from kvblocks.launch.fleet import Fleet, Replica
from kvblocks.launch.router import Router

__all__ = [
    "CONTEXT",
    "MODEL",
    "Fleet",
    "Job",
    "Outcome",
    "Replica",
    "Router",
    "Sent",
    "Tenant",
    "drive",
    "fleet_model",
    "ideal_hits",
    "make_jobs",
    "make_tenants",
    "send",
    "start_fleet",
    "tokenize_jobs",
]

MODEL = "tiny"
CONTEXT = 1024  # room for ~800-token system prompts, a question and a short reply


def fleet_model() -> Path:
    """The tiny random model (SmolLM2's tokenizer and chat template) with a 1,024-token context."""
    return tiny_model_dir(context=CONTEXT)


def start_fleet(workdir: str | Path, replicas: int = 3, serve_args=(), **kwargs) -> Fleet:
    """`replicas` replicas of the tiny model served as `MODEL`, started and answering; `kwargs` go to
    `Fleet` (replica_args, redis="server" | "cluster" | URL, secret_file, headers, ...). Redis chunks
    are 16 tokens, so a restore misses at most 15 tokens of a prefix."""
    kwargs.setdefault("redis_chunk_tokens", 16)
    args = ["--model", str(fleet_model()), "--served-model-name", MODEL, *serve_args]
    return Fleet(workdir, replicas, args, **kwargs).start()
