"""The soak on the tier's two shared real SGLang servers, at CI's size: 256 requests through the
generation client while the fleet runs 4 cycles in two legs (a retract pause, then an abort
pause), none lost, none aborted under a retract pause, and no violation of the call order in
the server's timeline. It is ``python -m benchmarks.soak --only real --real-cycles 4
--real-requests 256 --real-death-every 0`` on the servers the tier runs already, instead of two
the soak would start (over a minute on CI's two cores)."""

from __future__ import annotations

import pytest
from real.servers import RealServer, RealSGLang

from benchmarks.soak import REAL_KNOBS, report
from benchmarks.soak_traffic import soak_real

pytestmark = pytest.mark.real_sglang

REQUESTS, CYCLES = 256, 4


async def test_the_soak_on_two_real_servers_loses_nothing_and_breaks_no_barrier(
    real_servers: list[RealServer], real_sglang: RealSGLang
) -> None:
    result = await soak_real(
        urls=[server.url for server in real_servers],
        model=real_sglang.model,
        requests=REQUESTS,
        cycles=CYCLES,
        legs=2,
        knobs=REAL_KNOBS,
    )
    assert report(None, [result]) == []  # (it prints the soak's table, -s shows it)
    assert result.submitted == result.completed == REQUESTS
    assert result.cycles == CYCLES and result.violations == 0
    # every leg's offloads found requests decoding: the cycles were run under traffic
    assert all(leg["min_in_flight_at_offload"] > 0 for leg in result.per_leg), result.per_leg
