"""``GuardConfig``: how a guard verifies and responds, one frozen object checked once.

``protect()``, ``SDCGuard`` and ``SDCGuardCallback`` take these settings as keyword
arguments (the convenient spelling) or as ``config=GuardConfig(...)`` (one object to
keep, log or share between runs); either way the guard receives one ``GuardConfig``, built
and checked here. Bad values raise where they were given, naming the argument, what was
expected and what was received.

What is not here belongs to one run, not to a configuration: the model, the metrics sink
and snapshot store ``protect()`` takes (the integrations make theirs per run), and the
integrations' own settings (metrics endpoint, snapshot interval, logging).

A config holds references, not copies: a ``sampler`` or ``policy`` given in it is the
same object in every guard made from it, so its state carries over from one guard to the
next, as passing the same sampler to successive ``protect()`` blocks does. ``None`` (the
default) gives each guard a fresh ``Full()`` / ``Policy()``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ...core.precision import check_e_max, check_screen
from ...respond.events import check_events
from ...respond.policy import Policy
from .calibration import DEFAULT_EVERY, check_calibrate_every
from .checks import check_backend
from ..sampling import Sampler, check_sampler


@dataclass(frozen=True)
class GuardConfig:
    """The settings ``protect()``, ``SDCGuard`` and ``SDCGuardCallback`` share, each
    documented at its field (and in docs/CONFIGURATION.md)."""

    #: which GEMMs to verify (``sdc_guard.runtime.sampling``); ``None``: a fresh ``Full()``
    #: per guard
    sampler: Sampler | None = None
    #: threshold coefficient override in (0, 1], as in ``verify_matmul``; ``None``: per dtype
    e_max: float | None = None
    #: force a verification backend, as in ``verify_matmul``; ``None``:
    #: ``$SDC_GUARD_BACKEND``, else the best available
    backend: str | None = None
    #: how to respond to a detection; ``None``: a fresh ``Policy()`` per guard (recompute,
    #: then roll back, then exit)
    policy: Policy | None = None
    #: step reports and outcomes a guard keeps
    history: int = 100
    #: bound of the weight-side cache (0 disables it)
    cache_bytes: int = 512 << 20
    #: record the screen's D/T per site over the run in ``guard.screen_stats``
    #: (``sdc_guard.runtime.lifecycle.stats``: how far the threshold sits from this model's data)
    stats: bool = False
    #: the screen's threshold, ``"default"`` or ``"tight"`` (``sdc_guard.core.precision.SCREENS``:
    #: the tight one sees smaller errors and suspects more clean products, each cleared exactly)
    screen: str = "default"
    #: the route: ``True`` checks the GEMMs of compiled code by nodes put into its graphs
    #: (docs/COMPILE.md), ``False`` uses the dispatch mode (frames dynamo has not compiled
    #: then run eagerly), ``None`` is ``True`` when the model or one of its modules is
    #: compiled and otherwise switches to ``True`` when dynamo is about to compile a frame
    #: inside the block (a ``torch.compile(model)`` wrapper, a compiled training step)
    compiled: bool | None = None
    #: ``optimizer_step`` measures what interception really costs by running a watched
    #: step's closure once more with interception off, its effects undone, on the watched
    #: steps numbered 1, 2, 4, 8 and 16 and then every ``calibrate_every``-th (about 1 % of
    #: their time; ``sdc_guard.runtime.lifecycle.calibration``), so that
    #: ``StepReport.overhead`` is the guard's whole cost; ``None`` never replays (the
    #: reported interception then stays an estimate)
    calibrate_every: int | None = DEFAULT_EVERY
    #: where a JSON line goes for each detection, response and exit: a path, ``"-"`` for
    #: standard error, a text stream or a callable; ``None``: ``$SDC_GUARD_EVENTS``, else
    #: none (``sdc_guard.respond.events``, docs/OPERATIONS.md)
    events: Any = None
    #: with ``torch.distributed`` initialised, check the all-reduces, all-gathers and
    #: reduce-scatters of each watched step, what each rank received against what was sent
    #: (docs/DISTRIBUTED.md, "Collectives"; with a sampler that watches the same steps on
    #: every rank)
    collectives: bool = True

    def __post_init__(self) -> None:
        if self.sampler is not None:
            check_sampler(self.sampler)
        if self.e_max is not None:
            check_e_max(self.e_max)
        check_backend(self.backend)  # the model's devices and dtypes: when a guard starts
        if self.policy is not None and not isinstance(self.policy, Policy):
            raise TypeError(f"policy: expected a sdc_guard.Policy or None, got {type(self.policy).__name__} "
                            f"{self.policy!r}")
        if isinstance(self.history, bool) or not isinstance(self.history, int) or self.history < 1:
            raise ValueError(f"history: expected a positive int, got {self.history!r}")
        if isinstance(self.cache_bytes, bool) or not isinstance(self.cache_bytes, int) or self.cache_bytes < 0:
            raise ValueError(f"cache_bytes: expected a non-negative int (bytes; 0 disables the cache), "
                             f"got {self.cache_bytes!r}")
        if not isinstance(self.stats, bool):
            raise TypeError(f"stats: expected a bool, got {type(self.stats).__name__} {self.stats!r}")
        check_screen(self.screen)
        if self.compiled is not None and not isinstance(self.compiled, bool):
            raise TypeError(f"compiled: expected a bool or None (None: True when the model or one of its "
                            f"modules is compiled), got {type(self.compiled).__name__} {self.compiled!r}")
        check_calibrate_every(self.calibrate_every)
        check_events(self.events)
        if not isinstance(self.collectives, bool):
            raise TypeError(f"collectives: expected a bool (check the collectives of each step under "
                            f"torch.distributed), got {type(self.collectives).__name__} {self.collectives!r}")

    @classmethod
    def of(cls, config: GuardConfig | None = None, **options: Any) -> GuardConfig:
        """The config an entry point was given: ``config``, or one made of its keyword
        arguments ``options`` (the fields of ``GuardConfig``; unknown names raise
        ``TypeError``). Both at once raises ``TypeError`` naming each keyword whose value
        is not its default, since it would silently lose to, or silently override, the
        config: change a config with ``dataclasses.replace(config, name=value)``.

        >>> GuardConfig.of(screen="tight").screen
        'tight'
        >>> GuardConfig.of(GuardConfig(), stats=True)
        Traceback (most recent call last):
        ...
        TypeError: config: expected either config= or keyword arguments, got both (stats=True); use dataclasses.replace(config, stats=...)
        """
        unknown = sorted(set(options) - set(FIELDS))
        if unknown:
            raise TypeError(f"unexpected keyword argument {unknown[0]!r} (GuardConfig's fields: {', '.join(FIELDS)})")
        if config is None:
            return cls(**options)
        if not isinstance(config, GuardConfig):
            raise TypeError(f"config: expected a sdc_guard.GuardConfig or None, got {type(config).__name__} "
                            f"{config!r}")
        given = [name for name, value in options.items() if not _is_default(name, value)]
        if given:
            raise TypeError(f"config: expected either config= or keyword arguments, got both "
                            f"({', '.join(f'{n}={options[n]!r}' for n in given)}); use "
                            f"dataclasses.replace(config, {', '.join(f'{n}=...' for n in given)})")
        return config


#: the settings, in their order (each is a keyword argument of every entry point)
FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(GuardConfig))
_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(GuardConfig)}


def _is_default(name: str, value: Any) -> bool:
    default = _DEFAULTS[name]
    return value is default or (type(value) is type(default) and value == default)
