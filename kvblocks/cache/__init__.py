"""The prefix cache, one room per job; it takes layer specs and tensors and never imports transformers.

- `trie`: `PrefixCache`, the core: match / insert / evict / pin under one lock, handing out `hit.Hit`.
- `resident`: the radix tree and the device pool kept consistent (what every room works through).
- `snapshots`: recurrent-state snapshots, policy and storage; a request's `SnapshotPlan`.
- `slots`: the running requests' face (reserve / adopt / release_slots for the batched engine).
- `stats`: counters per tenant, `stats()`, inspection records; `explain` and `inspection` word them.
- `spill_link`: what a lookup fetches from the Redis tier (`kvblocks.spill`) and promotes.
- `bridge`: what the core asks of a framework's cache. `kvblocks.KVCacheTrie`
  (`kvblocks.adapters.hf_trie`) is `PrefixCache` with the transformers bridge (`adapters/hf.py`).
- Below them: `radix` (the tree), `pool` (KV slots), `eviction` (policies), `layout`, `namespace`.
"""
