"""A colocated RL loop on a CPU: a torch trainer and real SGLang or vLLM servers share the machine.

The trainer holds the tiny GPT-2 the servers serve (``--engines``: two SGLang servers by
default; ``vllm,vllm,sglang`` is a mixed fleet). Each step it samples rollouts through the
server's generation client (spread over the servers), scores them with a toy reward (the share
of a set of target tokens in each completion), and runs the colocated cycle:

    offload -> policy-gradient step -> onload_weights -> push (a checkpoint per step)
            -> verify (against the trainer's own fingerprint) -> onload_kv

Every step records the reward, how the engines' log-probabilities of the sampled tokens compare
with the trainer's for the same tokens (mean absolute difference and the K3 estimate of
KL(engine || trainer)), the weight version every output reports (SGLang's outputs carry it;
vLLM's do not, so each engine's own version is read too), and the time of each phase. The
push is verified per engine kind, against the trainer's fingerprint in each kind's layout.
It writes ``steps.json``, ``rl_loop.png`` (reward and mismatch per step) and beside it
``timeline.json`` (the lifecycle's timeline, for chrome://tracing or Perfetto).

Run it with an interpreter that has torch and transformers (e.g. the SGLang servers' own), the
library importable, e.g. on this project's CPU test machines::

    PYTHONPATH=. ~/.cache/rollout-lifecycle/sglang-0.5.23/bin/python examples/real/rl_loop.py \\
        --model ~/.cache/rollout-lifecycle/tiny-gpt2 --out rl-loop \\
        --sglang-args "--device cpu --attention-backend torch_native --disable-cuda-graph ..."

and for vLLM servers add ``--engines vllm,vllm --vllm-python ~/.cache/rollout-lifecycle/
vllm-0.32.0/bin/python --vllm-args "--enforce-eager ..."``. The servers serve float32
(``--dtype float32``), the trainer's dtype, so a mismatch means other weights, not rounding.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from transformers import GPT2LMHeadModel

from rollout_lifecycle import (
    DeadEnginePolicy,
    EngineGroup,
    Fingerprint,
    FromDisk,
    LaunchedSGLangEngine,
    LaunchedVLLMEngine,
    LifecycleConfig,
    RolloutServer,
    free_port,
)
from rollout_lifecycle.trainer import (
    GPT2_CONV1D_WEIGHTS,
    SGLANG_SCHEME,
    VLLM_PREFIX,
    VLLM_SCHEME,
    emptying,
    fingerprint,
    transposing,
)

PROMPT_TOKENS = 4
#: How many tokens the reward counts.
TARGETS = 8


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the tiny GPT-2's directory")
    parser.add_argument("--out", required=True, help="where steps, timeline and plot go")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rollouts", type=int, default=32, help="completions per step")
    parser.add_argument("--tokens", type=int, default=16, help="new tokens per completion")
    parser.add_argument("--lr", type=float, default=5.0, help="plain SGD's learning rate")
    parser.add_argument(
        "--max-grad-norm", type=float, default=0.25, help="the gradient's norm is clipped to this"
    )
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--sglang-python", default=sys.executable)
    parser.add_argument("--sglang-args", default="", help="extra server arguments (one string)")
    parser.add_argument("--sglang-env", action="append", default=[], help="K=V for the servers")
    parser.add_argument("--engines", default="sglang,sglang", help="the servers, by kind")
    parser.add_argument("--vllm-python", default=sys.executable)
    parser.add_argument("--vllm-args", default="", help="extra vLLM server arguments")
    parser.add_argument("--vllm-env", action="append", default=[], help="K=V for vLLM servers")
    parser.add_argument(
        "--unverified",
        choices=[p.value for p in DeadEnginePolicy],
        default="fail",
        help="what a push does with engines that fail verification: fail, or skip them (they "
        "wait paused, out of the router, while the others serve)",
    )
    args = parser.parse_args(argv)
    args.kinds = args.engines.split(",")
    unknown = set(args.kinds) - set(LAYOUTS)
    if unknown:
        parser.error(f"--engines takes {sorted(LAYOUTS)}, got {sorted(unknown)}")
    return args


def engine_view(name: str) -> str | None:
    """The trainer's tensor names the servers hold (GPT-2's head is tied to its embedding)."""
    return name if name.startswith("transformer.") else None


def token_logprobs(model: GPT2LMHeadModel, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The trainer's log-probability of each of ``tokens`` after ``prompt`` (with gradients)."""
    ids = torch.tensor([prompt + tokens])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


async def rollouts(server: RolloutServer, prompts: list[list[int]], tokens: int) -> list[Any]:
    def request(prompt: list[int]) -> dict[str, Any]:
        params = {"max_new_tokens": tokens, "temperature": 1.0, "ignore_eos": True}
        return {"input_ids": prompt, "sampling_params": params, "return_logprob": True}

    return list(await asyncio.gather(*(server.generate(request(p)) for p in prompts)))


