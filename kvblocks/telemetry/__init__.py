"""What the running system tells: Prometheus metrics, counter history, traces, KV events."""
