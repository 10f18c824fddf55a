"""What the stack's reader and writer share once the trie is known: the record codec and the
layouts it frames (`TierStack.bind` sets them)."""

from __future__ import annotations

from kvblocks.cache.layout import KVLayout, StateLayout
from kvblocks.spill.records import ChunkCodec, StateCodec


class BoundCodec:
    """A codec with the KV and state layouts of the trie it serves (None until bound)."""

    def __init__(self, codec: ChunkCodec) -> None:
        self.codec = codec
        self.layout: KVLayout | None = None
        self.state: StateLayout | None = None

    @property
    def bound_layout(self) -> KVLayout:
        assert self.layout is not None, "the stack binds its layout before any read or write"
        return self.layout

    def state_codec(self) -> tuple[StateCodec, StateLayout]:
        """The codec and layout of state records (the stack asks only when it spills states)."""
        assert isinstance(self.codec, StateCodec) and self.state is not None
        return self.codec, self.state
