"""KV events in vLLM's wire format (kvblocks.telemetry.kv_events), read the way routers read them: a real ZMQ
SUB socket (and a DEALER for replays) decoding every batch with msgpack, against a real trie."""

from __future__ import annotations

import time

import httpx
import msgpack
import numpy as np
import pytest
import torch
import xxhash
import zmq
from fleet import MODEL, Outcome, drive, fleet_model, make_jobs, make_tenants, start_fleet, tokenize_jobs
from redis_server import RedisServer, free_port
from test_trie import CONFIG, SPECS, synthetic_past, synthetic_trie
from transformers import AutoTokenizer

from kvblocks import KVCacheTrie
from kvblocks.cache.namespace import Namespace
from kvblocks.cli.commands import main
from kvblocks.spill.redis_tier import RedisTier
from kvblocks.telemetry.kv_events import END_SEQ, BlockHasher, KVEventPublisher

BS = 4  # block size of these tests: small prompts span several blocks
STORED_KEYS = [
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
]


class Router:
    """What a router knows of one replica: a SUB socket, batches applied in sequence order."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.batches: list[tuple[int, list]] = []  # (seq, [ts, events, rank])
        self.device: set[int] = set()
        self.shared: set[int] = set()
        self.parents: dict[int, int | None] = {}

    def receive(self, timeout_s: float = 5.0) -> tuple[int, list]:
        assert self.sock.poll(int(timeout_s * 1000)), "no KV event batch arrived"
        topic, seq, payload = self.sock.recv_multipart()
        assert topic == b"" and len(seq) == 8
        batch = msgpack.unpackb(payload)
        self.batches.append((int.from_bytes(seq, "big"), batch))
        for event in batch[1]:
            self.apply(event)
        return self.batches[-1]

    def apply(self, event: dict) -> None:
        if event["type"] == "AllBlocksCleared":
            assert list(event) == ["type"]
            self.device.clear()
        elif event["type"] == "BlockStored":
            assert list(event)[: len(STORED_KEYS)] == STORED_KEYS, event
            hashes = event["block_hashes"]
            assert len(event["token_ids"]) == len(hashes) * event["block_size"]
            tier = self.shared if event.get("ownership") == "redis" else self.device
            assert event["medium"] == ("STORAGE" if tier is self.shared else "GPU")
            for parent, h in zip([event["parent_block_hash"], *hashes], hashes):
                self.parents[h] = parent
                tier.add(h)
        else:
            assert event["type"] == "BlockRemoved" and list(event) == ["type", "block_hashes", "medium"]
            assert event["medium"] == "GPU"
            self.device.difference_update(event["block_hashes"])

    def catch_up(self, publisher: KVEventPublisher) -> None:
        """Receive until this router has every batch the publisher has sent."""
        assert publisher.flush()
        last = publisher.stats()["kv_events_sequence"] - 1
        while not self.batches or self.batches[-1][0] < last:
            self.receive()

    def wait_connected(self, publisher: KVEventPublisher, subscribers: int = 1) -> None:
        """Wait until the publisher heard this router subscribe, then for the whole state it sends."""
        deadline = time.monotonic() + 5.0
        while publisher.stats()["kv_events_subscriptions"] < subscribers:
            assert time.monotonic() < deadline, "the publisher never heard the subscription"
            time.sleep(0.01)
        self.catch_up(publisher)
        assert any(b[1][0] == {"type": "AllBlocksCleared"} for _, b in self.batches)

    def events_since(self, batch: int) -> list[dict]:
        """Every event of the batches received after the first `batch` ones."""
        return [e for _, b in self.batches[batch:] for e in b[1]]

    def close(self) -> None:
        self.sock.close(linger=0)


def endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def chain(ids, seed: str, bs: int = BS) -> list[int]:
    """The documented hash chain, written out independently of BlockHasher."""
    h, out = xxhash.xxh3_64_intdigest(seed.encode()), []
    for i in range(len(ids) // bs):
        block = np.asarray(ids[i * bs : (i + 1) * bs], dtype="<i4").tobytes()
        h = xxhash.xxh3_64_intdigest(h.to_bytes(8, "big") + block)
        out.append(h)
    return out


def resident_blocks(trie) -> set[int]:
    """Hashes of every full block resident in the trie, any namespace, from a walk of its tree."""
    out = set()
    for node in trie._tree.iter_nodes():
        ids, _ = trie._tree.path(node)
        out.update(chain(ids, trie.namespace.key))
    return out


def insert(trie, ids, salt: str = "") -> None:
    trie.insert(ids, synthetic_past(ids, salt), salt=salt)


@pytest.fixture
def replica():
    """(trie, publisher, router): a synthetic trie publishing to a connected SUB socket."""
    trie = synthetic_trie(64)
    publisher = KVEventPublisher(endpoint(), replay_endpoint=endpoint(), block_size=BS)
    router = Router(publisher.endpoint)
    trie.attach_events(publisher)
    router.wait_connected(publisher)
    yield trie, publisher, router
    router.close()
    trie.close()


def test_batches_are_vllm_event_batches_with_consecutive_sequence_numbers(replica):
    trie, publisher, router = replica
    seen = len(router.batches)
    for first in (1, 20, 40):
        insert(trie, list(range(first, first + 9)))
        router.catch_up(publisher)
    seqs = [seq for seq, _ in router.batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    for _, batch in router.batches:
        ts, _, rank = batch
        assert isinstance(ts, float) and abs(ts - time.time()) < 60 and rank == 0
    stored = router.events_since(seen)
    assert [e["type"] for e in stored] == ["BlockStored"] * 3
    assert all(e["block_size"] == BS and e["lora_id"] is None and e["lora_name"] is None for e in stored)


def test_stored_blocks_are_the_full_blocks_chained_to_their_parent(replica):
    trie, publisher, router = replica
    seed = trie.namespace.key
    base = list(range(1, 11))  # 2 full blocks and 2 tokens
    insert(trie, base)
    router.catch_up(publisher)
    (event,) = router.batches[-1][1][1]
    assert event["block_hashes"] == chain(base, seed) and event["parent_block_hash"] is None
    assert event["token_ids"] == base[:8] and event["medium"] == "GPU"

    seen = len(router.batches)
    longer = [*base, 11, 12, 13, 14, 15, 16]  # completes block 2 (9..12) and adds block 3
    insert(trie, longer)
    branch = [*base[:6], 90, 91, 92, 93]  # shares block 0, diverges inside block 1
    insert(trie, branch)
    router.catch_up(publisher)
    first, second = router.events_since(seen)
    assert first["block_hashes"] == chain(longer, seed)[2:] and first["token_ids"] == longer[8:16]
    assert first["parent_block_hash"] == chain(longer, seed)[1]
    assert second["block_hashes"] == chain(branch, seed)[1:] and second["token_ids"] == branch[4:8]
    assert second["parent_block_hash"] == chain(base, seed)[0]
    assert router.device == resident_blocks(trie)


def test_the_same_prefix_has_the_same_hashes_on_every_replica_of_a_model():
    ids = list(range(3, 30))
    seen = []
    for namespace in (Namespace("synthetic", "float64"),) * 2 + (Namespace("other-weights", "float64"),):
        hasher = BlockHasher(BS, namespace.key)
        seen.append(hasher.hashes(np.asarray(ids, dtype=np.int32)))
    assert seen[0] == seen[1] == chain(ids, Namespace("synthetic", "float64").key)
    assert not set(seen[0]) & set(seen[2])
    # a prefix's hashes lead any longer sequence's; a chain can go on from a known hash
    hasher = BlockHasher(BS, "s")
    whole = hasher.hashes(np.asarray(ids))
    assert hasher.hashes(np.asarray(ids[:12])) == whole[:3]
    assert hasher.hashes(np.asarray(ids[12:]), whole[2]) == whole[3:]


def test_two_tries_publish_identical_hashes_for_a_shared_prefix():
    tries, routers, publishers = [], [], []
    for _ in range(2):
        trie, publisher = synthetic_trie(64), KVEventPublisher(endpoint(), block_size=BS)
        router = Router(publisher.endpoint)
        trie.attach_events(publisher)
        router.wait_connected(publisher)
        tries.append(trie), publishers.append(publisher), routers.append(router)
    try:
        system = list(range(100, 113))
        insert(tries[0], [*system, 1, 2, 3, 4])
        insert(tries[1], [*system, 7, 8, 9, 10, 11])
        for router, publisher in zip(routers, publishers):
            router.catch_up(publisher)
        shared = set(chain(system, tries[0].namespace.key))
        assert len(shared) == 3 and shared <= routers[0].device and shared <= routers[1].device
        assert routers[0].device != routers[1].device
    finally:
        for trie, router in zip(tries, routers):
            router.close()
            trie.close()


def test_a_block_is_removed_only_when_the_last_namespace_holding_it_evicts_it(replica):
    trie, publisher, router = replica
    ids = list(range(1, 13))
    seen = len(router.batches)
    insert(trie, ids, salt="tenant-a")
    insert(trie, ids, salt="tenant-b")  # same tokens, another namespace: no second BlockStored
    router.catch_up(publisher)
    assert [e["type"] for e in router.events_since(seen)] == ["BlockStored"]
    assert publisher.stats()["kv_events_stored_blocks"] == 3

    count = len(router.batches)
    assert trie.evict(12) == 12  # tenant-a's copy (least recently used)
    assert publisher.flush()
    time.sleep(0.2)
    assert len(router.batches) == count and not router.sock.poll(0)  # nothing to say yet
    assert trie.evict(12) == 12
    router.catch_up(publisher)
    (removed,) = router.events_since(count)
    assert sorted(removed["block_hashes"]) == sorted(chain(ids, trie.namespace.key))
    assert router.device == resident_blocks(trie) == set()


def test_partial_eviction_removes_the_blocks_that_lose_a_token(replica):
    trie, publisher, router = replica
    ids = list(range(1, 17))
    insert(trie, ids)
    router.catch_up(publisher)
    seen = len(router.batches)
    assert trie.evict(3) == 3  # tokens 13..15 go: block 3 is no longer whole, blocks 0-2 stay
    router.catch_up(publisher)
    (removed,) = router.events_since(seen)
    assert removed["block_hashes"] == chain(ids, trie.namespace.key)[3:]
    assert router.device == resident_blocks(trie) and len(router.device) == 3


def test_clearing_the_cache_publishes_all_blocks_cleared_then_what_stays_pinned(replica):
    trie, publisher, router = replica
    kept, dropped = list(range(1, 11)), list(range(50, 63))
    insert(trie, kept)
    insert(trie, dropped)
    assert trie.pin(kept[:8]) == 8
    router.catch_up(publisher)
    seen = len(router.batches)
    assert trie.clear() == 2 + 13
    router.catch_up(publisher)
    events = router.events_since(seen)
    last_clear = max(i for i, e in enumerate(events) if e == {"type": "AllBlocksCleared"})
    (pinned,) = events[last_clear + 1 :]
    assert pinned["type"] == "BlockStored" and pinned["token_ids"] == kept[:8]
    assert router.device == resident_blocks(trie) == set(chain(kept, trie.namespace.key))


def test_a_late_subscriber_is_sent_every_resident_block_after_all_blocks_cleared(replica):
    trie, publisher, router = replica
    for first in (1, 30):
        insert(trie, list(range(first, first + 14)))
        insert(trie, [*list(range(first, first + 6)), 99, 98, 97, 96], salt="t")
    router.catch_up(publisher)
    late = Router(publisher.endpoint)
    try:
        late.wait_connected(publisher, subscribers=2)
        assert late.device == router.device == resident_blocks(trie)
        assert len(late.device) == 2 * 3 + 2 * 1
        # parents come before children, with their links: a router can place every block
        blocks = [
            h for _, b in late.batches for e in b[1] if e["type"] == "BlockStored" for h in e["block_hashes"]
        ]
        for i, h in enumerate(blocks):
            assert late.parents[h] is None or late.parents[h] in blocks[:i]
    finally:
        late.close()


def test_replay_socket_resends_missed_batches_from_the_requested_sequence_number(replica):
    trie, publisher, router = replica
    for first in (1, 20, 40, 60):
        insert(trie, list(range(first, first + 8)))
    router.catch_up(publisher)
    live = dict(router.batches)
    start = router.batches[-3][0]
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(publisher.replay_endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        replayed = []
        while True:
            assert dealer.poll(5000), "replay did not answer"
            frames = dealer.recv_multipart()
            assert len(frames) == 4 and frames[0] == b""
            if frames[2] == END_SEQ:
                assert frames[1] == frames[3] == b""
                break
            assert frames[1] == b""  # the topic
            replayed.append((int.from_bytes(frames[2], "big"), msgpack.unpackb(frames[3])))
    finally:
        dealer.close(linger=0)
    assert [seq for seq, _ in replayed] == [seq for seq in live if seq >= start]
    assert all(live[seq] == batch for seq, batch in replayed)
    assert publisher.stats()["kv_events_replays"] == 1


def test_a_full_queue_drops_jobs_without_blocking_and_then_republishes_the_whole_state():
    trie = synthetic_trie(256)
    publisher = KVEventPublisher(endpoint(), block_size=BS, queue_size=1)
    router = Router(publisher.endpoint)
    try:
        with trie._lock:  # the publisher's first snapshot waits for this lock: jobs pile up meanwhile
            trie.attach_events(publisher)
            started = time.monotonic()
            for first in range(1, 200, 20):
                insert(trie, list(range(first, first + 10)))
            assert time.monotonic() - started < 5.0
        assert publisher.stats()["kv_events_dropped_jobs"] >= 8
        router.wait_connected(publisher)
        assert router.device == resident_blocks(trie) and len(router.device) == 20
    finally:
        router.close()
        trie.close()


def test_blocks_evicted_to_redis_are_reported_in_the_shared_tier_and_restores_as_stored(tmp_path):
    server = RedisServer(tmp_path / "redis").start()  # fails, not skips, without Redis
    try:
        spill = RedisTier(server.url, chunk_tokens=2 * BS, secret=b"0123456789abcdef0123")
        namespace = Namespace("synthetic", "float64")
        trie = KVCacheTrie(
            CONFIG, SPECS, namespace, capacity_tokens=64, dtype=torch.float64, device="cpu", spill=spill
        )
        publisher = KVEventPublisher(endpoint(), block_size=BS)
        router = Router(publisher.endpoint)
        trie.attach_events(publisher)
        router.wait_connected(publisher)
        ids = list(range(1, 21))  # 5 blocks; Redis chunks of 8 tokens: 2 complete chunks (4 blocks)
        insert(trie, ids)
        assert spill.flush()
        router.catch_up(publisher)
        seen = len(router.batches)
        assert trie.evict(20) == 20
        router.catch_up(publisher)
        hashes = chain(ids, trie.namespace.key)
        assert router.device == set() and router.shared == set(hashes[:4])
        removed, shared = router.events_since(seen)
        assert sorted(removed["block_hashes"]) == sorted(hashes) and shared["ownership"] == "redis"
        assert shared["block_hashes"] == hashes[:4] and shared["parent_block_hash"] is None

        with trie.match([*ids, 0]) as hit:  # restored from Redis into the device pool
            assert hit.length == 16
        router.catch_up(publisher)
        assert router.device == set(hashes[:4]) == resident_blocks(trie)
        trie.close()
        router.close()
    finally:
        server.stop()


def test_close_stops_the_thread_and_frees_the_addresses():
    trie = synthetic_trie(32)
    publisher = KVEventPublisher(endpoint(), replay_endpoint=endpoint(), block_size=BS)
    trie.attach_events(publisher)
    insert(trie, list(range(1, 9)))
    trie.close()
    assert not publisher._thread.is_alive()
    again = KVEventPublisher(publisher.endpoint, replay_endpoint=publisher.replay_endpoint)
    again.close()


def test_bad_endpoints_and_busy_ports_are_one_clear_error():
    with pytest.raises(ValueError, match="tcp://HOST:PORT or ipc://PATH"):
        KVEventPublisher("http://127.0.0.1:5557")
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        KVEventPublisher("tcp://127.0.0.1:70000")
    busy = KVEventPublisher(endpoint())
    try:
        with pytest.raises(ValueError, match=r"cannot bind .*in use"):
            KVEventPublisher(busy.endpoint)
    finally:
        busy.close()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kv-events-endpoint", "http://127.0.0.1:5557"], "tcp://HOST:PORT or ipc://PATH"),
        (["--kv-events-replay-endpoint", "tcp://127.0.0.1:5558"], "needs --kv-events-endpoint"),
        (["--kv-events-endpoint", "tcp://127.0.0.1:5557", "--kv-event-block-size", "0"], "at least 1"),
        (["--kv-events-endpoint", "tcp://127.0.0.1:5557", "--no-cache"], "drop --no-cache"),
    ],
)
def test_serve_rejects_bad_kv_events_flags_in_one_line(args, message, capsys):
    assert main(["serve", *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and message in err, err


def test_serve_fails_fast_on_a_busy_events_port_and_frees_it_when_the_model_fails(tmp_path, capsys):
    busy = KVEventPublisher(endpoint())
    try:
        assert main(["serve", "--kv-events-endpoint", busy.endpoint]) == 2
        assert "cannot bind" in capsys.readouterr().err
    finally:
        busy.close()
    free = endpoint()
    assert main(["serve", "--kv-events-endpoint", free, "--model", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    KVEventPublisher(free).close()  # the failed start released its address


# ---- real processes: kvblocks replicas behind vllm-router --policy kv_aware ------------------


@pytest.fixture(scope="module")
def kv_fleet(tmp_path_factory):
    """Three replicas (tests/fleet.py) publishing KV events, behind `vllm-router --policy kv_aware`
    subscribed to each one's live and replay sockets; everything on 127.0.0.1."""
    fleet = start_fleet(tmp_path_factory.mktemp("kv-fleet"), 3, ["--capacity", "20000"], kv_events=True)
    try:
        fleet.start_router("vllm", "kv_aware", fleet.kv_event_router_args(MODEL))
        yield fleet
    finally:
        fleet.stop()


