"""``GuardConfig``: one frozen set of settings that ``protect()``, ``Guard``, ``SDCGuard`` and
``SDCGuardCallback`` all take, as keywords or as ``config=``, checked in one place."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

import pytest
import torch


import sdc_guard  # noqa: E402
from models import MLP  # noqa: E402
from sdc_guard import GuardConfig, Policy  # noqa: E402
from sdc_guard.integrations.guarded_training import GuardedTraining  # noqa: E402
from sdc_guard.runtime.lifecycle.config import FIELDS  # noqa: E402
from sdc_guard.runtime.lifecycle.guard import Guard  # noqa: E402
from sdc_guard.runtime.sampling import EveryN  # noqa: E402

#: what each entry point takes besides the config's fields and ``config`` itself
OWN = {
    "protect": {"model", "metrics", "snapshots"},
    "integration": {"snapshot_every", "checkpoint_dir", "verify_validation", "metrics_port", "metrics_address",
                    "pushgateway", "log_every_n_steps"},
}

#: one bad value per field: (field, value, exception, text of the received value)
BAD: list[tuple[str, Any, type, str]] = [
    ("sampler", "Full", TypeError, "'Full'"),
    ("e_max", 0, ValueError, "got 0"),
    ("backend", "nope", ValueError, "'nope'"),
    ("policy", "exit", TypeError, "'exit'"),
    ("history", 0, ValueError, "0"),
    ("cache_bytes", -1, ValueError, "-1"),
    ("stats", "yes", TypeError, "'yes'"),
    ("screen", "loose", ValueError, "'loose'"),
    ("compiled", "yes", TypeError, "'yes'"),
    ("calibrate_every", 0, ValueError, "0"),
    ("events", 5, TypeError, "5"),
    ("collectives", "yes", TypeError, "'yes'"),
]


def keywords(function: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    return {name: p for name, p in inspect.signature(function).parameters.items()
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and name != "self"}


def check_signature(function: Callable[..., Any], own: set[str]) -> None:
    """``function`` takes every field of the config by keyword, with the config's
    default, plus ``config`` and exactly ``own``."""
    params = keywords(function)
    defaults = {f.name: f.default for f in dataclasses.fields(GuardConfig)}
    assert set(params) == set(FIELDS) | {"config"} | own, set(params) ^ (set(FIELDS) | {"config"} | own)
    for name in FIELDS:
        assert params[name].default == defaults[name], (function, name)
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, (function, name)
    assert params["config"].default is None


def test_every_field_is_checked() -> None:
    """The table below covers every field: a field added without a check fails here."""
    assert [row[0] for row in BAD] == list(FIELDS)


def test_protect_takes_exactly_the_config_fields() -> None:
    check_signature(sdc_guard.protect, OWN["protect"])


def error_of(call: Callable[[], Any]) -> tuple[type, str]:
    with pytest.raises((TypeError, ValueError)) as info:
        call()
    return type(info.value), str(info.value)


@pytest.mark.parametrize("field, value, exception, received", BAD, ids=[row[0] for row in BAD])
def test_a_bad_value_is_the_same_error_everywhere(field: str, value: Any, exception: type, received: str) -> None:
    """GuardConfig, protect(), Guard and the integrations' shared base raise the same
    error, naming the argument, what was expected and what was received."""
    expected = error_of(lambda: GuardConfig(**{field: value}))
    assert expected[0] is exception and expected[1].startswith(f"{field}: expected "), expected
    assert received in expected[1].split("expected", 1)[1], expected
    assert error_of(lambda: sdc_guard.protect(MLP(), **{field: value})) == expected
    assert error_of(lambda: Guard(MLP(), **{field: value})) == expected
    assert error_of(lambda: GuardedTraining(**{field: value})) == expected
    good = GuardConfig()
    assert error_of(lambda: dataclasses.replace(good, **{field: value})) == expected


def test_the_config_is_frozen() -> None:
    config = GuardConfig(screen="tight")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.screen = "default"  # type: ignore[misc]
    assert config.screen == "tight"
    assert dataclasses.replace(config, stats=True).stats and not config.stats


def test_config_and_keywords_at_once_is_an_error() -> None:
    config = GuardConfig(history=3)
    with pytest.raises(TypeError, match=r"^config: expected either config= or keyword arguments, got both "
                                        r"\(stats=True\)"):
        sdc_guard.protect(MLP(), config=config, stats=True)
    # a keyword left at its default is not a second setting
    assert sdc_guard.protect(MLP(), config=config, stats=False).config is config
    with pytest.raises(TypeError, match="config: expected a sdc_guard.GuardConfig or None, got dict"):
        sdc_guard.protect(MLP(), config={"history": 3})
    with pytest.raises(TypeError, match="unexpected keyword argument 'histroy'"):
        Guard(MLP(), histroy=3)


def step(net: torch.nn.Module, guard: Guard) -> None:
    torch.manual_seed(0)
    with guard:
        net(torch.randn(4, 16)).sum().backward()


def test_a_config_is_reusable() -> None:
    """One config makes guards for two models and a Lightning-free integration base, each
    with the config's settings; each guard gets its own default policy; the config is
    unchanged; a sampler given in it is the same object in every guard."""
    sampler = EveryN(2)
    config = GuardConfig(sampler=sampler, screen="tight", stats=True, history=1)
    nets = [MLP(), MLP()]
    guards = [sdc_guard.protect(net, config=config) for net in nets]
    for net, guard in zip(nets, guards):
        step(net, guard)
        step(net, guard)  # step 1: EveryN(2) does not watch it
        assert guard.config is config and guard.screen == "tight" and guard.screen_stats is not None
        assert guard.sampler is sampler and len(guard.reports) == 1  # history=1 keeps the last
        assert guard.last_report.step == 1 and guard.last_report.seen == 0
    assert guards[0].policy is not guards[1].policy and isinstance(guards[0].policy, Policy)
    run = GuardedTraining(config=config, metrics_port=None)
    assert run.config.screen == "tight" and run.sampler is sampler and run.config.policy is run.policy
    guard = run.start_guard(MLP(), rank=0, trainer_step=0)
    assert guard.config is run.config and guard.policy is run.policy
    assert config == GuardConfig(sampler=sampler, screen="tight", stats=True, history=1)


@pytest.mark.slow  # imports Lightning and transformers (seconds): see CONTRIBUTING.md
def test_the_integrations_take_the_same_arguments_and_errors() -> None:
    from sdc_guard.integrations.lightning import SDCGuard
    from sdc_guard.integrations.transformers import SDCGuardCallback

    for cls in (SDCGuard, SDCGuardCallback):
        check_signature(cls.__init__, OWN["integration"])
        for field, value, _, _ in BAD:
            assert error_of(lambda: cls(**{field: value})) == error_of(lambda: GuardConfig(**{field: value}))
        config = GuardConfig(screen="tight", calibrate_every=None)
        callback = cls(config=config, metrics_port=None)
        assert callback.config.screen == "tight" and callback.config.calibrate_every is None
        by_keywords = cls(screen="tight", calibrate_every=None, metrics_port=None).config
        assert dataclasses.replace(by_keywords, sampler=None, policy=None) == config
