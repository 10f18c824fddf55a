"""Share one Redis with a vLLM + LMCache fleet: LMCache's Redis chunk format as a spill-tier codec.

The format is the one LMCache's multiprocess server (`lmcache server --l2-adapter
'{"type": "resp", ...}'`) writes, read from lmcache 0.5.6 and frozen from a real run in
tests/test_lmcache_format.py:

- chunk: `chunk_tokens` tokens from the start of the sequence (the server's `--chunk-size`,
  default 256); only full chunks are stored.
- hash: a blake3 chain over the token ids as big-endian uint32. The seed is
  blake3(int64_be(0) + uint32_be(0)); chunk i hashes the previous 32-byte digest + its tokens.
- key: `{model_name}@{kv_rank:08x}@{object_group_id:x}@{hash hex}`, plus `@{cache_salt}` when
  salted. kv_rank packs world size, rank, local world size, local rank into 8-bit fields.
- value: raw bytes, no header and no checksum: a C-contiguous `[2, layers, chunk_tokens,
  kv_heads * head_dim]` tensor (K then V) in the model's dtype, little-endian.

What kvblocks can verify: the key names the model and, through the 256-bit hash chain, the exact
token ids; the value must have exactly the layout's size and hold only finite numbers. Anything
else is a miss. LMCache stores no dtype, shape or checksum, so `model_name` must name one model
in one dtype for every process sharing it, as LMCache itself requires.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from kvblocks.cache.layout import KVLayout
from kvblocks.spill.records import VerificationError, all_finite
from kvblocks.spill.redis_tier import RedisTier

try:
    import blake3
except ImportError as exc:
    raise ImportError("kvblocks.adapters.lmcache needs blake3: pip install 'kvblocks[lmcache]'") from exc

# Seed of every chain: LMCache hashes (prefix=0 as int64, tokens=(0,)) when there is no parent.
NONE_HASH = blake3.blake3((0).to_bytes(8, "big", signed=True) + (0).to_bytes(4, "big")).digest()
_MAX_SALT = 128
_FORBIDDEN = frozenset("@/\\\x00")


def chunk_hashes(token_ids, chunk_tokens: int) -> list[bytes]:
    """LMCache's 32-byte hash of each full chunk; hash i depends on every token up to its end."""
    ids = np.asarray(token_ids)
    if ids.size and (ids.min() < 0 or ids.max() >= 2**32):
        raise ValueError("LMCache hashes token ids as uint32; got an id outside [0, 2**32)")
    data = np.ascontiguousarray(ids, dtype=">u4")
    h, out = NONE_HASH, []
    for end in range(chunk_tokens, len(data) + 1, chunk_tokens):
        h = blake3.blake3(h + data[end - chunk_tokens : end].tobytes()).digest()
        out.append(h)
    return out


def kv_rank(world_size: int = 1, rank: int = 0) -> int:
    """LMCache's packed rank; its server uses local world size = world size, local rank = rank."""
    return (world_size << 24) | (rank << 16) | (world_size << 8) | rank


def object_key(
    model_name: str,
    chunk_hash: bytes,
    *,
    rank: int | None = None,
    object_group_id: int = 0,
    cache_salt: str = "",
) -> str:
    """The Redis key LMCache uses for one chunk; the default rank is a single-worker fleet's, the
    only one kvblocks exchanges (it holds every head of every layer in one process)."""
    rank = kv_rank() if rank is None else rank
    key = f"{model_name}@{rank:08x}@{object_group_id:x}@{chunk_hash.hex()}"
    return f"{key}@{cache_salt}" if cache_salt else key


def to_lmcache(kv: list[torch.Tensor]) -> torch.Tensor:
    """Per-layer `[n, 2, H, D]` -> LMCache's `[2, layers, n, H * D]`."""
    n, _, heads, dim = kv[0].shape
    return torch.stack(kv).permute(2, 0, 1, 3, 4).reshape(2, len(kv), n, heads * dim).contiguous()


def from_lmcache(blob: torch.Tensor, heads: int, dim: int) -> list[torch.Tensor]:
    """LMCache's `[2, layers, n, H * D]` -> per-layer `[n, 2, H, D]`."""
    _, layers, n, _ = blob.shape
    per_layer = blob.view(2, layers, n, heads, dim).permute(1, 2, 0, 3, 4)
    return [t.contiguous() for t in per_layer]


def uniform_shape(layout: KVLayout) -> tuple[int, int]:
    """(H, D) shared by every layer; LMCache's single-group layout has nothing else to offer."""
    shapes = set(layout.shapes)
    if len(shapes) != 1 or (0, 0) in shapes:
        raise ValueError(
            "the LMCache format needs every layer to cache K/V with the same heads and head_dim; "
            f"this model's layers have {sorted(shapes)}"
        )
    return next(iter(shapes))


