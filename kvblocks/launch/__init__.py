"""Processes the product starts: free loopback ports (`ports`), `kvblocks serve` children
(`service`), a private Redis server or Redis Cluster (`redis_server`), sglang-router or vllm-router
(`router`), and a fleet of replicas behind a router (`fleet`, the `scripts/fleet` launcher).

Every process is a child on a free 127.0.0.1 port with its log in a folder the caller owns, is
ready once it answers (PING, GET /health), and is stopped with SIGTERM (SIGKILL if it lingers).
The benchmarks and the tests start their processes with these; nothing here imports them.
"""
