"""The guard's on/off state (``runtime/lifecycle/switch.py``): one ``Switch``, walked by
``ModeSwitch``, with the dispatch mode entered exactly in ``ON``."""

from __future__ import annotations

import pytest
import torch

import sdc_guard


def test_the_guards_on_off_state_is_one_switch() -> None:
    """``Guard.switch`` walks OFF -> ON -> PAUSED (a GEMM-free optimizer step, the second
    time the optimizer steps) -> ON -> BARE (a bare run) -> ON -> OFF, and IDLE on a step
    the sampler does not watch; the dispatch mode is entered exactly in ON."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from sdc_guard.runtime.lifecycle.switch import Switch
    from sdc_guard.runtime.sampling import EveryN

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = sdc_guard.protect(model)
    assert guard.switch is Switch.OFF and not guard.active
    seen: list[tuple[Switch, bool]] = []
    with guard:  # the guard's optimizer-step hooks come first: this one sees what they did
        handle = register_optimizer_step_pre_hook(lambda *_: seen.append((guard.switch, guard.intercepting)))
        try:
            for _ in range(2):
                seen.append((guard.switch, guard.intercepting))
                model(torch.randn(2, 4)).sum().backward()
                opt.step()
                guard.step()
        finally:
            handle.remove()
        assert guard.switch is Switch.ON and guard.intercepting
        with guard.mode.bare_run():
            assert guard.switch is Switch.BARE and not guard.intercepting
            assert not guard.mode.pause()  # no pause inside a bare run
        assert guard.switch is Switch.ON and guard.intercepting
    assert guard.switch is Switch.OFF and not guard.intercepting
    # at each step's start and at its optimizer step: the first optimizer step is learned
    # (intercepted, no GEMM seen), the second steps paused
    assert seen == [(Switch.ON, True), (Switch.ON, True), (Switch.ON, True), (Switch.PAUSED, False)]
    with pytest.raises(RuntimeError, match="bare_run\\(\\): interception is off, not on"):
        with guard.mode.bare_run():
            pass
    with sdc_guard.protect(model, sampler=EveryN(2)) as every:
        states = []
        for _ in range(3):
            states.append((every.switch, every.intercepting))
            every.step()
    assert states == [(Switch.ON, True), (Switch.IDLE, False), (Switch.ON, True)]
