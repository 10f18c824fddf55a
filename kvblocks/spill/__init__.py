"""The spill tier below the device pool: Redis, its sealed record codec, and the deployment secret."""