def placement_lookups(fleet) -> dict[str, float]:
    """vllm-router's kv_aware index lookups by result (`hit`: some replica holds a prefix of blocks)."""
    prefix = 'vllm_router_kv_placement_lookups_total{result="'
    return {
        line[len(prefix) :].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in fleet.router.metrics().splitlines()
        if line.startswith(prefix)
    }


def test_vllm_router_kv_aware_routes_on_kvblocks_events_to_the_replica_holding_each_prefix(kv_fleet):
    # no cache_salt: vllm-router skips its KV index for salted requests (it cannot hash a salt in)
    tenants = make_tenants(AutoTokenizer.from_pretrained(fleet_model()), 3, 800, salted=False)
    jobs = make_jobs(tenants, 8)
    tokenize_jobs(kv_fleet.replicas[0], jobs)
    started = time.monotonic()
    # 4 at a time: at 8, kv_aware's cost (new prefill tokens against each replica's load) sends 1 to 4
    # of the 21 later requests to an idle replica that lacks their prefix (0.81-1.0 of the ideal).
    sent = drive(kv_fleet.url, jobs, tenants, settle=kv_fleet.settle, concurrency=4)
    kv_fleet.settle()
    o = Outcome.of(sent)
    stats = kv_fleet.stats()
    resident = [s["resident_tokens"] for s in stats]
    print(
        f"vllm-router kv_aware: hit rate {o.hit_rate:.3f}, ideal {o.ideal_rate:.3f} ({o.of_ideal:.3f} of it), "
        f"resident tokens per replica {resident}, {time.monotonic() - started:.1f} s"
    )
    assert not o.errors, o.errors[0].error
    assert o.prompt_tokens == sum(len(j.ids) for j in jobs)
    assert o.of_ideal >= 0.95
    # every later request found its tenant's blocks in the router's index, built from our events
    assert placement_lookups(kv_fleet).get("hit", 0) >= len(jobs) - len(tenants)
    assert all(s["kv_events_dropped_jobs"] == 0 and s["kv_events_subscriptions"] >= 1 for s in stats)
    assert sum(s["kv_events_stored_blocks"] for s in stats) >= len(tenants) * 800 // 16
    exported = [r.metrics() for r in kv_fleet.replicas]  # the same counters on /metrics
    assert [m["kvblocks_kv_events_stored_blocks_total"] for m in exported] == [
        s["kv_events_stored_blocks"] for s in stats
    ]
    # routing kept about one copy of each tenant's prompt (round robin would copy each to all three)
    assert sum(resident) < 2 * len(tenants) * 800