class LMCacheCodec:
    """Chunk keys and values in LMCache's Redis format, for `RedisTier(codec=...)`.

    Requests in the trie's own (unsalted) namespace use LMCache's unsalted keys, so they meet a
    vLLM fleet's requests without a cache_salt. Any other namespace (a kvblocks tenant salt) gets
    its own LMCache cache_salt, so tenants stay apart from each other and from the fleet.
    """

    # Other programs read these keys, possibly with another layout: never delete what we reject.
    delete_invalid: ClassVar[bool] = False
    # LMCache values are raw tensors with no tag: whoever can write to Redis can forge them.
    authenticated: ClassVar[bool] = False

    def __init__(self, model_name: str, *, object_group_id: int = 0, redis_is_trusted: bool = False) -> None:
        if not redis_is_trusted:
            raise ValueError(
                "the LMCache format cannot be authenticated (its values carry no tag): pass "
                "redis_is_trusted=True only if nothing untrusted can write to this Redis "
                "(see docs/LMCACHE.md and docs/SECURITY.md)"
            )
        if not model_name or "@" in model_name:
            raise ValueError(f"model_name must be non-empty and contain no '@', got {model_name!r}")
        self.model_name = model_name
        self.object_group_id = object_group_id
        self._home: str | None = None

    def bind(self, layout: KVLayout, namespace_key: str) -> None:
        uniform_shape(layout)
        self._home = namespace_key

    def cache_salt(self, namespace_key: str) -> str:
        if namespace_key == self._home:
            return ""
        salt = f"kvblocks-{namespace_key}"
        if len(salt) > _MAX_SALT or _FORBIDDEN & set(salt):
            raise ValueError(f"namespace {namespace_key!r} cannot be an LMCache cache_salt")
        return salt

    def chunk_hashes(self, namespace_key: str, ids: np.ndarray, chunk_tokens: int) -> list[str]:
        return [h.hex() for h in chunk_hashes(ids, chunk_tokens)]

    def key(self, namespace_key: str, chunk_hash: str) -> str:
        return object_key(
            self.model_name,
            bytes.fromhex(chunk_hash),
            object_group_id=self.object_group_id,
            cache_salt=self.cache_salt(namespace_key),
        )

    def size_bounds(self, key: str, namespace_key: str, n: int, layout: KVLayout) -> tuple[int, int]:
        """A value is the raw KV of `n` tokens, nothing more."""
        size = n * layout.token_bytes()
        return size, size

    def encode(
        self,
        key: str,
        namespace_key: str,
        tokens: np.ndarray,
        layout: KVLayout,
        kv: list[torch.Tensor | None],
    ) -> bytes:
        uniform_shape(layout)
        blob = to_lmcache([t.detach().to("cpu", layout.dtype) for t in kv])
        return blob.view(torch.uint8).numpy().tobytes()

    def decode(
        self,
        raw: bytes,
        key: str,
        namespace_key: str,
        tokens: np.ndarray,
        layout: KVLayout,
        device: torch.device | str,
    ) -> list[torch.Tensor | None]:
        """Unpack a value into fresh per-layer `[n, 2, H, D]` tensors on `device`."""
        out = layout.empty(len(tokens))
        self.decode_into(raw, key, namespace_key, tokens, layout, out)
        return [t.to(device) for t in out]

    def decode_into(
        self,
        raw: bytes,
        key: str,
        namespace_key: str,
        tokens: np.ndarray,
        layout: KVLayout,
        out: list[torch.Tensor | None],
    ) -> None:
        """Write a value into per-layer `[n, 2, H, D]` `out`; VerificationError if it cannot be this chunk."""
        heads, dim = uniform_shape(layout)
        n = len(tokens)
        if not isinstance(raw, bytes | memoryview) or len(raw) != n * layout.token_bytes():
            raise VerificationError("value size does not match the layout")
        blob = torch.frombuffer(bytearray(raw), dtype=layout.dtype).view(
            2, len(layout.layers), n, heads * dim
        )
        if not all_finite(blob):
            raise VerificationError("value holds non-finite numbers")
        for target, layer in zip(out, from_lmcache(blob, heads, dim), strict=True):
            target.copy_(layer)


class LMCacheRedisTier(RedisTier):
    """A RedisTier that reads and writes LMCache's format for `model_name` (LMCache's model name,
    i.e. what vLLM serves as `--model`). `chunk_tokens` must equal the fleet's `--chunk-size`.

    LMCache's values carry no authentication tag, so anyone who can write to this Redis can
    change outputs and anyone who can read it sees the KV. The codec therefore refuses to start
    unless `redis_is_trusted=True` says the Redis is reachable only by trusted programs.
    """

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        model_name: str,
        chunk_tokens: int = 256,
        redis_is_trusted: bool = False,
        **kwargs,
    ) -> None:
        super().__init__(
            url,
            chunk_tokens=chunk_tokens,
            codec=LMCacheCodec(model_name, redis_is_trusted=redis_is_trusted),
            **kwargs,
        )
