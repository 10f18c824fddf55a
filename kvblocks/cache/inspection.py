"""What `/v1/cache/prefixes` and `kvblocks inspect` show: the trie's most-hit prefixes and its shape,
as JSON with text previews. The trie hands out plain records (`CachedPrefix`, `TreeNode`); the
wording and the decoding live here, next to `explain`."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from kvblocks.cache.explain import Decoder
from kvblocks.cache.trie import PrefixCache

PREVIEW_TOKENS = 48


def preview(head: str, tail: str, elided: bool) -> str:
    return f"{head} … {tail}" if elided else head


def inspect_prefixes(
    cache: PrefixCache, tokenizer: Decoder, tenant: str | None, limit: int, tree: bool, max_nodes: int
) -> dict[str, Any]:
    """The most-hit prefixes and the trie's shape with text previews: all of them (tenant None,
    an admin) or one tenant's, which then sees neither the text nor the namespace keys of others."""

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False)

    top = []
    for p in cache.reports.top_prefixes(limit, tenant=tenant):
        ids = p.token_ids.tolist()
        text = preview(
            decode(ids[:PREVIEW_TOKENS]), decode(ids[-PREVIEW_TOKENS:]), len(ids) > 2 * PREVIEW_TOKENS
        )
        top.append(
            {
                "namespace": p.namespace,
                "length": len(ids),
                "hits": p.hits,
                "pinned": p.pinned,
                "preview": text,
            }
        )
    nodes = []
    for node in cache.reports.tree(max_nodes, tenant=tenant) if tree else []:
        row = asdict(node)
        row["preview"] = decode(row.pop("run_ids"))
        nodes.append(row)
    return {"prefixes": top, "tree": nodes}
