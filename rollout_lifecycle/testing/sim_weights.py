"""The simulated engine's weight calls: sessions, the three update kinds, collective groups
and the weight version, each with SGLang 0.5.23's refusals and deaths.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Sequence
from typing import Any

from rollout_lifecycle.backends.sglang.api import (
    SELECTORS,
    SESSION_ALREADY_OPEN,
    WEIGHTS_WRITTEN_FLUSH_FAILED,
)
from rollout_lifecycle.backends.tensor_payload import deadly, decoded
from rollout_lifecycle.contract.exceptions import EngineRejected
from rollout_lifecycle.contract.fingerprint import SIMULATED_SCHEME, Fingerprint
from rollout_lifecycle.contract.outcome import SESSION_OPEN
from rollout_lifecycle.contract.values import DEFAULT_GROUP_NAME, Tag
from rollout_lifecycle.testing.sim_calls import SimCalls
from rollout_lifecycle.testing.sim_scheduler import SimScheduler
from rollout_lifecycle.testing.sim_state import SIM_TENSORS, SimState


class SimWeights:
    """Weight-update sessions and writes, collective groups and the weight version of one
    simulated server: what it holds of them is in ``state``; a write that aborts requests or
    moves the version stamped on tokens asks ``scheduler``; each call is taken by ``calls``."""

    def __init__(self, state: SimState, scheduler: SimScheduler, calls: SimCalls) -> None:
        self._state = state
        self._scheduler = scheduler
        self._calls = calls

    async def _wait_unpaused_idle(self, op: str) -> None:
        """Unpaused, a weight call takes the model-update writer lock, so it waits for every
        in-flight generate to finish; paused, whoever paused holds it and the call runs now."""
        # sglang: tokenizer_control_mixin.py _weight_update_session_call,
        # update_weights_from_tensor / _distributed (model_update_lock.writer_lock unless paused)
        state = self._state
        while not state.paused and (state.running or state.waiting):
            await state.wait_changed(None)
            state.check_alive(op)

    def _check_selector(self, op: str, selector: str) -> str:
        if selector not in SELECTORS:
            raise EngineRejected(
                self._state.label, op, f"selector must be one of {', '.join(SELECTORS)}", 400
            )
        return selector

    async def begin_weight_update(self, selector: str = "all") -> None:
        """``POST /begin_weight_update``: open a session (``SESSION_OPEN`` if one is open, as
        every backend refuses it; the SGLang stand-in answers SGLang's 400)."""
        # sglang: weight_updater.py SchedulerWeightUpdaterManager.begin_weight_update
        state = self._state
        op = "begin_weight_update"
        async with self._calls.op(op, selector=selector):
            self._check_selector(op, selector)
            await self._wait_unpaused_idle(op)
            if state.session_open:
                raise EngineRejected(state.label, op, SESSION_ALREADY_OPEN, SESSION_OPEN)
            state.session_open = True
            state.session_selector = selector

    async def end_weight_update(self) -> None:
        """``POST /end_weight_update``: close the session (400 if none is open)."""
        # sglang: weight_updater.py SchedulerWeightUpdaterManager.end_weight_update
        state = self._state
        op = "end_weight_update"
        async with self._calls.op(op):
            await self._wait_unpaused_idle(op)
            if not state.session_open:
                raise EngineRejected(
                    state.label,
                    op,
                    "no weight-update session is open; call begin_weight_update() first",
                    400,
                )
            state.session_open = False
            state.session_selector = None

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None,
        flush_cache: bool,
        abort_all_requests: bool,
    ) -> None:
        """``POST /update_weights_from_disk`` (needs no session)."""
        op = "update_weights_from_disk"
        async with self._calls.op(
            op,
            version=weight_version,
            model_path=model_path,
            flush_cache=flush_cache,
            abort_all_requests=abort_all_requests,
        ) as entry:
            if not isinstance(model_path, str) or not model_path:
                raise EngineRejected(self._state.label, op, f"bad model_path {model_path!r}", 400)
            # SGLang's loader fails on a path it cannot read: success false, version kept.
            # sglang: model_runner_components/weight_updater.py update_weights_from_disk
            refuse = None
            if self._state.check_model_paths and not await asyncio.to_thread(
                os.path.isdir, model_path
            ):
                refuse = f"Failed to get weights iterator: no model at {model_path!r}."
            await self._write_weights(
                entry,
                weight_version,
                flush_cache,
                abort_all_requests,
                selector="all",
                refuse=refuse,
                content=model_path,
            )

    def _single_rank(self, op: str, what: str) -> None:
        """A data-parallel server refuses tensor and collective writes with a 500 and stays up:
        an assert in its tokenizer manager (sglang: tokenizer_control_mixin.py
        TokenizerControlMixin.update_weights_from_tensor and the group calls)."""
        if self._state.dp_size > 1:
            why = f"data-parallel replicas are not supported for {what}"
            raise EngineRejected(self._state.label, op, why, 500)

    async def update_weights_from_tensor(
        self,
        payload: Any,
        *,
        weight_version: str | None,
        flush_cache: bool,
        abort_all_requests: bool,
        selector: str = "all",
    ) -> None:
        """``POST /update_weights_from_tensor`` (only inside a begin/end session)."""
        op = "update_weights_from_tensor"
        async with self._calls.op(
            op,
            version=weight_version,
            payload_type=type(payload).__name__,
            flush_cache=flush_cache,
            abort_all_requests=abort_all_requests,
            selector=selector,
        ) as entry:
            self._single_rank(op, "update weights from tensor")
            self._check_selector(op, selector)
            await self._write_weights(
                entry,
                weight_version,
                flush_cache,
                abort_all_requests,
                selector=selector,
                session=f"{op} must run between begin_weight_update() and end_weight_update()",
                fatal=self._unpickling_death(op, payload),
                content="tensor:" + hashlib.sha256(repr(payload).encode()).hexdigest()[:16],
            )

    def _unpickling_death(self, op: str, payload: Any) -> str | None:
        """What the scheduler dies of when it unpickles ``payload`` (a list of base64 strings, as
        the wire carries it; other payloads are the simulation's own), or None; text that is
        not base64 is refused first, with a 400, as the server's request validation does."""
        # sglang: tokenizer_control_mixin.py update_weights_from_tensor (base64, in the HTTP
        # process); tp_worker.py deserialize_own_rank (unpickling, uncaught, in the scheduler)
        if not isinstance(payload, list) or not all(isinstance(p, str) for p in payload):
            return None
        for i, text in enumerate(payload):
            if decoded(text) is None:
                raise EngineRejected(
                    self._state.label, op, f"serialized_named_tensors[{i}] is not base64", 400
                )
        found = [why for why in map(deadly, payload) if why is not None]
        return f"UnpicklingError: the payload {found[0]}" if found else None

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        *,
        group_name: str = DEFAULT_GROUP_NAME,
        backend: str = "nccl",
    ) -> None:
        """``POST /init_weights_update_group``: record the group (no collective is formed)."""
        # sglang: model_runner_components/weight_updater.py init_weights_update_group
        op = "init_weights_update_group"
        async with self._calls.op(op, group_name=group_name, backend=backend):
            self._single_rank(op, "update weights from distributed")
            if not isinstance(group_name, str) or not group_name:
                raise EngineRejected(
                    self._state.label,
                    op,
                    "Failed to initialize custom process group: Group name cannot be empty.",
                    400,
                )
            self._state.groups[group_name] = {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "backend": backend,
                "received": 0,
            }

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP_NAME) -> None:
        """``POST /destroy_weights_update_group``; 400 for a group that does not exist."""
        # sglang: model_runner_components/weight_updater.py destroy_weights_update_group
        op = "destroy_weights_update_group"
        async with self._calls.op(op, group_name=group_name):
            self._single_rank(op, "destroy parameter update group")
            if self._state.groups.pop(group_name, None) is None:
                raise EngineRejected(
                    self._state.label, op, "The group to be destroyed does not exist.", 400
                )

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str = DEFAULT_GROUP_NAME,
        *,
        weight_version: str | None,
        flush_cache: bool,
        abort_all_requests: bool,
        load_format: str | None = None,
        selector: str = "all",
    ) -> None:
        """``POST /update_weights_from_distributed``: inside a session, over a group that
        ``init_weights_update_group`` formed (400 naming the known groups otherwise)."""
        op = "update_weights_from_distributed"
        async with self._calls.op(
            op,
            version=weight_version,
            group_name=group_name,
            load_format=load_format,
            flush_cache=flush_cache,
            abort_all_requests=abort_all_requests,
            selector=selector,
        ) as entry:
            self._single_rank(op, "update weights from distributed")
            self._check_selector(op, selector)
            # sglang: model_runner_components/weight_updater.py receive_weights_from_distributed
            # (the assertion is caught by update_weights_from_distributed and answered as 400)
            unknown = None
            group = self._state.groups.get(group_name)
            if group is None:
                unknown = (
                    f"Failed to receive weights: Group {group_name} not in "
                    f"{list(self._state.groups)}. Please call `init_weights_update_group` first."
                )
            # The members of a group receive the same broadcasts in the same order: the n-th
            # receive over a group carries the same bytes to each of them.
            received = 0 if group is None else group["received"] + 1
            named = [n for n in names if n in SIM_TENSORS]
            content = f"{group_name}#{received}"
            await self._write_weights(
                entry,
                weight_version,
                flush_cache,
                abort_all_requests,
                selector=selector,
                session=f"{op} must run between begin_weight_update() and end_weight_update()",
                refuse=unknown,
                content=dict.fromkeys(named, content) if named else content,
            )
            if group is not None:
                group["received"] = received

    async def _write_weights(
        self,
        entry: dict[str, Any],
        weight_version: str | None,
        flush_cache: bool,
        abort_all_requests: bool,
        *,
        selector: str,
        session: str | None = None,
        refuse: str | None = None,
        fatal: str | None = None,
        content: str | dict[str, str],
    ) -> None:
        state = self._state
        op: str = entry["op"]
        if weight_version is not None and not isinstance(weight_version, str):
            raise EngineRejected(state.label, op, f"bad weight_version {weight_version!r}", 400)
        if abort_all_requests:
            # sglang: the tokenizer's abort_request(abort_all=True), before the lock is taken
            await self._scheduler.abort(lambda _: True, f"aborted by {op}(abort_all_requests=True)")
        await self._wait_unpaused_idle(op)
        # sglang: weight_updater.py update_weights_from_tensor / _distributed check the session
        # first, then receive, then load into the runners the request's own selector picks.
        if session is not None and not state.session_open:
            raise EngineRejected(state.label, op, session, 400)
        if fatal is not None:
            raise self._calls.fatal(entry, fatal)
        if refuse is not None:
            raise EngineRejected(state.label, op, refuse, 400)
        # The simulated model has no speculative draft: "draft" selects no runner, so the call
        # succeeds and loads nothing (sglang: weight_updater.py _select_runners).
        if selector != "draft":
            if Tag.WEIGHTS.value in state.released:
                raise self._calls.fatal(
                    entry, f"illegal memory access: {op} wrote weights while 'weights' is released"
                )
            if not state.weights_valid:
                state.weights_content, state.tensor_content = "uninitialised", None
            state.weights_valid = True
            if isinstance(content, str):
                state.weights_content, state.tensor_content = content, None
            else:
                state.tensor_content = {**(state.tensor_content or {}), **content}
        state.counts["weight_updates"] += 1
        self._scheduler.record_version_change(weight_version)
        if flush_cache and not state.is_idle(ignore_waiting=state.paused):
            # The weights and the scheduler's version moved; the answer is a 400 and the
            # tokenizer's version (/model_info) stays.
            # sglang: weight_updater.py flush_cache_after_weight_update
            raise EngineRejected(state.label, op, WEIGHTS_WRITTEN_FLUSH_FAILED, 400)
        if flush_cache:
            state.prefix_cache.clear()
        if weight_version is not None:
            state.served_version = weight_version

    async def weight_fingerprint(self) -> dict[str, Any]:
        """``POST /weights_checker {"action": "checksum"}``: a digest per tensor of what the
        weights hold (``Fingerprint.to_wire``); garbage after a resume that restored none."""
        # sglang: utils/weight_checker.py WeightChecker._compute_checksum (it reads every
        # weight; with the weights released their pages are unmapped)
        state = self._state
        op = "weight_fingerprint"
        async with self._calls.op(op) as entry:
            if Tag.WEIGHTS.value in state.released:
                raise self._calls.fatal(
                    entry, f"illegal memory access: {op} read weights while 'weights' is released"
                )
            over = state.tensor_content or {}
            # packed weights read unpacked while a session is open (``SimState.packed_weights``)
            layout = "unpacked\0" if state.packed_weights and state.session_open else ""
            tensors = {}
            for name in SIM_TENSORS:
                held = over.get(name, state.weights_content) if state.weights_valid else "garbage"
                digest = hashlib.sha256(f"{layout}{held}\0{name}".encode())
                tensors[name] = digest.hexdigest()[:16]
            return Fingerprint(SIMULATED_SCHEME, tensors).to_wire()

    async def update_weight_version(self, version: str, *, abort_all_requests: bool = True) -> None:
        """``POST /update_weight_version``; SGLang's default aborts every request the scheduler
        holds (the front end's, held while paused, are out of its reach)."""
        # sglang: http_server.py update_weight_version; scheduler.py handle_update_weight_version
        op = "update_weight_version"
        async with self._calls.op(op, version=version, abort_all_requests=abort_all_requests):
            if not isinstance(version, str):
                raise EngineRejected(self._state.label, op, f"bad new_version {version!r}", 400)
            if abort_all_requests:
                # Includes the requests a retract pause preserved: the field's costliest bug.
                await self._scheduler.abort(lambda _: True, "aborted by update_weight_version")
            self._scheduler.record_version_change(version)
            self._state.served_version = version
