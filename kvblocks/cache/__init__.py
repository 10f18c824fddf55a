"""The prefix cache: radix tree, device pool, eviction, the trie that joins them, and what explains it."""