#: How each kind of server holds the model, for its checksum: SGLang holds GPT-2's ``Conv1D``
#: weights transposed; vLLM on a CPU holds them packed away, where its checksum reads nothing.
LAYOUTS: dict[str, dict[str, Any]] = {
    "sglang": {"scheme": SGLANG_SCHEME, "transform": transposing(GPT2_CONV1D_WEIGHTS)},
    "vllm": {
        "scheme": VLLM_SCHEME,
        "prefix": VLLM_PREFIX,
        "transform": emptying(GPT2_CONV1D_WEIGHTS),
    },
}


def engines_fingerprint(model: GPT2LMHeadModel, kinds: list[str]) -> tuple[Fingerprint, ...]:
    """What each kind of server in ``kinds`` reports once it holds ``model``'s weights (float32,
    the head tied to the embedding), one fingerprint per kind."""
    state = model.state_dict()
    return tuple(
        fingerprint(state, dtype=torch.float32, rename=engine_view, **LAYOUTS[kind])
        for kind in sorted(set(kinds))
    )


def likeliest_tokens(model: GPT2LMHeadModel, vocab: int, rng: random.Random) -> list[int]:
    """The reward's targets: the ``TARGETS`` tokens the untrained policy gives the most
    probability after random prompts (chosen apart from the rollouts they score, so the first
    step's reward is not biased upward by the choice). A set, not one token: on the random
    model one token is ~1/512 of the samples, and a batch with no hit gives no gradient."""
    prompts = torch.tensor(
        [[rng.randrange(vocab) for _ in range(PROMPT_TOKENS)] for _ in range(64)]
    )
    with torch.no_grad():
        probs = torch.softmax(model(prompts).logits[:, -1].float(), dim=-1).mean(0)
    return [int(t) for t in probs.topk(TARGETS).indices]


def compare(model: GPT2LMHeadModel, prompts: list[list[int]], outs: list[Any]) -> dict[str, float]:
    """How the engines' log-probabilities of the sampled tokens compare with the trainer's."""
    diffs = []
    with torch.no_grad():
        for prompt, out in zip(prompts, outs, strict=True):
            engine = torch.tensor([lp for lp, *_ in out["meta_info"]["output_token_logprobs"]])
            mine = token_logprobs(model, prompt, out["output_ids"])
            diffs.append(mine.double() - engine.double())
    d = torch.cat(diffs)
    # K3 (Schulman): E_q[r - 1 - log r] with r = p_trainer / p_engine, over the engines' samples.
    k3 = (torch.exp(d) - 1 - d).mean().item()
    return {"mean_abs_logprob_diff": d.abs().mean().item(), "k3_kl": k3, "tokens": d.numel()}


def train_step(
    model: GPT2LMHeadModel,
    optimizer: torch.optim.Optimizer,
    prompts: list[list[int]],
    outs: list[Any],
    targets: set[int],
    max_grad_norm: float,
) -> float:
    """One policy-gradient step on the reward (the targets' share of a completion), split by
    token: each token is credited with the target hits from it to the end (reward to go), less
    the batch's mean at that position (the baseline); the gradient's norm is clipped to
    ``max_grad_norm``."""
    hits = torch.tensor([[float(t in targets) for t in o["output_ids"]] for o in outs])
    togo = (hits / hits.shape[1]).flip(1).cumsum(1).flip(1)
    advantage = togo - togo.mean(0, keepdim=True)
    optimizer.zero_grad()
    logps = torch.stack(
        [token_logprobs(model, p, o["output_ids"]) for p, o in zip(prompts, outs, strict=True)]
    )
    loss = -(advantage * logps).sum() / len(outs)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return float(loss.detach())


def short(metrics: dict[str, float]) -> dict[str, float]:
    """A call's phase times by phase name (``lifecycle/<call>/<phase>_s`` -> ``<phase>_s``)."""
    return {k.rsplit("/", 1)[-1]: v for k, v in metrics.items()}


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6, 5), sharex=True)
    top.plot(steps, [r["reward"] for r in rows], marker="o")
    top.set_ylabel("reward (target share)")
    bottom.plot(steps, [r["mismatch"]["mean_abs_logprob_diff"] for r in rows], marker="o")
    bottom.plot(steps, [r["mismatch"]["k3_kl"] for r in rows], marker="s")
    bottom.set_yscale("symlog", linthresh=1e-9)
    bottom.legend(["mean |logprob diff|", "K3 KL"])
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path)


