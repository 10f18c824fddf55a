"""Spill-tier chunks: the record codec refuses anything but the exact record, and chain hashes name
exact prefixes.

A record that decodes must be bit-identical to what was encoded; every other value (another
version, namespace, token run, dtype or layout, a short or damaged payload, garbage) raises
VerificationError, which the tier turns into a miss.
"""

from __future__ import annotations

import hashlib

import msgpack
import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvblocks.cache.layout import KVLayout
from kvblocks.spill.records import (
    FORMAT_VERSION,
    VerificationError,
    _split_record,
    all_finite,
    chain_hashes,
    decode_record,
    decode_record_into,
    encode_record,
    record_size_bounds,
)
from kvblocks.spill.sealing import Sealer

NS = "ns-a"
TOKENS = np.arange(100, 108, dtype=np.int32)
# Layer 1 caches nothing (heads 0), as a layer of kind "none" does.
LAYOUT = KVLayout.from_shapes(torch.float32, ((2, 4), (0, 0), (1, 8)))


def random_kv(layout: KVLayout, n: int, seed: int = 0) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    return [
        None if heads == 0 else torch.randn(n, 2, heads, dim, generator=g).to(layout.dtype)
        for heads, dim in layout.shapes
    ]


def record(**overrides) -> bytes:
    """A valid record for (NS, TOKENS, LAYOUT), with some fields replaced after encoding."""
    raw = encode_record(NS, TOKENS, LAYOUT, random_kv(LAYOUT, len(TOKENS)))
    fields = msgpack.unpackb(raw, raw=False) | overrides
    return msgpack.packb(fields, use_bin_type=True)


def decode(raw: bytes, namespace: str = NS, tokens: np.ndarray = TOKENS, layout: KVLayout = LAYOUT):
    return decode_record(raw, namespace, tokens, layout, "cpu")


# ---- codec -----------------------------------------------------------------------------------


FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
NON_FINITE = [float("nan"), float("inf"), float("-inf")]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_record_round_trip_is_bit_exact(dtype):
    layout = KVLayout.from_shapes(dtype, LAYOUT.shapes)
    kv = random_kv(layout, len(TOKENS), seed=3)
    out = decode(encode_record(NS, TOKENS, layout, kv), layout=layout)
    assert out[1] is None
    for got, want in zip(out, kv):
        if want is not None:
            assert got.dtype == dtype
            assert got.shape == want.shape
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_decoded_tensors_do_not_alias_the_stored_bytes():
    raw = encode_record(NS, TOKENS, LAYOUT, random_kv(LAYOUT, len(TOKENS)))
    out = decode(raw)
    out[0].add_(1.0)
    assert torch.equal(decode(raw)[2], out[2])
    assert not torch.equal(decode(raw)[0], out[0])


