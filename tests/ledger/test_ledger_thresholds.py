"""Warnings fire exactly once per account, period and threshold on every path a plain
charge can take (on Redis the compact op ``c``, which reads a threshold's flag only once
usage reaches its level), against both backends."""

from __future__ import annotations

import pytest
import ratequeue as rq
from ledger_backends import Factory
from ratequeue.ledger import Plan


def fired(led) -> list[tuple[str, float, int]]:
    return sorted((n.unit, n.threshold, n.used) for n in led.pending_notices())


def test_one_charge_crossing_two_thresholds_fires_both_once(
    make: Factory, clock: rq.ManualClock
) -> None:
    led = make(clock)
    led.set_plan("acme", Plan("p", tokens=1000, calls=100, thresholds=[0.5, 0.8, 0.95]))
    led.charge("a", "acme", input_tokens=10)  # the period is made
    led.charge("b", "acme", input_tokens=850)
    assert fired(led) == [("tokens", 0.5, 860), ("tokens", 0.8, 860)]
    led.charge("c", "acme", input_tokens=10)
    led.charge("c", "acme", input_tokens=10)  # a replay fires nothing
    assert fired(led) == [("tokens", 0.5, 860), ("tokens", 0.8, 860)]
    led.charge("d", "acme", input_tokens=100)
    assert fired(led)[-1] == ("tokens", 0.95, 970)
    assert len(fired(led)) == 3


def test_a_threshold_already_passed_under_a_new_plan_fires_on_the_next_charge(
    make: Factory, clock: rq.ManualClock
) -> None:
    """Usage 450 of 1000 is below 80 %; the plan becomes 500, so 80 % (400) lies below the
    usage: the next charge fires it once, though that charge crosses no level itself."""
    led = make(clock)
    led.set_plan("acme", Plan("p", tokens=1000))
    led.charge("a", "acme", input_tokens=10)
    led.charge("b", "acme", input_tokens=440)
    assert fired(led) == []
    led.set_plan("acme", Plan("p2", tokens=500))
    led.charge("c", "acme", input_tokens=1)
    assert fired(led) == [("tokens", 0.8, 451)]
    led.charge("d", "acme", input_tokens=1)
    assert fired(led) == [("tokens", 0.8, 451)]


def test_a_threshold_fires_again_only_in_the_next_period_after_a_reset(
    make: Factory, clock: rq.ManualClock
) -> None:
    led = make(clock)
    led.set_plan("acme", Plan("p", tokens=100, thresholds=[0.5]))
    led.charge("a", "acme", input_tokens=10)
    led.charge("b", "acme", input_tokens=50)
    led.compensate("reset", ["acme"], bonus=0)  # usage back to 0, the warning was given
    led.charge("c", "acme", input_tokens=60)
    assert fired(led) == [("tokens", 0.5, 60)]


def test_a_charge_paid_partly_from_the_bonus_fires_and_spends_it(
    make: Factory, clock: rq.ManualClock
) -> None:
    led = make(clock)
    led.set_plan("acme", Plan("p", tokens=100, thresholds=[0.9]))
    led.charge("a", "acme", input_tokens=10)
    led.compensate("gift", ["acme"], reset_usage=False, bonus=0.5)
    c = led.charge("b", "acme", input_tokens=120)
    assert not c.replay
    b = led.balance("acme")
    assert b.used == {"tokens": 100} and b.bonus == {"tokens": 20}
    assert fired(led) == [("tokens", 0.9, 100)]
    assert led.charge("b", "acme", input_tokens=120).replay
    with pytest.raises(rq.QuotaExceeded):
        led.charge("c", "acme", input_tokens=21)
    assert led.balance("acme").bonus == {"tokens": 20}
