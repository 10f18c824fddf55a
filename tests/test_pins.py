"""PrefixPins: `cache_control` pins bounded per tenant by its weighted share of the pin cap."""

from __future__ import annotations

import asyncio

from test_trie import synthetic_past, synthetic_trie

from kvblocks.server.pins import PrefixPins, _Pin, held


def trie_with(prefixes: dict[str, list[list[int]]], cap: int):
    """A trie holding each salt's sequences, with `cap` pinned tokens at most."""
    trie = synthetic_trie(4096, max_pinned_tokens=cap)
    for salt, sequences in prefixes.items():
        for ids in sequences:
            trie.insert(ids, synthetic_past(ids, salt), salt=salt)
    return trie


def seq(first: int, n: int) -> list[int]:
    return [(first * 7 + i) % 16 for i in range(n)]


def test_held_counts_a_prefix_two_pins_share_once_and_namespaces_apart():
    pins = [_Pin((1, 2, 3, 4), "a", None), _Pin((1, 2, 9), "a", None), _Pin((1, 2), "a", None)]
    assert held(pins) == 5  # 1 2 3 4 and 9
    assert held([*pins, _Pin((1, 2, 3), "b", None)]) == 8


def test_one_tenant_pinning_all_it_can_never_refuses_another_tenant_within_its_share():
    async def main():
        a = [seq(i, 40) for i in range(1, 6)]
        b = [seq(9, 40)]
        trie = trie_with({"a": a, "b": b}, cap=120)
        pins = PrefixPins(trie, {"a": 1.0, "b": 1.0, "c": 1.0})
        assert pins.share("a") == 40
        assert pins.keep(a[0], "a", "a", 60) == 40
        assert [pins.keep(ids, "a", "a", 60) for ids in a[1:]] == [0, 0, 0, 0]
        assert pins.refused["a"] == 4 and pins.pinned("a") == 40
        assert trie.pinned_tokens == 40, "a refused pin is undone"
        assert pins.keep(b[0], "b", "b", 60) == 40
        assert pins.pinned_by_tenant() == {"a": 40, "b": 40}

    asyncio.run(main())


def test_a_tenants_share_follows_its_weight():
    async def main():
        heavy = [seq(i, 30) for i in range(1, 4)]
        trie = trie_with({"heavy": heavy}, cap=120)
        pins = PrefixPins(trie, {"heavy": 3.0, "light": 1.0})
        assert (pins.share("heavy"), pins.share("light")) == (90, 30)
        assert [pins.keep(ids, "heavy", "heavy", 60) for ids in heavy] == [30, 30, 30]

    asyncio.run(main())


def test_an_open_server_has_one_tenant_with_the_whole_cap():
    async def main():
        trie = trie_with({"": [seq(1, 50)]}, cap=50)
        pins = PrefixPins(trie)
        assert pins.share("") == 50 and pins.keep(seq(1, 50), "", "", 60) == 50

    asyncio.run(main())


def test_a_repeated_hint_is_not_charged_twice_and_a_pin_ends_with_its_ttl():
    async def main():
        ids = seq(1, 30)
        trie = trie_with({"a": [ids]}, cap=60)
        pins = PrefixPins(trie, {"a": 1.0, "b": 1.0})
        assert pins.keep(ids, "a", "a", 0.2) == 30
        assert pins.keep(ids, "a", "a", 0.2) == 30
        assert pins.pinned("a") == 30 and trie.pinned_tokens == 30
        await asyncio.sleep(0.4)
        assert pins.pinned("a") == 0 and trie.pinned_tokens == 0

    asyncio.run(main())