def test_a_flushed_fleet_tells_the_router_and_it_finds_no_prefix_until_the_next_store(kv_fleet):
    tenants = make_tenants(AutoTokenizer.from_pretrained(fleet_model()), 1, 400, salted=False, seed=7)
    first, second = make_jobs(tenants, 2, seed=7)
    assert drive(kv_fleet.url, [first], tenants)[0].error is None
    kv_fleet.settle()
    resyncs = [s["kv_events_resyncs"] for s in kv_fleet.stats()]
    assert httpx.post(f"{kv_fleet.url}/flush_cache", timeout=30.0).status_code == 200  # fanned out
    assert [s["resident_tokens"] for s in kv_fleet.stats()] == [0, 0, 0]
    deadline = time.monotonic() + 10.0  # each replica publishes AllBlocksCleared (a fresh snapshot)
    while any(s["kv_events_resyncs"] == n for s, n in zip(kv_fleet.stats(), resyncs)):
        assert time.monotonic() < deadline, "a replica never published its flush"
        time.sleep(0.05)
    time.sleep(0.2)  # the router polls its SUB sockets every 10 ms
    before = placement_lookups(kv_fleet)
    (again,) = drive(kv_fleet.url, [second], tenants)
    assert again.error is None and again.cached_tokens == 0
    after = placement_lookups(kv_fleet)
    assert after.get("miss", 0) == before.get("miss", 0) + 1 and after.get("hit") == before.get("hit")
