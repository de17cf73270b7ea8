"""``Switch``: the guard's on/off state, one explicit value instead of flags, and
``ModeSwitch``, which owns it and keeps the interception in step with it.

Kept apart from ``guard.py`` because it is what a reader of any transition looks up
first: which states exist, which methods move between them, and what each state has on.
"""

from __future__ import annotations

import contextlib
import enum
from typing import TYPE_CHECKING, Iterator

from .interception import Interception
from .optimizer_steps import OptimizerSteps

if TYPE_CHECKING:
    from .guard import Guard


class Switch(enum.Enum):
    """The guard's on/off state: whether its interception is on, one value at a time.

    Transitions (all in ``ModeSwitch``; others ask through its public methods)::

        OFF --activate--> ON (the open step watched) or IDLE (unwatched)
        IDLE/ON --begin_step--> ON or IDLE, as the sampler watches the new step
        ON --pause--> PAUSED --resume--> ON      (a GEMM-free optimizer step, optimizer_steps.py)
        ON --bare_run--> BARE --(end)--> ON      (a calibration replay's bare run, calibration.py)
        any --deactivate--> OFF

    Only ``ON`` has the route's modes entered. Whether the step is watched is the
    sampler's verdict on the step (``Guard.watching``), kept with the step, not here.
    """

    OFF = "off"  #: not active (outside ``activate`` / ``deactivate``)
    IDLE = "idle"  #: active, the step unwatched: nothing entered, nothing paid
    ON = "on"  #: active, the step watched: the route's modes entered
    PAUSED = "paused"  #: ``ON`` suspended across an optimizer step known to run no GEMM
    BARE = "bare"  #: ``ON`` suspended for a calibration replay's bare run


class ModeSwitch:
    """The guard's ``Switch`` and what follows from it, kept in step in one place: the
    route's modes (``Interception``) are entered exactly in ``ON``; the optimizer-step
    hooks (``OptimizerSteps``) are installed exactly while active and watching (``ON``,
    ``PAUSED``, ``BARE``). Every transition goes through ``_apply``.

    The guard drives the step transitions (``activate``, ``deactivate``, ``step_opened``,
    ``to_compiled``); the optimizer-step hooks ask for ``pause`` / ``resume`` and a
    calibration replay for ``bare_run``. The aten ops a mode counted when it is left go to
    the open step's ledger (``Guard.ledger``)."""

    def __init__(self, guard: "Guard") -> None:
        self._guard = guard
        self._state = Switch.OFF
        #: the modes on the guard's thread
        self.interception = Interception(guard)
        #: the hooks around optimizer steps (pause across GEMM-free ones, re-encode after)
        self.optimizers = OptimizerSteps(guard)

    @property
    def state(self) -> Switch:
        """The on/off state."""
        return self._state

    @property
    def replayable(self) -> bool:
        """Whether the open step's closure can run once bare for a calibration replay
        (``sdc_guard.runtime.lifecycle.calibration``): the route switches all its checks off while
        ``bare_run`` lasts and on again after, and no other mode
        would see both runs. The dispatch route, with its mode the only one on the thread;
        the compiled route not (yet): its graphs are traced with the function mode, and
        leaving it would compile them again without their checks."""
        return not self._guard.compiled and self.interception.sole_dispatch_mode

    def _apply(self, state: Switch) -> None:
        self._state = state
        if state in (Switch.ON, Switch.PAUSED, Switch.BARE):  # active and watching
            self.optimizers.install()
        else:  # an unwatched step needs neither the pause nor the re-encoding after it
            self.optimizers.remove()
        self._guard.ledger.ops += self.interception.sync(state is Switch.ON)

    def activate(self, watching: bool) -> None:
        """``OFF`` -> ``ON`` (the open step watched) or ``IDLE``."""
        if self._state is not Switch.OFF:
            raise RuntimeError("this Guard is already active")
        self._apply(Switch.ON if watching else Switch.IDLE)

    def deactivate(self) -> None:
        """any -> ``OFF``."""
        self._apply(Switch.OFF)
        self.interception.interceptor = None  # the next activation builds its own (handlers added since)

    def step_opened(self, watching: bool) -> None:
        """A step opened: ``ON`` or ``IDLE`` as the sampler watches it (``OFF`` stays)."""
        if self._state is Switch.OFF:
            self._apply(Switch.OFF)
        else:
            self._apply(Switch.ON if watching else Switch.IDLE)

    def to_compiled(self) -> None:
        """The guard switched to the compiled route: the modes that route needs."""
        self.interception.to_compiled()
        self._apply(self._state)

    def pause(self) -> bool:
        """``ON`` -> ``PAUSED``: leave the modes across an optimizer step known to run no
        GEMM (``optimizer_steps.py``). Returns whether it paused (not when the
        interception was not on: unwatched, or a bare run under way)."""
        if self._state is not Switch.ON:
            return False
        self._apply(Switch.PAUSED)
        return True

    def resume(self) -> None:
        """``PAUSED`` -> ``ON`` (a no-op in any other state: a step or a deactivation
        since the pause has set the state already)."""
        if self._state is Switch.PAUSED:
            self._apply(Switch.ON)

    @contextlib.contextmanager
    def bare_run(self) -> Iterator[None]:
        """``ON`` -> ``BARE`` -> ``ON``: interception fully off (no mode, no module hooks)
        for a calibration replay's bare run of the step (``calibration.py``)."""
        if self._state is not Switch.ON:
            raise RuntimeError(f"bare_run(): interception is {self._state.value}, not on")
        guard = self._guard
        guard.site_tracker.stop()
        self._apply(Switch.BARE)
        try:
            yield
        finally:
            if guard.watching and not guard.compiled:
                guard.site_tracker.start()
            self._apply(Switch.ON if self._state is Switch.BARE else self._state)
