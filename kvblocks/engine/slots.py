"""The slot manager: running sequences' KV slots over the prefix cache, through its public methods.

A sequence's KV is a slot list: its locked cached prefix (the trie's own slots, never copied) plus
slots it reserves for its own tokens. When its prompt is computed, the prompt's slots pass to the
trie (`adopt`, no copy) so requests admitted later hit it; when it ends, its reply's do. Every slot
has one owner: the trie, or exactly one sequence (`slots[start:]`).
"""

from __future__ import annotations

import numpy as np

from kvblocks.cache.trie import PrefixCache
from kvblocks.engine.sequence import Sequence


class SlotManager:
    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache

    @property
    def free(self) -> int:
        return self.cache.pool.num_free

    @property
    def capacity(self) -> int:
        return self.cache.pool.capacity

    def evictable(self) -> int:
        """Resident tokens eviction could free (a tree walk: ask only when short)."""
        return self.cache.evictable_tokens()

    def fits(self, tokens: int) -> bool:
        """Whether a sequence of `tokens` positions fits in the pool beside the pinned prefixes."""
        return tokens <= self.capacity - self.cache.pinned_tokens

    def cached_length(self, s: Sequence) -> int:
        return self.cache.cached_length(s.token_array(), salt=s.salt)

    def lock_prefix(self, s: Sequence) -> None:
        """Lock the longest cached prefix of `s` (a failed lookup is a miss); its KV is computed there."""
        assert s.hit is None and len(s.slots) == 0, "a sequence locks its prefix once per admission"
        s.hit = self.cache.match_or_miss(s.token_array(), salt=s.salt)
        if not s.started:
            s.cached_tokens = s.hit.length
            s.started = True
        s.slots = s.hit.slots.copy()
        s.start = s.computed = s.hit.length

    def reserve(self, s: Sequence, end: int) -> None:
        """Own slots up to position `end` of `s` (PoolFullError when the pool has too few)."""
        need = end - len(s.slots)
        if need > 0:
            s.slots = np.concatenate([s.slots, self.cache.reserve(need)])

    def trim(self, s: Sequence, end: int) -> None:
        """Give back the own slots of `s` past position `end` (drafts it did not keep)."""
        assert end >= s.start, "the trie's slots are not the sequence's to give back"
        if len(s.slots) > end:
            self.cache.release_slots(s.slots[end:])
            s.slots = s.slots[:end]

    def keep(self, s: Sequence, base: int, rows: list[int]) -> None:
        """Keep the slots of `s` up to `base`, then its slots `base + r` for `r` in `rows` in that
        order; give back the rest past `base` (a draft tree's rejected nodes). The accepted path's
        KV stays where the verification wrote it: only the slot list is reordered, nothing copied."""
        assert base >= s.start, "the trie's slots are not the sequence's to give back"
        tail = s.slots[base:]
        self.cache.release_slots(np.delete(tail, rows))
        s.slots = np.concatenate([s.slots[:base], tail[rows]])

    def commit_prompt(self, s: Sequence, length: int | None = None) -> None:
        """The prompt's slots pass to the trie as soon as it is computed; `s` keeps them locked (a
        fresh lock over the whole prompt: the trie's slots from now on, which are other slots where
        another request stored the same tokens meanwhile). `length`: the positions that count as the
        prompt (the sequence's length before its first token was appended)."""
        if s.committed_prompt:
            return
        assert s.hit is not None, "only a running sequence commits"
        s.committed_prompt = True
        n = min(s.computed, len(s.sequence) if length is None else length)
        beyond = s.slots[n:]  # a speculative round's accepted drafts: still the sequence's own
        ids = s.token_array()[:n]
        self.cache.adopt(ids, s.slots[:n], s.start, salt=s.salt)
        held = self.cache.hold(ids, salt=s.salt)
        s.hit.release()
        s.hit = held
        s.slots = np.concatenate([held.slots, beyond])
        s.start = len(held.slots)

    def complete(self, s: Sequence) -> None:
        """`s` ended: its computed tokens (prompt and reply, not the last sampled one) pass to the
        trie, the rest of its slots and its lock go back."""
        n = min(s.computed, len(s.sequence))
        self.trim(s, max(n, s.start))  # KV of drafts accepted past the token that ended it
        if n > s.start:
            self.cache.adopt(s.token_array()[:n], s.slots[:n], s.start, salt=s.salt)
            s.slots = s.slots[: s.start]  # all passed to the trie
        self.release(s)

    def release(self, s: Sequence) -> None:
        """Its own slots and its lock go back (preempted, cancelled, failed or completed)."""
        self.trim(s, s.start)
        if s.hit is not None:
            s.hit.release()
            s.hit = None
        s.slots = s.slots[:0]
        s.start = 0