async def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    model = GPT2LMHeadModel.from_pretrained(args.model, torch_dtype=torch.float32)
    # Plain SGD with a clipped gradient norm, not Adam: Adam's first steps move every weight by
    # about ``lr`` whatever its gradient, noise included, and now and then a step collapsed the
    # policy onto a token that is not a target (its reward then stays 0: no hit, no gradient).
    # Simulated five-step runs (the trainer sampling its own rollouts), reward rise from the
    # first step to the last: Adam at lr 0.05 rose < 0.2 in 1 of 60, at lr 0.1 in 3 of 150;
    # SGD clipped to 0.25 at lr 5 rose >= 0.55 in 250 of 250. A higher lr shows less: at lr
    # 10 the policy was often certain (reward 1.000, every log-probability 0) from the fourth
    # step, and at lr 40 it collapsed in 3 of 60.
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    vocab = model.config.vocab_size
    engines = [launch(args, kind, f"{kind}{i}") for i, kind in enumerate(args.kinds)]
    # Every call's spans are kept for the timeline (four calls a step).
    config = LifecycleConfig(
        verify_weights=True,
        unverified_engines=DeadEnginePolicy(args.unverified),
        timeline_calls=4 * args.steps + 4,
    )
    server = RolloutServer([EngineGroup("actor", engines)], config=config)
    rows: list[dict[str, Any]] = []
    try:
        await asyncio.gather(*(e.start() for e in engines))
        targets = set(likeliest_tokens(model, vocab, rng))
        previous = engines_fingerprint(model, args.kinds)
        version = None
        for step in range(1, args.steps + 1):
            prompts = [
                [rng.randrange(vocab) for _ in range(PROMPT_TOKENS)] for _ in range(args.rollouts)
            ]
            outs = await rollouts(server, prompts, args.tokens)
            rewards = [sum(t in targets for t in o["output_ids"]) / args.tokens for o in outs]
            # SGLang's outputs report their weight version; vLLM's do not, so each engine's
            # own is read as well (vLLM's initial version reads as None: "default").
            versions = sorted({o["meta_info"].get("weight_version") for o in outs} - {None})
            held = [await e.weight_version() or "default" for e in engines]
            # an SGLang output reports its weight version; a vLLM one does not
            kinds = Counter(
                "sglang" if "weight_version" in o["meta_info"] else "vllm" for o in outs
            )
            row: dict[str, Any] = {
                "step": step,
                "reward": sum(rewards) / len(rewards),
                "mismatch": compare(model, prompts, outs),
                "versions": versions,
                "engine_versions": dict(zip((e.label for e in engines), held, strict=True)),
                "rollouts_by_kind": {k: kinds[k] for k in sorted(set(args.kinds))},
                "expected_version": version,
                "phases": {},
            }
            times = row["phases"]
            times["offload"] = short(await server.offload())
            start = time.monotonic()
            row["loss"] = train_step(model, optimizer, prompts, outs, targets, args.max_grad_norm)
            times["train_s"] = time.monotonic() - start
            times["onload_weights"] = short(await server.onload_weights())
            version = f"step-{step}"
            checkpoint = out / "checkpoints" / version
            start = time.monotonic()
            model.save_pretrained(checkpoint, safe_serialization=True)
            expected = engines_fingerprint(model, args.kinds)
            times["save_and_fingerprint_s"] = time.monotonic() - start
            times["update_weights"] = short(
                await server.update_weights(
                    FromDisk(str(checkpoint)),
                    version,
                    expected=expected,
                    # a step whose gradient was zero leaves the weights as they were
                    may_be_noop=expected == previous,
                )
            )
            previous = expected
            times["onload_kv"] = short(await server.onload_kv())
            rows.append(row)
            mm = row["mismatch"]
            print(
                f"step {step}: reward {row['reward']:.3f} | |dlogp| "
                f"{mm['mean_abs_logprob_diff']:.2e} K3 {mm['k3_kl']:.2e} | versions {versions} "
                f"| verify {times['update_weights']['verify_weights_s']:.3f} s",
                flush=True,
            )
        (out / "steps.json").write_text(
            json.dumps({"targets": sorted(targets), "steps": rows}, indent=1)
        )
        server.timeline.export_chrome_trace(out / "timeline.json")
        plot(rows, out / "rl_loop.png")
        first, last = rows[0]["reward"], rows[-1]["reward"]
        print(
            f"rl_loop: {len(rows)} verified steps on {len(engines)} servers "
            f"({', '.join(args.kinds)}), reward {first:.3f} -> {last:.3f}"
        )
        return 0
    finally:
        for engine in engines:
            await engine.close()


def launch(
    args: argparse.Namespace, kind: str, label: str
) -> LaunchedSGLangEngine | LaunchedVLLMEngine:
    """A server of ``kind`` serving the model in float32, on a port of its own."""
    if kind == "vllm":
        return LaunchedVLLMEngine(
            args.model,
            port=free_port(),
            python=args.vllm_python,
            extra_args=[*shlex.split(args.vllm_args), "--dtype", "float32"],
            env=dict(kv.split("=", 1) for kv in args.vllm_env),
            label=label,
        )
    return LaunchedSGLangEngine(
        args.model,
        port=free_port(),
        python=args.sglang_python,
        extra_args=[*shlex.split(args.sglang_args), "--dtype", "float32"],
        env=dict(kv.split("=", 1) for kv in args.sglang_env),
        memory_saver=False,
        label=label,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
