"""Verified weight writes on two real SGLang 0.5.23 servers: a new checkpoint per push, checked
against the fingerprint the trainer computes from the checkpoint file; a push that reaches one
server and not the other, and a push of the wrong checkpoint, each caught before either serves;
the pushes that are not a checkpoint (tensors in shared memory, a gloo broadcast from a trainer
process), verified the same way; and the tensor payload that kills a server, refused.

The servers are the session's shared pair; each test loads the tiny model back and leaves them
serving.
"""

from __future__ import annotations

import base64
import json
import subprocess
from collections.abc import AsyncIterator

import httpx
import pytest
from real.checkpoints import rewrite_weights, tensor_specs, trainer_fingerprint, trainer_push
from real.servers import RealServer, RealSGLang

from rollout_lifecycle import (
    EngineGroup,
    Fingerprint,
    FromDisk,
    FromDistributed,
    FromTensor,
    InvalidArgument,
    RolloutServer,
    ServerState,
    SGLangHTTPEngine,
    StaleWeights,
    WeightsNotVerified,
    free_port,
)
from rollout_lifecycle.testing.fleets import push_reaching

pytestmark = pytest.mark.real_sglang

S = ServerState
#: What each checkpoint rewrites of the tiny model.
CHANGES = {
    "step1": "t['transformer.h.0.mlp.c_fc.weight'] = t['transformer.h.0.mlp.c_fc.weight'] * 1.5",
    "step2": "t['transformer.h.1.attn.c_attn.weight'] = -t['transformer.h.1.attn.c_attn.weight']",
}


