"""The property half of the soak: the lifecycle's property state machine
(``tests/core/test_stateful.py``) with faults, run until a given number of steps.

The machine calls the public API at random on a fleet of fault-injected simulated engines and
checks the design's invariants after every step (see that file's docstring). Here it runs under
the ``soak`` profile: examples of up to 40 steps, no example database, on a ``looptime`` event
loop that skips ahead whenever every task waits, so deadlines, slow faults and decoding cost no
wall time while their order is kept.

It runs in batches, each a fresh ``pytest`` process with its own Hypothesis seed, ``workers`` at
a time. A batch, not one long run: within one run Hypothesis keeps a record of every example
(its mutator pool, choice cache and data tree: every allocation that grows with the number of
examples is in ``hypothesis.internal.conjecture``), about 0.2 MiB each, which would grow the
process by hundreds of MiB over 100,000 steps while the library's own memory stays flat. Each
example appends a JSON line to a report file (``ROLLOUT_LIFECYCLE_PROPERTY_REPORT``); a batch
stops at its first violation (pytest ``-x``), whose text is kept.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TEST = "tests/core/test_stateful.py"
#: Steps an example takes on average under the soak profile (it draws up to 40): sizes the
#: first round of batches; later rounds size themselves from what was counted.
STEPS_PER_EXAMPLE = 35


@dataclass
class Batch:
    """One pytest process of the property machine."""

    seed: int
    examples: int
    returncode: int = 0
    wall_s: float = 0.0
    rows: list[dict[str, Any]] = field(default_factory=list)
    #: The failure pytest printed, if the batch failed.
    failure: str = ""

    @property
    def steps(self) -> int:
        return sum(int(r["steps"]) for r in self.rows)

    @property
    def peak_rss_mb(self) -> float:
        return max((float(r["maxrss_mb"]) for r in self.rows), default=0.0)


@dataclass
class PropertyReport:
    """What the property soak did."""

    batches: list[Batch] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def rows(self) -> list[dict[str, Any]]:
        return [r for b in self.batches for r in b.rows]

    @property
    def steps(self) -> int:
        return sum(b.steps for b in self.batches)

    @property
    def violations(self) -> int:
        """Examples that failed (an invariant, a hang, an unexpected error), and batches that
        failed without a report line for it (pytest itself could not run)."""
        failed = sum(not r["passed"] for r in self.rows)
        silent = sum(b.returncode != 0 and all(r["passed"] for r in b.rows) for b in self.batches)
        return failed + silent

    def totals(self) -> Counter[str]:
        """Every counter of the examples, summed (calls, faults, recoveries, requests...)."""
        out: Counter[str] = Counter()
        for row in self.rows:
            for key, value in row.items():
                if isinstance(value, int) and not isinstance(value, bool):
                    out[key] += value
            for kind, n in row["outcomes"].items():
                out[f"outcome_{kind}"] += n
            out["examples"] += 1
            out["stopped"] += bool(row["stopped"])
        return out

    def row(self) -> dict[str, object]:
        """The soak table's columns for the property machine."""
        totals = self.totals()
        peaks = [b.peak_rss_mb for b in self.batches if b.rows]
        return {
            "steps": self.steps,
            "examples": totals["examples"],
            "violations": self.violations,
            "calls ok/refused": f"{totals['calls_ok']}/{totals['calls_refused']}",
            "faults": sum(n for k, n in totals.items() if k.startswith("faults_")),
            "recoveries": totals["recoveries"],
            "joined/left": f"{totals['joined']}/{totals['left']}",
            "requests": totals["requests"],
            "lost": self.lost(),
            "wall_s": round(self.wall_s, 1),
            "batch peak RSS MiB first/last": (f"{peaks[0]:.0f}/{peaks[-1]:.0f}" if peaks else "-"),
        }

    def lost(self) -> int:
        """Requests that did not end as the design allows: the machine judges each at the end
        of its example (invariant 6), so a loss is an example that failed; counted here from
        the outcomes as those still unfinished or cancelled."""
        totals = self.totals()
        return totals["outcome_unfinished"]


def run_batch(seed: int, examples: int, report_dir: Path, timeout_s: float) -> Batch:
    """One pytest process of ``examples`` examples with Hypothesis seed ``seed``."""
    batch = Batch(seed, examples)
    report = report_dir / f"batch-{seed}.jsonl"
    env = {
        **os.environ,
        "ROLLOUT_LIFECYCLE_PROPERTY_PROFILE": "soak",
        "ROLLOUT_LIFECYCLE_PROPERTY_EXAMPLES": str(examples),
        "ROLLOUT_LIFECYCLE_PROPERTY_REPORT": str(report),
    }
    command = [
        sys.executable,
        "-m",
        "pytest",
        TEST,
        "-k",
        "TestLifecycleProperties",
        "-p",
        "no:cacheprovider",
        "-q",
        "-x",
        f"--hypothesis-seed={seed}",
    ]
    began = time.monotonic()
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
        )
        batch.returncode = done.returncode
        output = done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        batch.returncode = -1
        output = f"batch {seed} did not finish within {timeout_s:g}s (hang): {exc}"
    batch.wall_s = time.monotonic() - began
    if report.exists():
        batch.rows = [json.loads(line) for line in report.read_text().splitlines() if line]
    if batch.returncode != 0:
        batch.failure = _failure_text(output)
    return batch


def _failure_text(output: str, lines: int = 80) -> str:
    """The part of pytest's output that says what failed: from the first violated invariant
    (or error line) on, else the tail."""
    text = output.splitlines()
    for i, line in enumerate(text):
        if "violated" in line or line.startswith("E "):
            return "\n".join(text[i : i + lines])
    return "\n".join(text[-lines:])


def soak_property(
    *,
    steps: int,
    batch_examples: int = 250,
    workers: int = 2,
    seed: int = 0,
    timeout_s: float = 1800.0,
    progress: bool = True,
) -> PropertyReport:
    """Run property-machine batches, ``workers`` at a time, until ``steps`` steps have run;
    stops early after a round with a violation."""
    if steps < 1 or batch_examples < 1 or workers < 1:
        raise ValueError("steps, batch_examples and workers must be at least 1")
    report = PropertyReport()
    began = time.monotonic()
    next_seed = seed
    with (
        tempfile.TemporaryDirectory(prefix="soak-property-") as tmp,
        ThreadPoolExecutor(workers) as pool,
    ):
        while report.steps < steps and report.violations == 0:
            left = steps - report.steps
            per_example = report.steps / max(len(report.rows), 1) or STEPS_PER_EXAMPLE
            wanted = max(1, -(-left // max(int(per_example), 1)))  # examples, rounded up
            sizes: list[int] = []
            while wanted > 0 and len(sizes) < workers:
                sizes.append(min(batch_examples, wanted))
                wanted -= sizes[-1]
            seeds = list(range(next_seed, next_seed + len(sizes)))
            next_seed += len(sizes)
            round_ = list(
                pool.map(
                    lambda job: run_batch(job[0], job[1], Path(tmp), timeout_s),
                    zip(seeds, sizes, strict=True),
                )
            )
            report.batches += round_
            if progress:
                for b in round_:
                    print(
                        f"  property batch seed={b.seed}: {len(b.rows)} examples, {b.steps} "
                        f"steps in {b.wall_s:.1f}s, peak RSS {b.peak_rss_mb:.0f} MiB, "
                        f"pytest exit {b.returncode}",
                        flush=True,
                    )
    report.wall_s = time.monotonic() - began
    return report


__all__ = ["Batch", "PropertyReport", "run_batch", "soak_property"]
