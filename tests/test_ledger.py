"""The tenant ledger: recent work in tokens per tenant, decayed with a half-life, per unit of weight."""

from __future__ import annotations

import threading

import pytest

from kvblocks.engine.ledger import MAX_TENANTS, START_RATE, TenantLedger


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_charges_add_up_and_halve_every_half_life():
    clock = Clock()
    ledger = TenantLedger(half_life_s=2.0, clock=clock)
    ledger.charge("a", 100)
    ledger.charge("a", 60)
    assert ledger.work("a") == pytest.approx(160)
    clock.now = 2.0
    assert ledger.work("a") == pytest.approx(80)
    clock.now = 4.0
    assert ledger.work("a") == pytest.approx(40) and ledger.work("never charged") == 0


def test_usage_is_work_per_unit_of_weight():
    ledger = TenantLedger(lambda tenant: 4.0 if tenant == "gold" else 1.0, clock=Clock())
    ledger.charge("gold", 400)
    ledger.charge("bronze", 200)
    assert ledger.usage("gold") == pytest.approx(100)
    assert ledger.usage("bronze") == pytest.approx(200)


def test_nothing_or_negative_is_no_charge():
    ledger = TenantLedger(clock=Clock())
    ledger.charge("a", 0)
    ledger.charge("a", -50)
    assert ledger.work("a") == 0


def test_charges_from_many_threads_are_all_counted():
    ledger = TenantLedger(half_life_s=1e9)
    threads = [
        threading.Thread(target=lambda: [ledger.charge("a", 1) for _ in range(2000)]) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ledger.work("a") == pytest.approx(8000)


def test_the_ledger_stays_bounded_whatever_tenants_are_named():
    ledger = TenantLedger(clock=Clock())
    for i in range(MAX_TENANTS + 50):
        ledger.charge(f"t{i}", 10 + i)
    assert len(ledger._work) <= MAX_TENANTS
    assert ledger.work(f"t{MAX_TENANTS + 49}") > 0  # the newest, busiest ones are kept


def test_time_is_charged_at_the_engines_recent_rate_of_work():
    ledger = TenantLedger(clock=lambda: 0.0)
    ledger.charge_time("acme", 0.01)
    assert ledger.work("acme") == pytest.approx(0.01 * START_RATE)  # no step timed yet
    for _ in range(200):
        ledger.ran(80, 0.4)  # 200 tokens a second
    ledger.charge_time("beta", 0.5)
    assert ledger.work("beta") == pytest.approx(100, rel=0.01)


def test_the_rate_follows_the_machines_load():
    ledger = TenantLedger()
    for _ in range(200):
        ledger.ran(80, 0.1)
    fast = ledger.tokens_per_second()
    for _ in range(200):
        ledger.ran(80, 0.4)
    assert fast == pytest.approx(800) and ledger.tokens_per_second() == pytest.approx(200, rel=0.05)
