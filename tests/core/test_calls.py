"""The table of public calls (``core/calls.py``) against what reads it and what it describes: the
async server's members, the sync facade's members and signatures, the scope's refusals, ``ctl``'s
actions and the table in ``docs/design.md``."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest

from rollout_lifecycle.cli import ctl
from rollout_lifecycle.cli.ctl_state import ACTIONS
from rollout_lifecycle.core.calls import (
    LIFECYCLE_CALLS,
    PUBLIC_CALLS,
    CallKind,
    PublicCall,
    calls_table,
)
from rollout_lifecycle.core.server import RolloutServer
from rollout_lifecycle.core.states import CALLS
from rollout_lifecycle.sync import FACADE_MEMBERS, SyncRolloutServer

DESIGN = Path(__file__).resolve().parents[2] / "docs" / "design.md"


def public_members(cls: type) -> set[str]:
    return {name for name in vars(cls) if not name.startswith("_")}


def parameters(member: Any) -> list[tuple[str, Any]]:
    """A method's parameters after ``self`` as (name, kind)."""
    return [(p.name, p.kind) for p in inspect.signature(member).parameters.values()][1:]


def test_every_public_member_of_the_server_is_in_the_table_and_nothing_else() -> None:
    assert public_members(RolloutServer) == set(PUBLIC_CALLS)


def test_the_facade_offers_exactly_the_calls_the_table_marks_sync() -> None:
    offered = {name for name, call in PUBLIC_CALLS.items() if call.sync}
    assert public_members(SyncRolloutServer) - FACADE_MEMBERS == offered


@pytest.mark.parametrize("call", [c for c in PUBLIC_CALLS.values() if c.sync], ids=lambda c: c.name)
def test_each_facade_member_mirrors_the_server_s_plus_a_timeout_where_it_may_wait(
    call: PublicCall,
) -> None:
    server, facade = vars(RolloutServer)[call.name], vars(SyncRolloutServer)[call.name]
    assert isinstance(server, property) == isinstance(facade, property), call.name
    if isinstance(server, property):
        assert call.kind is CallKind.LOCAL
        return
    expected = parameters(server)
    if call.kind is not CallKind.LOCAL:  # it may wait on engines: the facade bounds it
        expected.append(("timeout", inspect.Parameter.KEYWORD_ONLY))
    assert parameters(facade) == expected


@pytest.mark.parametrize(
    "call", [c for c in PUBLIC_CALLS.values() if c.user_code], ids=lambda c: c.name
)
def test_user_code_names_a_parameter_of_the_call(call: PublicCall) -> None:
    assert call.user_code in dict(parameters(vars(RolloutServer)[call.name]))


def test_the_calls_that_fire_transitions_are_the_lifecycle_calls() -> None:
    # Every call with a plan in the state table fires transitions; recover() replaces engines,
    # add_engines() and remove_engines() change them.
    assert set(CALLS) | {"recover", "add_engines", "remove_engines"} == LIFECYCLE_CALLS
    for name in LIFECYCLE_CALLS:
        assert inspect.iscoroutinefunction(vars(RolloutServer)[name]), name


def test_ctl_offers_an_action_for_each_call_the_table_gives_it_and_makes_that_call() -> None:
    from_table = {a: c.name for c in PUBLIC_CALLS.values() for a in c.ctl}
    assert set(ACTIONS) == {"status", *from_table}
    for action, name in from_table.items():
        made = ctl._CALLS[action]
        if name == "reset":
            assert made is ctl._reset  # it resolves what a stopped run left, then resets
        else:
            assert made is vars(RolloutServer)[name]


def test_the_design_doc_shows_the_table_as_the_code_draws_it() -> None:
    text = DESIGN.read_text()
    start = text.index("<!-- calls_table")
    body = text[text.index("\n", start) + 1 : text.index("<!-- /calls_table -->")]
    assert body.strip() == calls_table()
    for name in LIFECYCLE_CALLS:
        assert f"| `{name}()` |" in body
