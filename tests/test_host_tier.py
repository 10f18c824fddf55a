"""HostTier alone and the copies around it (`spill.transfer`): LRU by bytes with demotion, records
pinned only where CUDA is, and the copies off and onto the device. The CUDA half skips without a GPU;
on the CPU the tier keeps plain bytes and every copy is a synchronous one."""

from __future__ import annotations

import pytest
import torch

from kvblocks.spill.host import HostTier
from kvblocks.spill.lru import BytesLRU
from kvblocks.spill.tier import Tier
from kvblocks.spill.transfer import offload, upload

CUDA = torch.cuda.is_available()


def test_bytes_lru_evicts_the_least_recent_first_and_keeps_its_sum():
    lru = BytesLRU(10)
    for name, size in (("a", 4), ("b", 3), ("c", 3)):
        lru.add(name, size)
    lru.touch(["a"])
    assert list(lru) == ["b", "c", "a"] and lru.used == 10
    assert not lru.fits(1) and lru.fits(4, "a") and lru.victim() == "b" and lru.victim(keep="b") == "c"
    lru.add("d", 2, recent=False)  # another process's file: first out
    assert next(iter(lru)) == "d" and lru.used == 12
    assert lru.pop("d") == 2 and lru.pop("absent") == 0 and lru.used == 10
    with pytest.raises(ValueError, match="positive"):
        BytesLRU(0)


def test_host_tier_evicts_by_bytes_least_recent_first_and_demotes_what_it_evicts():
    tier = HostTier(30, pin_memory=False)
    assert isinstance(tier, Tier)
    demoted: list[tuple[str, bytes]] = []
    tier.bind_demote(demoted.extend)
    tier.put([("a", b"a" * 10), ("b", b"b" * 10), ("c", b"c" * 10)])
    assert tier.get(["a"], [100]) == [b"a" * 10]  # a is now the most recent
    tier.put([("d", b"d" * 15)])  # needs 15: b then c go
    assert demoted == [("b", b"b" * 10), ("c", b"c" * 10)]
    assert tier.sizes(["a", "b", "c", "d"]) == [10, 0, 0, 15] and tier.used_bytes() == 25
    assert tier.put([("huge", bytes(31))]) == 0 and tier.counters()["refused_too_large"] == 1
    assert tier.get(["d"], [4]) == [b"dddd"] and tier.delete(["a", "zz"]) == 1 and tier.used_bytes() == 15
    assert tier.counters()["evictions"] == 2 and tier.counters()["evicted_bytes"] == 20


@pytest.mark.skipif(CUDA, reason="checks the CPU-only refusal")
def test_pinning_is_refused_by_name_without_cuda_and_off_by_default():
    with pytest.raises(ValueError, match="only where CUDA is available"):
        HostTier(1 << 20, pin_memory=True)
    tier = HostTier(1 << 20)
    tier.put([("k", b"value")])
    assert not tier.pin_memory and tier.get(["k"], [10]) == [b"value"]


def test_copies_off_and_onto_the_cpu_are_plain_copies():
    kv = [torch.arange(12, dtype=torch.float32).view(3, 2, 1, 2), None]
    host, ready = offload(kv, torch.device("cpu"))
    assert ready is None and host[1] is None and torch.equal(host[0], kv[0])
    assert host[0].data_ptr() != kv[0].data_ptr()  # a copy: the pool may reuse its blocks at once
    kv[0].zero_()
    assert host[0].sum() == 66
    assert upload(host, torch.device("cpu"))[0] is host[0]


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_on_cuda_records_are_pinned_and_copies_round_trip_through_the_side_stream():
    tier = HostTier(1 << 20)
    value = bytes(range(256)) * 4
    tier.put([("k", value)])
    [got] = tier.get(["k"], [1 << 20])
    assert tier.pin_memory and isinstance(got, memoryview) and got.readonly and bytes(got) == value
    assert tier._records["k"].is_pinned()
    device = torch.device("cuda")
    kv = [torch.randn(4, 2, 2, 8, device=device), None]
    host, ready = offload(kv, device)
    ready.synchronize()
    assert host[0].is_pinned() and torch.equal(host[0], kv[0].cpu())
    up = upload(host, device)
    torch.cuda.current_stream().synchronize()
    assert torch.equal(up[0], kv[0]) and up[1] is None