@pytest.mark.parametrize("sealer", [None, Sealer(b"chunk-test-secret-0123456789")], ids=["plain", "sealed"])
def test_decode_into_writes_exactly_its_rows_of_a_larger_run(sealer):
    n = len(TOKENS)
    kv = random_kv(LAYOUT, n, seed=5)
    run = LAYOUT.empty(3 * n)
    for t in run:
        if t is not None:
            t.fill_(7.0)
    raw = encode_record(NS, TOKENS, LAYOUT, kv, key="k", sealer=sealer)
    rows = [None if t is None else t[n : 2 * n] for t in run]
    decode_record_into(raw, NS, TOKENS, LAYOUT, rows, key="k", sealer=sealer)
    for got, want in zip(run, kv, strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            assert torch.equal(got[n : 2 * n], want)
            assert bool((got[:n] == 7.0).all()) and bool((got[2 * n :] == 7.0).all())


def test_token_ids_of_any_integer_type_encode_alike():
    kv = random_kv(LAYOUT, len(TOKENS))
    raws = {encode_record(NS, t, LAYOUT, kv) for t in (TOKENS, TOKENS.astype(np.int64), TOKENS.tolist())}
    assert len(raws) == 1


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        pytest.param(record(v=FORMAT_VERSION + 1), "version", id="newer-version"),
        pytest.param(record(v=None), "version", id="no-version"),
        pytest.param(record(ns="ns-b"), "namespace", id="other-namespace"),
        pytest.param(record(tokens=(TOKENS + 1).astype("<i4").tobytes()), "tokens", id="other-tokens"),
        pytest.param(record(tokens=TOKENS[:-1].astype("<i4").tobytes()), "tokens", id="fewer-tokens"),
        pytest.param(record(dtype="float64"), "dtype", id="other-dtype"),
        pytest.param(record(shape=[8, [[2, 4], [0, 0], [2, 4]]]), "shape", id="other-heads"),
        pytest.param(record(shape=[7, [[2, 4], [0, 0], [1, 8]]]), "shape", id="other-length"),
        pytest.param(record(kv=b""), "size", id="empty-payload"),
        pytest.param(record(kv="text"), "size", id="payload-not-bytes"),
        pytest.param(record(sum=0), "checksum", id="wrong-checksum"),
        pytest.param(record(sum=None), "checksum", id="no-checksum"),
    ],
)
def test_record_with_a_wrong_field_fails_verification(raw, reason):
    with pytest.raises(VerificationError, match=reason):
        decode(raw)


def test_record_for_another_namespace_fails_verification():
    with pytest.raises(VerificationError, match="namespace"):
        decode(record(), namespace="ns-b")


def test_record_for_other_token_ids_fails_verification():
    with pytest.raises(VerificationError, match="tokens"):
        decode(record(), tokens=TOKENS[::-1].copy())


def test_record_read_as_another_dtype_fails_verification():
    with pytest.raises(VerificationError, match="size"):  # a record's size follows from its dtype
        decode(record(), layout=KVLayout.from_shapes(torch.bfloat16, LAYOUT.shapes))


def test_record_read_with_another_layer_shape_fails_verification():
    with pytest.raises(VerificationError, match="shape"):
        decode(record(), layout=KVLayout.from_shapes(torch.float32, ((2, 4), (0, 0), (2, 4))))
    with pytest.raises(VerificationError, match="size"):
        decode(record(), layout=KVLayout.from_shapes(torch.float32, ((2, 4), (0, 0))))


def test_payload_cut_short_with_a_matching_checksum_fails_verification():
    raw = record()
    payload = msgpack.unpackb(raw, raw=False)["kv"][:-4]
    with pytest.raises(VerificationError, match="payload length"):
        decode(record(kv=payload, sum=xxhash.xxh3_64_intdigest(payload)))


@pytest.mark.parametrize("keep", [0.0, 0.01, 0.1, 0.5, 0.999])
def test_truncated_value_fails_verification(keep):
    raw = record()
    with pytest.raises(VerificationError, match=r"size|msgpack"):
        decode(raw[: int(len(raw) * keep)])
    with pytest.raises(VerificationError, match=r"size|msgpack"):
        decode(raw[:-1])


@pytest.mark.parametrize("from_end", [1, 2, 100])
def test_flipped_payload_byte_fails_the_checksum(from_end):
    raw = bytearray(record())
    raw[-from_end] ^= 0x01
    with pytest.raises(VerificationError, match="checksum"):
        decode(bytes(raw))


@pytest.mark.parametrize("bit", [0x01, 0x10, 0x40, 0x80])
def test_any_flipped_header_bit_fails_verification(bit):
    raw = encode_record(NS, TOKENS, LAYOUT, random_kv(LAYOUT, len(TOKENS)))
    payload_start = len(raw) - len(TOKENS) * LAYOUT.token_bytes()
    for i in range(payload_start):
        damaged = bytearray(raw)
        damaged[i] ^= bit
        with pytest.raises(VerificationError):
            decode(bytes(damaged))


