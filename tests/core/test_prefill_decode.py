"""Prefill/decode pairs: servers that say they serve as one half of a pair (SGLang's
``--disaggregation-mode``, read from ``/server_info`` with their incarnation) are registered
with a router as that half (a prefill one with its bootstrap port), a pair that forms a unit is
registered and taken out in one sync, a worker listed as another type than its server serves
as is registered again, and the generation client, which sends a request to one engine, never
picks a half: a request only halves could serve is refused at once, naming the router.

The fleets are simulated engines in process behind a list-keeping router; the same behind a
real sglang-router in prefill/decode mode is ``tests/system/test_router_prefill_decode.py``'s.
"""

from __future__ import annotations

from typing import Any

import pytest
from core.test_router_sync import AtURL, ListRouter

from rollout_lifecycle import (
    EngineGroup,
    GenerationClient,
    GenerationError,
    RolloutServer,
    ServerState,
)
from rollout_lifecycle.contract.capabilities import Capabilities
from rollout_lifecycle.core.requests import GenerationTimeout

S = ServerState
#: Two prefill/decode units: pd/0 (prefill) with pd/1 (decode), pd/2 with pd/3.
URLS = [f"http://127.0.0.1:{31300 + i}" for i in range(4)]
BOOTSTRAP = [9100, 9102]
REQUEST = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}


class Counted(AtURL):
    """A simulated engine at an address that counts the generate requests it was sent."""

    generated = 0

    async def generate(self, request: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        self.generated += 1
        return await super().generate(request, *args, **kwargs)


def pairs() -> list[Counted]:
    engines = []
    for i, port in enumerate(BOOTSTRAP):
        engines.append(
            Counted(URLS[2 * i], disaggregation_mode="prefill", disaggregation_bootstrap_port=port)
        )
        engines.append(Counted(URLS[2 * i + 1], disaggregation_mode="decode"))
    return engines


def fleet(*extra: EngineGroup) -> tuple[RolloutServer, list[Counted], ListRouter]:
    engines = pairs()
    router = ListRouter(engines=engines)
    server = RolloutServer([EngineGroup("pd", engines, unit=2), *extra], router=router)
    return server, engines, router


WANT = {
    URLS[0]: ("prefill", BOOTSTRAP[0]),
    URLS[1]: ("decode", None),
    URLS[2]: ("prefill", BOOTSTRAP[1]),
    URLS[3]: ("decode", None),
}


def test_capabilities_carry_the_worker_type_across_the_wire() -> None:
    half = Capabilities(worker_type="prefill", bootstrap_port=9100)
    assert half.half and not Capabilities().half
    assert Capabilities.from_wire(half.to_wire()) == half
    with pytest.raises(ValueError, match="worker_type must be one of regular, prefill, decode"):
        Capabilities(worker_type="both")
    with pytest.raises(ValueError, match="bootstrap_port"):
        Capabilities.from_wire({**half.to_wire(), "bootstrap_port": 0})


async def test_each_half_is_registered_as_its_server_says_and_a_cycle_moves_pairs_whole() -> None:
    server, _, router = fleet()
    assert await server.sync_router() == {"added": URLS, "removed": []}
    assert router.types == WANT
    records = {r.id: r for r in server.fleet.records()}
    assert records["pd/0"].capabilities is not None
    assert records["pd/0"].capabilities.worker_type == "prefill"
    seen: list[list[str]] = []

    async def push(update: object) -> None:
        seen.append(sorted(router.listed))

    await server.offload()
    assert router.listed == []
    # every removal came before its engine's pause, and each pair left in one gather
    assert router.paused_when_removed == dict.fromkeys(URLS, False)
    await server.onload_weights()
    await server.update_weights(push)
    await server.onload_kv()
    assert server.state is S.SERVING and seen == [[]]
    assert sorted(router.listed) == URLS and router.types == WANT
    # whenever the binding looked, the router listed whole pairs (or none)
    assert len(router.looked) > 3
    pair_sets = [set(URLS[:2]), set(URLS[2:])]
    assert not [s for s in router.looked if any(0 < len(s & p) < 2 for p in pair_sets)]


async def test_a_worker_listed_as_another_type_is_registered_again() -> None:
    server, _, router = fleet()
    router.listed = [URLS[0], URLS[1]]  # listed as regular workers (a restart in another mode)
    done = await server.sync_router()
    assert sorted(done["removed"]) == URLS[:2]
    assert sorted(done["added"]) == URLS
    assert router.types == WANT
    assert await server.sync_router() == {"added": [], "removed": []}


async def test_the_generation_client_never_sends_a_request_to_one_half() -> None:
    single = Counted("http://127.0.0.1:31310")
    server, halves, _ = fleet(EngineGroup("single", [single]))
    await server.sync_router()  # (its first contact: the servers say what they serve as)
    with pytest.raises(GenerationError, match=r"every engine of group 'pd' is half of a") as err:
        await server.generation.generate(REQUEST, group="pd")
    assert "pd/0 prefill, pd/1 decode" in str(err.value)
    assert "sglang-router in prefill/decode mode" in str(err.value)
    # requests any group may serve go to the one regular server, never to a half
    answers = await server.generation.generate_batch([REQUEST] * 6)
    assert len(answers) == 6
    assert single.generated == 6
    assert [e.generated for e in halves] == [0] * 4
    server.generation.close()


async def test_a_request_held_names_the_halves_it_cannot_use() -> None:
    single = AtURL("http://127.0.0.1:31311")
    server, _, _ = fleet(EngineGroup("single", [single]))
    await server.sync_router()
    await single.close()  # the one regular server dies: the halves alone live on
    await server.probe()
    client = GenerationClient(server, hold_timeout=0.05)
    with pytest.raises(GenerationTimeout) as held:
        await client.generate(REQUEST)
    assert "single/0 dead" in str(held.value)
    assert "pd/0 is a prefill/decode half, served through a router" in str(held.value)
    client.close()
