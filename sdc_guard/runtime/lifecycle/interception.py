"""A guard's interception on its thread: which modes are on, and the switch between the
two routes (docs/COMPILE.md, "The two routes, and how the guard picks").

- The dispatch route: the dispatch mode (``intercept.GemmInterceptor``) verifies every aten
  op of eager code, with the function mode on beside it as the block's mark for dynamo
  (unless ``compiled=False``), so that compiled code met in the block compiles apart from
  the same code outside it.
- The compiled route: the function mode (``function_mode.GemmFunctionMode``) checks the
  eager frames' GEMMs; the graph pass (``graph_install``) puts the checks into the graphs
  compiled meanwhile; the guard is this thread's sink of the check ops
  (``graph_checks.set_sink``).

The guard drives: it says when interception is wanted (active, watched, not paused), and
``Interception`` enters and leaves the modes that route needs. Mode stacks are last-in
first-out: if another mode was entered above one of ours (a profiler inside
``protect()``), an unwatched step keeps ours in place rather than pop the wrong one, and
the guard ignores what it sees.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...core.torch_private import dispatch_stack_depth, get_current_dispatch_mode, get_current_function_mode
from ..compiled import graph_install
from ..compiled.function_mode import GemmFunctionMode, set_sink
from ..dispatch.intercept import GemmInterceptor, autograd_sequence_number

if TYPE_CHECKING:
    from .guard import Guard


class Interception:
    """The modes of one guard (see the module doc). ``mode`` is the dispatch mode while it
    is entered, ``function_mode`` the function mode."""

    def __init__(self, guard: "Guard") -> None:
        self.guard = guard
        self.mode: GemmInterceptor | None = None
        #: this activation's dispatch mode, entered again after a pause (a GEMM-free
        #: optimizer step, a calibration replay) so that its per-op caches stay warm
        self.interceptor: GemmInterceptor | None = None
        self.function_mode: GemmFunctionMode | None = None
        #: the dispatch mode was retired in the open step by a switch to the compiled route
        #: (``retire``): it stays on, for the backward of what it verified, until the step closes
        self.retiring = False
        #: calls the compiled route's function modes counted and left since the last
        #: ``take_function_calls`` (``GemmFunctionMode.calls``)
        self._function_calls = 0
        self._previous_sink: Any = None  #: the sink before ours (nested guards)
        self._sink_set = False
        self._pass_installed = False

    @property
    def on(self) -> bool:
        """Whether interception is on now: the dispatch mode, or the compiled route's
        function mode."""
        return self.mode is not None or (self.function_mode is not None and self.function_mode.compiled)

    @property
    def sole_dispatch_mode(self) -> bool:
        """Whether the dispatch mode is on and the only dispatch mode of the thread: then
        leaving it and entering it again around a bare run (a calibration replay) leaves
        no other mode that would see both runs."""
        return (self.mode is not None and dispatch_stack_depth() == 1
                and get_current_dispatch_mode() is self.mode)

    def sync(self, wanted: bool) -> int:
        """Enter the modes the guard's route needs when ``wanted``, leave them otherwise;
        returns the ops the dispatch mode counted, if it was left."""
        g = self.guard
        ops = 0
        want_dispatch = wanted and (not g.compiled or self.retiring)
        want_function = wanted and (g.compiled or g.compiled_argument is None)
        if want_dispatch and self.mode is None:
            if self.interceptor is None:
                self.interceptor = GemmInterceptor(g, g.site_tracker)
            self.mode = self.interceptor
            self.mode.__enter__()
        elif not want_dispatch and self.mode is not None and (
                not g.active or self.mode is get_current_dispatch_mode()):
            self.mode.__exit__(None, None, None)
            ops, self.mode.ops = self.mode.ops, 0
            self.mode.retire(None)
            self.mode = None
        if want_function and self.function_mode is None:
            self.function_mode = GemmFunctionMode(compiled=g.compiled)
            self.function_mode.__enter__()
        elif not want_function and self.function_mode is not None and (
                not g.active or self.function_mode is get_current_function_mode()):
            self.function_mode.__exit__(None, None, None)
            self._function_calls += self.function_mode.calls
            self.function_mode = None
        self._sync_sink(want_function and g.compiled)
        return ops

    def _sync_sink(self, wanted: bool) -> None:
        """Be this thread's sink of the check ops while the compiled route's function mode
        is on; keep the graph pass installed for the whole activation on that route."""
        g = self.guard
        if wanted and not self._sink_set:
            self._previous_sink = set_sink(g)
            self._sink_set = True
        elif not wanted and self._sink_set:
            set_sink(self._previous_sink)
            self._previous_sink = None
            self._sink_set = False
        if g.active and g.compiled and not self._pass_installed:
            graph_install.install()
            self._pass_installed = True
        elif not g.active and self._pass_installed:
            graph_install.uninstall()
            self._pass_installed = False

    def to_compiled(self) -> None:
        """The guard has switched to the compiled route (``Guard.compiled_code_met``): the
        site tracker's module hooks go (dynamo guards on module hooks: a frame compiled with
        them would recompile once they are gone), the dispatch mode retires (only the
        backward of the autograd nodes made before now is still its), the function mode
        checks eager frames from here on."""
        self.guard.site_tracker.stop()
        if self.mode is not None:
            self.mode.retire(autograd_sequence_number())
            self.retiring = True
        if self.function_mode is not None:
            self.function_mode.compiled = True

    @property
    def pending_ops(self) -> int:
        """The ops the dispatch mode has counted and not yet handed over (``take_ops``)."""
        return self.mode.ops if self.mode is not None else 0

    def take_ops(self) -> int:
        """The ops the dispatch mode counted so far (the count starts again)."""
        if self.mode is None:
            return 0
        ops, self.mode.ops = self.mode.ops, 0
        return ops

    def take_function_calls(self) -> int:
        """The calls the compiled route's function mode passed on so far, each a Python
        round trip no check times (the count starts again)."""
        calls = self._function_calls
        if self.function_mode is not None:
            calls, self.function_mode.calls = calls + self.function_mode.calls, 0
        self._function_calls = 0
        return calls