@pytest.mark.parametrize(
    "raw",
    [b"", b"\xc1", b"not msgpack at all", bytes(range(256)), b"\x81\xa1v\x01trailing"],
    ids=["empty", "reserved-byte", "text", "bytes", "extra-data"],
)
def test_non_msgpack_garbage_fails_verification(raw):
    with pytest.raises(VerificationError, match="size"):
        decode(raw)


@pytest.mark.parametrize("value", [[1, 2, 3], 5, "kv", b"kv", None, {1: 2}])
def test_msgpack_that_is_not_a_record_map_fails_verification(value):
    with pytest.raises(VerificationError):
        decode(msgpack.packb(value, use_bin_type=True))


def test_empty_map_fails_verification():
    with pytest.raises(VerificationError, match="size"):
        decode(msgpack.packb({}))


# ---- chain hashes ----------------------------------------------------------------------------


def reference_chain(namespace: str, ids: list[int], c: int) -> list[str]:
    """The spec: h_-1 = blake2b-128(namespace); h_i = blake2b-128(h_{i-1} + int32le(chunk i))."""
    h = hashlib.blake2b(namespace.encode(), digest_size=16).digest()
    out = []
    for i in range(len(ids) // c):
        chunk = b"".join(t.to_bytes(4, "little", signed=True) for t in ids[i * c : (i + 1) * c])
        h = hashlib.blake2b(h + chunk, digest_size=16).digest()
        out.append(h.hex())
    return out


# Timing is no property here; a busy 2-core machine can stall any one example past a deadline.
no_deadline = settings(deadline=None)
token_lists = st.lists(st.integers(0, 200_000), max_size=60)
chunk_sizes = st.integers(1, 9)


@no_deadline
@given(token_lists, chunk_sizes)
def test_chain_hashes_follow_the_spec_and_cover_only_complete_chunks(ids, c):
    hashes = chain_hashes(NS, np.array(ids, dtype=np.int64), c)
    assert len(hashes) == len(ids) // c
    assert hashes == reference_chain(NS, ids, c)


@no_deadline
@given(token_lists, chunk_sizes, st.integers(0, 60))
def test_chain_hash_of_a_prefix_is_a_prefix_of_the_chain(ids, c, cut):
    arr = np.array(ids, dtype=np.int32)
    assert chain_hashes(NS, arr[:cut], c) == chain_hashes(NS, arr, c)[: min(cut, len(ids)) // c]


@no_deadline
@given(token_lists.filter(len), chunk_sizes, st.data())
def test_changing_one_token_changes_its_chunk_hash_and_every_later_one_only(ids, c, data):
    p = data.draw(st.integers(0, len(ids) - 1))
    other = list(ids)
    other[p] += 1
    a, b = chain_hashes(NS, np.array(ids), c), chain_hashes(NS, np.array(other), c)
    first = p // c
    assert a[:first] == b[:first]
    assert all(x != y for x, y in zip(a[first:], b[first:]))


@no_deadline
@given(token_lists.filter(lambda x: len(x) >= 9), chunk_sizes)
def test_chain_hashes_differ_between_namespaces(ids, c):
    a, b = chain_hashes("ns-a", np.array(ids), c), chain_hashes("ns-b", np.array(ids), c)
    assert not set(a) & set(b)


@no_deadline
@given(token_lists.filter(lambda x: len(x) >= 9), chunk_sizes, chunk_sizes)
def test_chain_hashes_differ_between_chunk_sizes(ids, c1, c2):
    if c1 != c2:
        assert not set(chain_hashes(NS, np.array(ids), c1)) & set(chain_hashes(NS, np.array(ids), c2))


def test_chain_hashes_ignore_the_integer_type_of_the_ids():
    ids = [5, 70000, 3, 9, 11, 0, 1, 2]
    hashes = {tuple(chain_hashes(NS, x, 4)) for x in (ids, np.array(ids, np.int32), np.array(ids, np.int64))}
    assert len(hashes) == 1


# ---- sealed records --------------------------------------------------------------------------

SEALER = Sealer(b"chunk-test-secret-0123456789")
KEY = "kvblocks:v2s:tag:hash"


def sealed(kv=None, *, key: str = KEY, namespace: str = NS, tokens: np.ndarray = TOKENS, sealer=SEALER):
    kv = random_kv(LAYOUT, len(tokens)) if kv is None else kv
    return encode_record(namespace, tokens, LAYOUT, kv, key=key, sealer=sealer)


def open_sealed(
    raw: bytes, *, key: str = KEY, namespace: str = NS, tokens: np.ndarray = TOKENS, sealer=SEALER
):
    return decode_record(raw, namespace, tokens, LAYOUT, "cpu", key=key, sealer=sealer)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_sealed_record_round_trip_is_bit_exact(dtype):
    layout = KVLayout.from_shapes(dtype, LAYOUT.shapes)
    kv = random_kv(layout, len(TOKENS))
    raw = encode_record(NS, TOKENS, layout, kv, key=KEY, sealer=SEALER)
    out = decode_record(raw, NS, TOKENS, layout, "cpu", key=KEY, sealer=SEALER)
    for got, want in zip(out, kv, strict=True):
        assert (got is None and want is None) or torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (dict(key=KEY + "x"), "authentication"),
        (dict(namespace="ns-b"), "authentication"),
        (dict(tokens=TOKENS + 1), "tokens"),
        (dict(sealer=Sealer(b"another-secret-0123456789")), "authentication"),
        (dict(sealer=None), "form"),
    ],
    ids=["other-key", "other-namespace", "other-tokens", "other-secret", "read-as-plain"],
)
def test_sealed_record_opens_only_for_its_key_namespace_tokens_and_secret(change, reason):
    with pytest.raises(VerificationError, match=reason):
        open_sealed(sealed(), **change)


