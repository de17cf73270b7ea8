"""``intercept.extra_call_seconds``: what a context adds to a call, measured with the two
sides taken in turn, so that a slow spell of the machine does not land on one side only."""

import contextlib

import pytest

from sdc_guard.runtime.dispatch import intercept


class Machine:
    """A clock that a call advances by its cost, three times slower for the first
    ``slow_calls`` calls (a VM's slow spell), the context adding ``extra`` a call."""

    def __init__(self, base: float, extra: float, slow_calls: int) -> None:
        self.now, self.base, self.extra, self.slow_calls = 0.0, base, extra, slow_calls
        self.calls, self.inside = 0, False

    def clock(self) -> float:
        return self.now

    def call(self) -> None:
        speed = 3.0 if self.calls < self.slow_calls else 1.0
        self.now += speed * (self.base + (self.extra if self.inside else 0.0))
        self.calls += 1

    @contextlib.contextmanager
    def context(self):
        self.inside = True
        try:
            yield
        finally:
            self.inside = False


@pytest.mark.parametrize("slow_calls", [0, 500, 1200])
def test_a_slow_spell_does_not_land_on_one_side(monkeypatch: pytest.MonkeyPatch, slow_calls: int) -> None:
    machine = Machine(base=4e-6, extra=2.5e-6, slow_calls=slow_calls)
    monkeypatch.setattr(intercept.time, "perf_counter", machine.clock)
    extra = intercept.extra_call_seconds(machine.call, machine.context, blocks=15, reps=40)
    # each round's two sides ran at one speed: the context's cost at that speed, 1x or 3x
    assert machine.calls == 15 * 2 * 40
    assert 2.5e-6 * (1 - 1e-9) <= extra <= 3 * 2.5e-6 * (1 + 1e-9)
    if slow_calls in (0, 1200):  # one speed throughout
        assert extra == pytest.approx(2.5e-6 * (3.0 if slow_calls else 1.0))
    # all bare calls first, then all calls inside, as measured before: 600 slow bare calls
    # against 600 fast ones inside would have come out at 0
    sequential = Machine(base=4e-6, extra=2.5e-6, slow_calls=600)
    monkeypatch.setattr(intercept.time, "perf_counter", sequential.clock)
    bare = intercept.median_call_seconds(sequential.call, 600)
    with sequential.context():
        inside = intercept.median_call_seconds(sequential.call, 600)
    assert inside - bare < 0


def test_the_measured_rates_are_positive_and_measured_once() -> None:
    assert intercept.round_trip_seconds() > 0 and intercept.module_hook_seconds() > 0
    assert intercept.round_trip_seconds() == intercept.round_trip_seconds()