@pytest.fixture(scope="module")
def checkpoints(
    real_sglang: RealSGLang, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("verify")
    made = {k: rewrite_weights(real_sglang, folder / k, c) for k, c in CHANGES.items()}
    return {"base": real_sglang.model, **made}


@pytest.fixture(scope="module")
def expected(real_sglang: RealSGLang, checkpoints: dict[str, str]) -> dict[str, Fingerprint]:
    """What the trainer computes each checkpoint's engines will report."""
    return {k: trainer_fingerprint(real_sglang, p, "sglang") for k, p in checkpoints.items()}


@pytest.fixture
async def real_server_and_engines(
    real_servers: list[RealServer], checkpoints: dict[str, str]
) -> AsyncIterator[tuple[RolloutServer, list[SGLangHTTPEngine]]]:
    engines = [SGLangHTTPEngine(s.url) for s in real_servers]
    server = RolloutServer([EngineGroup("actor", engines)])
    yield server, engines
    # Leave the servers serving the tiny model, whatever the test did.
    if server.state is S.FAILED:
        await server.reset()
    if server.state is S.SERVING:
        await server.pause()
    if server.state is S.DRAINED:
        await server.update_weights(FromDisk(checkpoints["base"]), "base")
        await server.resume()
    for engine in engines:
        await engine.close()


async def fingerprints(engines: list[SGLangHTTPEngine]) -> list[Fingerprint]:
    return [Fingerprint.from_wire(await e.weight_fingerprint()) for e in engines]


async def served_versions(server: RolloutServer, count: int) -> set[str]:
    found = set()
    for _ in range(count):
        out = await server.generate(
            {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
        )
        found.add(out["meta_info"]["weight_version"])
    return found


async def test_the_trainers_fingerprint_of_the_served_checkpoint_is_what_the_servers_report(
    real_server_and_engines: tuple[RolloutServer, list[SGLangHTTPEngine]],
    expected: dict[str, Fingerprint],
) -> None:
    _, engines = real_server_and_engines
    assert await fingerprints(engines) == [expected["base"], expected["base"]]
    assert len(expected["base"].tensors) == 28
    assert expected["step1"].differing(expected["base"]) == ("transformer.h.0.mlp.c_fc.weight",)


async def test_a_verified_offload_cycle_loads_a_new_checkpoint_per_step(
    real_server_and_engines: tuple[RolloutServer, list[SGLangHTTPEngine]],
    checkpoints: dict[str, str],
    expected: dict[str, Fingerprint],
) -> None:
    server, engines = real_server_and_engines
    for step in ("step1", "step2"):
        await server.offload()
        await server.onload_weights()
        await server.update_weights(FromDisk(checkpoints[step]), step, expected=expected[step])
        await server.onload_kv()
        assert server.state is S.SERVING
        assert await fingerprints(engines) == [expected[step]] * 2
        assert await served_versions(server, 4) == {step}
        assert server.metrics["lifecycle/update_weights/verify_weights_s"] > 0


async def test_a_push_that_reaches_one_server_but_not_the_other_is_caught_before_either_serves(
    real_servers: list[RealServer],
    real_server_and_engines: tuple[RolloutServer, list[SGLangHTTPEngine]],
    checkpoints: dict[str, str],
) -> None:
    server, _ = real_server_and_engines
    await server.pause()
    with pytest.raises(WeightsNotVerified) as caught:
        await server.update_weights(
            push_reaching(checkpoints["step1"], "actor/0"), "step1", verify=True
        )
    assert caught.value.problems == {"actor/1": "holds the weights it held before the push"}
    with pytest.raises(StaleWeights, match="actor/1"):
        await server.resume()
    # neither server serves: both are still paused (SGLang's /ready is 503 while paused)
    for real in real_servers:
        async with httpx.AsyncClient(base_url=real.url, trust_env=False, timeout=30) as client:
            assert (await client.get("/ready")).status_code == 503
    # a write that reaches both: verified, and both serve (step1 again would be refused on
    # actor/0, which holds it already, unless the push may be a no-op)
    await server.update_weights(FromDisk(checkpoints["step2"]), "step2", verify=True)
    await server.resume()
    assert await served_versions(server, 4) == {"step2"}


async def test_a_push_of_the_wrong_checkpoint_is_caught_against_the_expected_fingerprint(
    real_server_and_engines: tuple[RolloutServer, list[SGLangHTTPEngine]],
    checkpoints: dict[str, str],
    expected: dict[str, Fingerprint],
) -> None:
    server, _ = real_server_and_engines
    await server.pause()
    with pytest.raises(WeightsNotVerified) as caught:
        await server.update_weights(
            FromDisk(checkpoints["step2"]), "step1", expected=expected["step1"]
        )
    wrong = ("transformer.h.0.mlp.c_fc.weight", "transformer.h.1.attn.c_attn.weight")
    assert caught.value.tensors == {"actor/0": wrong, "actor/1": wrong}
    assert "differs from the expected fingerprint" in str(caught.value)
    with pytest.raises(StaleWeights):
        await server.resume()


async def pushed_by(
    trainer: subprocess.Popen[str],
    server: RolloutServer,
    push: FromTensor | FromDistributed,
    version: str,
    expected: Fingerprint,
) -> None:
    """Pause, push ``push`` (the trainer process's side runs meanwhile), verify against
    ``expected`` and resume; the trainer is ended either way (its input closed)."""
    try:
        await server.pause()
        await server.update_weights(push, version, expected=expected)
    finally:
        trainer.communicate(timeout=60)
    assert trainer.returncode == 0
    await server.resume()


async def test_tensors_in_shared_memory_from_a_trainer_process_are_pushed_and_verified(
    real_sglang: RealSGLang,
    real_server_and_engines: tuple[RolloutServer, list[SGLangHTTPEngine]],
    checkpoints: dict[str, str],
    expected: dict[str, Fingerprint],
) -> None:
    server, engines = real_server_and_engines
    trainer = trainer_push(real_sglang, "tensor", checkpoints["step1"])
    assert trainer.stdout is not None
    payload = json.loads(trainer.stdout.readline())
    await pushed_by(trainer, server, FromTensor(payload), "tensor", expected["step1"])
    assert await fingerprints(engines) == [expected["step1"]] * 2
    assert await served_versions(server, 4) == {"tensor"}


async def test_a_gloo_broadcast_from_a_trainer_process_is_pushed_and_verified(
    real_sglang: RealSGLang,
    real_server_and_engines: tuple[RolloutServer, list[SGLangHTTPEngine]],
    checkpoints: dict[str, str],
    expected: dict[str, Fingerprint],
) -> None:
    server, engines = real_server_and_engines
    names, dtypes, shapes = tensor_specs(checkpoints["step2"])
    port = free_port()
    push = FromDistributed(
        names,
        dtypes,
        shapes,
        "trainer-to-actor",
        master_address="127.0.0.1",
        master_port=port,
        world_size=3,
        rank_offsets={"actor/0": 1, "actor/1": 2},
        backend="gloo",
    )
    group = ("127.0.0.1", str(port), "3", "trainer-to-actor")
    trainer = trainer_push(real_sglang, "distributed", checkpoints["step2"], *group)
    await pushed_by(trainer, server, push, "broadcast", expected["step2"])
    assert await fingerprints(engines) == [expected["step2"]] * 2
    assert await served_versions(server, 4) == {"broadcast"}


def descriptor_payload(real_sglang: RealSGLang) -> str:
    """A tensor pickled as SGLang's own serializer does, with torch's default sharing strategy."""
    script = (
        "import base64, io, torch; from multiprocessing.reduction import ForkingPickler; "
        "import torch.multiprocessing; b = io.BytesIO(); "
        "ForkingPickler(b).dump([('transformer.ln_f.bias', torch.zeros(64))]); "
        "print(base64.b64encode(b.getvalue()).decode())"
    )
    done = subprocess.run([real_sglang.python, "-c", script], check=True, capture_output=True)
    return done.stdout.decode().strip()


async def test_a_tensor_payload_that_kills_a_server_is_refused_before_it_is_sent(
    real_sglang: RealSGLang,
    disposable_real_server: RealServer,
    real_server_and_engines: tuple[RolloutServer, list[SGLangHTTPEngine]],
) -> None:
    lent = descriptor_payload(real_sglang)
    not_a_pickle = base64.b64encode(b"not a pickle").decode()
    server, _ = real_server_and_engines
    await server.pause()
    for payload, why in ((lent, "file descriptors"), (not_a_pickle, "is not a pickle")):
        with pytest.raises(InvalidArgument, match=why):
            await server.update_weights(FromTensor([payload]), "deadly")
    assert server.state is S.DRAINED
    await server.resume()
    # What the refusal spares: a server sent either payload inside a weight-update session
    # dies of it (sglang: tp_worker.py deserialize_own_rank, uncaught in the scheduler).
    real = disposable_real_server
    async with httpx.AsyncClient(base_url=real.url, trust_env=False, timeout=60) as client:
        assert (await client.post("/pause_generation", json={"mode": "abort"})).status_code == 200
        assert (await client.post("/begin_weight_update", json={})).status_code == 200
        body = {"serialized_named_tensors": [lent]}
        with pytest.raises(httpx.HTTPError):
            await client.post("/update_weights_from_tensor", json=body)
    assert real.exited(within=120)