def test_plain_record_with_a_valid_checksum_is_refused_where_a_seal_is_expected():
    raw = encode_record(NS, TOKENS, LAYOUT, random_kv(LAYOUT, len(TOKENS)), key=KEY)
    with pytest.raises(VerificationError, match="size"):
        open_sealed(raw)


def test_sealed_record_holds_no_token_ids_or_namespace_in_the_clear():
    raw = sealed(namespace="tenant-namespace-key")
    assert TOKENS.astype("<i4").tobytes() not in raw
    assert b"tenant-namespace-key" not in raw


def test_flipped_bit_anywhere_in_a_sealed_record_fails():
    raw = sealed()
    for i in range(0, len(raw), 7):
        damaged = bytearray(raw)
        damaged[i] ^= 0x04
        with pytest.raises(VerificationError):
            open_sealed(bytes(damaged))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("sealer", [None, SEALER], ids=["plain", "sealed"])
def test_nan_or_inf_anywhere_in_the_kv_fails_verification_even_with_a_valid_checksum_or_seal(dtype, sealer):
    layout = KVLayout.from_shapes(dtype, LAYOUT.shapes)
    kv = random_kv(layout, len(TOKENS))

    def round_trip(kv: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        raw = encode_record(NS, TOKENS, layout, kv, key=KEY, sealer=sealer)
        return decode_record(raw, NS, TOKENS, layout, "cpu", key=KEY, sealer=sealer)

    round_trip(kv)
    for layer in (0, 2):
        for position in range(kv[layer].numel()):
            for value in NON_FINITE:
                poisoned = [None if t is None else t.clone() for t in kv]
                poisoned[layer].view(-1)[position] = value
                with pytest.raises(VerificationError, match="non-finite"):
                    round_trip(poisoned)


def test_plain_record_is_bound_to_its_redis_key():
    raw = encode_record(NS, TOKENS, LAYOUT, random_kv(LAYOUT, len(TOKENS)), key="k1")
    decode_record(raw, NS, TOKENS, LAYOUT, "cpu", key="k1")
    with pytest.raises(VerificationError, match="key"):
        decode_record(raw, NS, TOKENS, LAYOUT, "cpu", key="k2")


def test_keyed_chain_hashes_differ_from_plain_ones_and_between_secrets():
    ids = np.arange(40)
    plain = chain_hashes(NS, ids, 8)
    keyed = chain_hashes(NS, ids, 8, SEALER)
    other = chain_hashes(NS, ids, 8, Sealer(b"another-secret-0123456789"))
    assert len(plain) == len(keyed) == len(other) == 5
    assert not (set(plain) & set(keyed)) and not (set(keyed) & set(other))


# ---- finiteness ------------------------------------------------------------------------------
# all_finite relies on NaN propagating through torch.aminmax's vectorised, unrolled and (with
# threads) parallel reductions; these tests put a non-finite value in every kind of position.


def non_finite_bit_patterns(dtype: torch.dtype) -> list[int]:
    """Every NaN and ±inf bit pattern of a 16-bit float; both signs of the edge mantissas otherwise."""
    bits, mantissa_bits = {
        torch.float16: (16, 10),
        torch.bfloat16: (16, 7),
        torch.float32: (32, 23),
        torch.float64: (64, 52),
    }[dtype]
    top = 1 << mantissa_bits
    mantissas = range(top) if bits == 16 else [0, 1, 2, top // 2 - 1, top // 2, top // 2 + 1, top - 1]
    exponent = ((1 << (bits - 1 - mantissa_bits)) - 1) << mantissa_bits
    sign = 1 << (bits - 1)
    return [s | exponent | m for s in (0, sign) for m in mantissas]


def with_bits(t: torch.Tensor, position: int, pattern: int) -> torch.Tensor:
    words = (
        t.view(torch.uint8).numpy().copy().view({2: np.uint16, 4: np.uint32, 8: np.uint64}[t.element_size()])
    )
    words[position] = pattern
    return torch.from_numpy(words.view(np.uint8)).view(t.dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_all_finite_sees_nan_and_inf_at_every_position(dtype):
    for n in [*range(1, 40), 63, 64, 65, 127, 128, 129, 1031]:
        base = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype) * 100
        assert all_finite(base)
        for position in range(n):
            for value in NON_FINITE:
                t = base.clone()
                t[position] = value
                assert not all_finite(t), (n, position, value)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_all_finite_sees_every_nan_and_inf_bit_pattern(dtype):
    base = torch.randn(37, generator=torch.Generator().manual_seed(1)).to(dtype)
    for i, pattern in enumerate(non_finite_bit_patterns(dtype)):
        t = with_bits(base, i % len(base), pattern)
        assert not bool(torch.isfinite(t).all())
        assert not all_finite(t), hex(pattern)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_all_finite_sees_nan_and_inf_in_large_and_parallel_reductions(dtype, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = 200_003
        base = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(dtype)
        assert all_finite(base)
        for position in (0, 1, 32_767, 32_768, 65_535, 65_536, n // 2, n - 2, n - 1):
            for value in NON_FINITE:
                t = base.clone()
                t[position] = value
                assert not all_finite(t), (position, value)
        mixed = base.clone()
        mixed[0], mixed[-1] = float("-inf"), float("nan")
        assert not all_finite(mixed)
        assert not all_finite(torch.full((n,), float("nan"), dtype=dtype))
    finally:
        torch.set_num_threads(before)


@no_deadline
@given(st.sampled_from(FLOAT_DTYPES), st.binary(max_size=512))
def test_all_finite_agrees_with_isfinite_on_arbitrary_bytes(dtype, data):
    size = torch.empty(0, dtype=dtype).element_size()
    data = data[: len(data) // size * size]
    t = torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.empty(0, dtype=dtype)
    assert all_finite(t) == bool(torch.isfinite(t).all())


def test_a_well_formed_record_is_split_without_copying_its_payload():
    from kvblocks.spill.records import _split_record

    kv = random_kv(LAYOUT, len(TOKENS))
    raw = encode_record(NS, TOKENS, LAYOUT, kv)
    kv_bytes = len(TOKENS) * LAYOUT.token_bytes()
    fields = _split_record(raw, kv_bytes)
    assert isinstance(fields["kv"], memoryview) and fields["kv"].obj is raw
    assert fields == msgpack.unpackb(raw, raw=False) | {"kv": fields["kv"]}
    assert bytes(fields["kv"]) == msgpack.unpackb(raw, raw=False)["kv"]
    sealed = encode_record(NS, TOKENS, LAYOUT, kv, sealer=Sealer(b"s" * 32))
    assert isinstance(_split_record(sealed, 4 * len(TOKENS) + kv_bytes + 16)["ct"], memoryview)
    # anything else goes to the full parse: another length, the payload not last, trailing bytes
    assert _split_record(raw, kv_bytes - 4) is None
    moved = msgpack.packb({"kv": msgpack.unpackb(raw)["kv"], "v": 2}, use_bin_type=True)
    assert _split_record(moved, kv_bytes) is None
    assert _split_record(raw + b"\0", kv_bytes) is None


# ---- values of any size and content ------------------------------------------------------------


def test_value_longer_than_msgpacks_buffer_with_an_intact_last_bin_header_is_not_split():
    """The value of issue 21: over 100 MiB (msgpack's default buffer), ending in a bin header that
    matches the payload. Splitting it must refuse it, never raise msgpack's BufferFull."""
    payload = len(TOKENS) * LAYOUT.token_bytes()
    raw = b"\x81" + bytes(101 << 20) + b"\xc6" + payload.to_bytes(4, "big") + bytes(payload)
    assert _split_record(raw, payload) is None
    with pytest.raises(VerificationError, match="size"):
        decode(raw)


@pytest.mark.parametrize("sealer", [None, Sealer(b"0123456789abcdef-secret")], ids=["plain", "sealed"])
def test_size_bounds_hold_every_record_and_are_tight(sealer):
    for seed in range(50):
        raw = encode_record(NS, TOKENS, LAYOUT, random_kv(LAYOUT, len(TOKENS), seed), key=KEY, sealer=sealer)
        low, high = record_size_bounds(NS, len(TOKENS), LAYOUT, key=KEY, sealer=sealer)
        assert low <= len(raw) <= high
        assert high - low == (0 if sealer else 8)


def huge_headers() -> st.SearchStrategy[bytes]:
    """msgpack whose headers declare far more than follows (str, bin, array and map of 2**32-1)."""
    return st.sampled_from([b"\xdb", b"\xc6", b"\xdd", b"\xdf"]).map(lambda h: h + b"\xff\xff\xff\xff")


def values_of_record_size() -> st.SearchStrategy[bytes]:
    low, high = record_size_bounds(NS, len(TOKENS), LAYOUT, key=KEY)
    return st.integers(low, high).flatmap(lambda n: st.binary(min_size=n, max_size=n))


def damaged_records() -> st.SearchStrategy[bytes]:
    raw = encode_record(NS, TOKENS, LAYOUT, random_kv(LAYOUT, len(TOKENS)), key=KEY)
    flips = st.dictionaries(st.integers(0, len(raw) - 1), st.integers(1, 255), min_size=1, max_size=4)
    return flips.map(lambda fs: _xor(raw, fs))


def _xor(raw: bytes, flips: dict[int, int]) -> bytes:
    out = bytearray(raw)
    for i, bits in flips.items():
        out[i] ^= bits
    return bytes(out)


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=2000),
        huge_headers().flatmap(lambda h: st.binary(max_size=64).map(lambda tail: h + tail)),
        values_of_record_size(),
        damaged_records(),
    )
)
def test_any_foreign_or_damaged_bytes_raise_verification_error_and_nothing_else(raw):
    with pytest.raises(VerificationError):
        decode_record(raw, NS, TOKENS, LAYOUT, "cpu", key=KEY)
