"""Configuration (``core/config.py``): the default deadlines and policy, names turned into their
members, frozen values, ``dataclasses.replace`` checking what it changes, the flush retry
interval bounded by the flush deadline it is given with, the bounds a value may reach, and the
messages of the common bad values (every bad value of every field is in
``tests/system/test_bad_values.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from rollout_lifecycle.contract.exceptions import InvalidArgument
from rollout_lifecycle.contract.values import MAX_SECONDS, PauseMode, Tag
from rollout_lifecycle.core.config import (
    MAX_TIMELINE_CALLS,
    DeadEnginePolicy,
    Deadlines,
    LifecycleConfig,
)

DEADLINE_FIELDS = [f.name for f in dataclasses.fields(Deadlines)]


def test_the_default_deadlines() -> None:
    deadlines = Deadlines()
    assert dataclasses.asdict(deadlines) == {
        "pause": 60.0,
        "flush": 120.0,
        "release": 120.0,
        "resume": 300.0,
        "continue_": 60.0,
        "weight_update": 1800.0,
        "probe": 10.0,
        "startup": 900.0,
        "hook": 1800.0,
    }
    # a hook may run a whole weight update: its deadline is the weight update's
    assert deadlines.hook == deadlines.weight_update


def test_the_default_policy() -> None:
    config = LifecycleConfig()
    assert config.pause_mode is PauseMode.RETRACT  # nothing aborted (invariant 6)
    assert config.deadlines == Deadlines()
    assert config.release_tags == (Tag.WEIGHTS, Tag.KV_CACHE, Tag.CUDA_GRAPH)
    assert config.continue_on_failure is True
    assert config.dead_engines is DeadEnginePolicy.FAIL
    assert config.flush_retry_interval == 0.05
    assert config.timeline_calls == 16
    assert config.memory_metrics is False
    assert [p.value for p in DeadEnginePolicy] == ["fail", "skip"]


def test_names_become_members_and_tags_a_tuple_in_the_order_given() -> None:
    config = LifecycleConfig(
        pause_mode="abort",  # type: ignore[arg-type]
        dead_engines="skip",  # type: ignore[arg-type]
        release_tags=["cuda_graph", Tag.KV_CACHE],  # type: ignore[arg-type]
    )
    assert config.pause_mode is PauseMode.ABORT
    assert config.dead_engines is DeadEnginePolicy.SKIP
    assert config.release_tags == (Tag.CUDA_GRAPH, Tag.KV_CACHE)
    assert all(isinstance(tag, Tag) for tag in config.release_tags)
    # given as names or as members, the same configuration (and one a dict can key on)
    same = LifecycleConfig(
        pause_mode=PauseMode.ABORT,
        dead_engines=DeadEnginePolicy.SKIP,
        release_tags=iter([Tag.CUDA_GRAPH, "kv_cache"]),  # type: ignore[arg-type]
    )
    assert same == config and hash(same) == hash(config)


@pytest.mark.parametrize(
    ("value", "field"),
    [(Deadlines(), "flush"), (LifecycleConfig(), "pause_mode")],
    ids=["Deadlines", "LifecycleConfig"],
)
def test_a_configuration_cannot_be_changed_in_place(value: object, field: str) -> None:
    before = getattr(value, field)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(value, field, 1.0)
    assert getattr(value, field) == before


def test_replacing_a_deadline_keeps_the_others_and_checks_the_new_one() -> None:
    base = Deadlines(pause=5.0)
    faster = dataclasses.replace(base, flush=2.0)
    assert faster.flush == 2.0 and base.flush == 120.0
    assert {f: getattr(faster, f) for f in DEADLINE_FIELDS if f != "flush"} == {
        f: getattr(base, f) for f in DEADLINE_FIELDS if f != "flush"
    }
    with pytest.raises(InvalidArgument) as refused:
        dataclasses.replace(base, hook=-3.0)
    assert "'hook'" in str(refused.value) and "-3.0" in str(refused.value)


def test_replacing_a_config_value_converts_and_checks_it() -> None:
    config = dataclasses.replace(LifecycleConfig(), pause_mode="abort", release_tags=["weights"])  # type: ignore[arg-type]
    assert config.pause_mode is PauseMode.ABORT and config.release_tags == (Tag.WEIGHTS,)
    with pytest.raises(InvalidArgument, match="'in-place'"):
        dataclasses.replace(config, pause_mode="in-place")  # type: ignore[arg-type]


def test_the_flush_retry_interval_is_bounded_by_the_flush_deadline_it_is_given_with() -> None:
    short = Deadlines(flush=1.0)
    assert LifecycleConfig(deadlines=short, flush_retry_interval=1.0).flush_retry_interval == 1.0
    with pytest.raises(InvalidArgument) as refused:
        LifecycleConfig(deadlines=short, flush_retry_interval=1.5)
    message = str(refused.value)
    assert "flush_retry_interval" in message and "1.5" in message and "<= 1" in message
    # a shorter flush deadline swapped in under the default interval (0.05 s) is refused too
    with pytest.raises(InvalidArgument, match=r"<= 0\.01, got 0\.05"):
        dataclasses.replace(LifecycleConfig(), deadlines=Deadlines(flush=0.01))


def test_each_bound_is_reachable_and_the_next_value_is_refused_naming_it() -> None:
    longest = Deadlines(**dict.fromkeys(DEADLINE_FIELDS, MAX_SECONDS))
    assert {getattr(longest, f) for f in DEADLINE_FIELDS} == {MAX_SECONDS}
    assert LifecycleConfig(timeline_calls=MAX_TIMELINE_CALLS).timeline_calls == MAX_TIMELINE_CALLS
    assert LifecycleConfig(timeline_calls=0).timeline_calls == 0
    with pytest.raises(InvalidArgument) as refused:
        LifecycleConfig(timeline_calls=MAX_TIMELINE_CALLS + 1)
    assert "timeline_calls" in str(refused.value) and "1000001" in str(refused.value)
    smallest = Deadlines(**dict.fromkeys(DEADLINE_FIELDS, 1e-9))
    assert smallest.flush == 1e-9


@pytest.mark.parametrize(
    ("kwargs", "named", "valid"),
    [
        ({"pause_mode": "drain"}, "unknown pause_mode 'drain'", "retract, abort, in_place"),
        ({"dead_engines": "retry"}, "unknown dead_engines 'retry'", "fail, skip"),
        (
            {"release_tags": ["kv"]},
            "unknown memory tag 'kv' in release_tags",
            "weights, kv_cache, cuda_graph",
        ),
    ],
)
def test_an_unknown_choice_is_refused_with_the_valid_ones(
    kwargs: dict[str, Any], named: str, valid: str
) -> None:
    with pytest.raises(InvalidArgument) as refused:
        LifecycleConfig(**kwargs)
    assert named in str(refused.value) and f"valid: {valid}" in str(refused.value)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"pause_mode": "pause"}, "'pause'"),
        ({"deadlines": 3}, "deadlines"),
        ({"release_tags": ["kv_cache", "weight"]}, "'weight'"),
        ({"release_tags": []}, "empty"),
        ({"release_tags": ["kv_cache", "kv_cache"]}, "twice"),
        ({"release_tags": "kv_cache"}, "'kv_cache'"),
        ({"dead_engines": "ignore"}, "'ignore'"),
        ({"flush_retry_interval": 0}, "0"),
    ],
)
def test_bad_config_names_the_bad_value(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        LifecycleConfig(**kwargs)  # type: ignore[arg-type]
    assert needle in str(err.value)


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan"), "10", True])
def test_bad_deadline_names_the_phase_and_value(value: object) -> None:
    with pytest.raises(InvalidArgument) as err:
        Deadlines(flush=value)  # type: ignore[arg-type]
    assert "'flush'" in str(err.value) and repr(value) in str(err.value)
