"""KV blocks: a prompt's reusable parts (documents, tool outputs) whose KV is computed once and reused
at any position (`kv_mode` "concat" or "blend"), next to the exact prefix cache.

`segments` turns a segmented prompt into ids and block spans, `rope` moves cached keys to a new
position, `prefill` builds a request's cache from stored blocks, `report` says what was reused.
"""

from __future__ import annotations

from kvblocks.blocks.report import BlockReport, BlockUse, StoredBlock
from kvblocks.blocks.segments import Block, BlockSpan, SegmentedPrompt, chat_blocks, flatten, is_segmented

__all__ = [
    "Block",
    "BlockReport",
    "BlockSpan",
    "BlockUse",
    "SegmentedPrompt",
    "StoredBlock",
    "chat_blocks",
    "flatten",
    "is_segmented",
]
