"""Spill-tier chunks: content-addressed keys and the verified msgpack record of one chunk's KV.

A chunk is `chunk_tokens` consecutive tokens counted from the start of the sequence. Its key is
the namespace plus a chained hash of every token id up to the chunk's end, so one key names one
exact prefix, and any process computing the same prefix with the same model finds it.
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass
from typing import ClassVar, Protocol

import msgpack
import numpy as np
import torch
import xxhash

FORMAT_VERSION = 1
_TORCH_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def chain_hashes(namespace_key: str, ids: np.ndarray, chunk_tokens: int) -> list[str]:
    """Hex hash of each complete chunk of `ids`; hash i covers ids[: (i + 1) * chunk_tokens]."""
    h = hashlib.blake2b(namespace_key.encode(), digest_size=16).digest()
    out = []
    data = np.ascontiguousarray(ids, dtype="<i4")
    for end in range(chunk_tokens, len(data) + 1, chunk_tokens):
        h = hashlib.blake2b(h + data[end - chunk_tokens : end].tobytes(), digest_size=16).digest()
        out.append(h.hex())
    return out


@dataclass(slots=True, frozen=True)
class ChunkLayout:
    """What a record must match to be usable: dtype and per-layer (heads, head_dim), 0 for none."""

    dtype: torch.dtype
    layers: tuple[tuple[int, int], ...]

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def token_bytes(self) -> int:
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return sum(2 * h * d * elem for h, d in self.layers)


class VerificationError(ValueError):
    """A stored value is not a valid record for the expected namespace, tokens and layout."""


def encode_record(
    namespace_key: str, tokens: np.ndarray, layout: ChunkLayout, kv: list[torch.Tensor | None]
) -> bytes:
    """`kv[l]` is `[n, 2, H, D]` on any device; stored as raw little-endian bytes, layer after layer."""
    parts = [t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes() for t in kv if t is not None]
    payload = b"".join(parts)
    return msgpack.packb(
        {
            "v": FORMAT_VERSION,
            "ns": namespace_key,
            "tokens": np.ascontiguousarray(tokens, dtype="<i4").tobytes(),
            "dtype": layout.dtype_name,
            "shape": [len(tokens), [list(x) for x in layout.layers]],
            "sum": xxhash.xxh3_64_intdigest(payload),
            "kv": payload,
        },
        use_bin_type=True,
    )


def decode_record(
    raw: bytes, namespace_key: str, tokens: np.ndarray, layout: ChunkLayout, device: torch.device | str
) -> list[torch.Tensor | None]:
    """Verify and unpack a record into per-layer `[n, 2, H, D]` tensors on `device`.

    Anything that does not match exactly (version, namespace, token ids, dtype, shape, length,
    checksum) raises VerificationError: the caller treats it as a miss, never as data.
    """
    try:
        rec = msgpack.unpackb(raw, raw=False)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError) as exc:
        raise VerificationError(f"not a msgpack record: {exc}") from exc
    if not isinstance(rec, dict):
        raise VerificationError("record is not a map")
    expected_tokens = np.ascontiguousarray(tokens, dtype="<i4").tobytes()
    n = len(tokens)
    checks = (
        ("version", rec.get("v") == FORMAT_VERSION),
        ("namespace", rec.get("ns") == namespace_key),
        ("tokens", rec.get("tokens") == expected_tokens),
        ("dtype", rec.get("dtype") == layout.dtype_name),
        ("shape", rec.get("shape") == [n, [list(x) for x in layout.layers]]),
    )
    for what, ok in checks:
        if not ok:
            raise VerificationError(f"{what} mismatch")
    payload = rec.get("kv")
    if not isinstance(payload, bytes) or len(payload) != n * layout.token_bytes():
        raise VerificationError("payload length mismatch")
    if rec.get("sum") != xxhash.xxh3_64_intdigest(payload):
        raise VerificationError("checksum mismatch")
    with warnings.catch_warnings():  # a read-only view of the reply: no copy; it is only ever read
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(payload, dtype=torch.uint8).view(layout.dtype)
    out: list[torch.Tensor | None] = []
    offset = 0
    for heads, dim in layout.layers:
        if heads == 0:
            out.append(None)
            continue
        size = n * 2 * heads * dim
        out.append(flat[offset : offset + size].view(n, 2, heads, dim).to(device, non_blocking=True))
        offset += size
    return out


class ChunkCodec(Protocol):
    """How a spill tier names, frames and verifies chunks in Redis.

    `NativeCodec` is kvblocks' own format; `kvblocks.adapters.lmcache.LMCacheCodec` reads and
    writes LMCache's. `decode` raises VerificationError for anything it cannot vouch for.
    """

    # Whether a value that fails verification may be deleted: only when the format's keys belong
    # to kvblocks, never when other programs may read the same key with other expectations.
    delete_invalid: bool

    def bind(self, layout: ChunkLayout, namespace_key: str) -> None: ...

    def chunk_hashes(self, namespace_key: str, ids: np.ndarray, chunk_tokens: int) -> list[str]: ...

    def key(self, namespace_key: str, chunk_hash: str) -> str: ...

    def encode(
        self, namespace_key: str, tokens: np.ndarray, layout: ChunkLayout, kv: list[torch.Tensor | None]
    ) -> bytes: ...

    def decode(
        self,
        raw: bytes,
        namespace_key: str,
        tokens: np.ndarray,
        layout: ChunkLayout,
        device: torch.device | str,
    ) -> list[torch.Tensor | None]: ...


@dataclass(slots=True, frozen=True)
class NativeCodec:
    """kvblocks' own format: `prefix:vN:namespace:chain-hash` keys, verified msgpack records."""

    key_prefix: str = "kvblocks"
    delete_invalid: ClassVar[bool] = True

    def bind(self, layout: ChunkLayout, namespace_key: str) -> None:
        """Every layout is supported."""

    def chunk_hashes(self, namespace_key: str, ids: np.ndarray, chunk_tokens: int) -> list[str]:
        return chain_hashes(namespace_key, ids, chunk_tokens)

    def key(self, namespace_key: str, chunk_hash: str) -> str:
        return f"{self.key_prefix}:v{FORMAT_VERSION}:{namespace_key}:{chunk_hash}"

    def encode(
        self, namespace_key: str, tokens: np.ndarray, layout: ChunkLayout, kv: list[torch.Tensor | None]
    ) -> bytes:
        return encode_record(namespace_key, tokens, layout, kv)

    def decode(
        self,
        raw: bytes,
        namespace_key: str,
        tokens: np.ndarray,
        layout: ChunkLayout,
        device: torch.device | str,
    ) -> list[torch.Tensor | None]:
        return decode_record(raw, namespace_key, tokens, layout, device)
