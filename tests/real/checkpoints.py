"""Checkpoints for the real tiers, and what the trainer computes of them: copies of the tiny
model with tensors rewritten (made with the engine environment's own torch), and the fingerprint
an engine serving one reports, computed from the checkpoint's tensors by
``rollout_lifecycle.trainer`` in the SGLang environment (``trainer_fingerprint.py``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from real.servers import RealSGLang, RealVLLM

from rollout_lifecycle import Fingerprint

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def rewrite_weights(env: RealSGLang | RealVLLM, folder: Path, change: str) -> str:
    """A copy of ``env``'s model in ``folder`` whose tensors ``t`` (a dict) ``change``
    rewrites."""
    source = env.model
    folder.mkdir(parents=True, exist_ok=True)
    for item in Path(source).iterdir():
        if item.name != "model.safetensors" and item.is_file():
            shutil.copy(item, folder / item.name)
    script = (
        "import sys, torch; from safetensors.torch import load_file, save_file; "
        f"t = load_file(sys.argv[1]); {change}; "
        "save_file({k: v.contiguous() for k, v in t.items()}, sys.argv[2])"
    )
    weights = (f"{source}/model.safetensors", str(folder / "model.safetensors"))
    subprocess.run([env.python, "-c", script, *weights], check=True)
    return str(folder)


def trainer_env() -> dict[str, str]:
    """The environment of a trainer script: this one, with the repository importable."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{path}" if path else str(REPO)}


def trainer_push(trainer: RealSGLang, *args: str) -> subprocess.Popen[str]:
    """``trainer_push.py`` with ``args``, started in the SGLang environment (its pipes open)."""
    return subprocess.Popen(
        [trainer.python, str(HERE / "trainer_push.py"), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=trainer_env(),
    )


#: safetensors' dtype names as torch names them.
DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def tensor_specs(checkpoint: str) -> tuple[list[str], list[str], list[list[int]]]:
    """The names, dtypes and shapes of the weights ``trainer_push.py`` broadcasts from
    ``checkpoint``, in its order (read from the safetensors header)."""
    with open(f"{checkpoint}/model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    names = sorted(n for n in header if n != "__metadata__" and not n.endswith(NOT_WEIGHTS))
    return names, [DTYPES[header[n]["dtype"]] for n in names], [header[n]["shape"] for n in names]


#: GPT-2's attention masks, stored in some checkpoints, which the engines do not load.
NOT_WEIGHTS = (".attn.bias", ".attn.masked_bias")


def trainer_fingerprint(trainer: RealSGLang, checkpoint: str, engine: str) -> Fingerprint:
    """The fingerprint an ``engine`` ("sglang" or "vllm") serving ``checkpoint`` reports, as
    the trainer computes it from the checkpoint file, in the SGLang environment (its torch and
    the library's dependencies: ``ci/sglang-env``)."""
    done = subprocess.run(
        [trainer.python, str(HERE / "trainer_fingerprint.py"), checkpoint, engine],
        check=False,
        capture_output=True,
        text=True,
        env=trainer_env(),
    )
    if done.returncode != 0:
        sys.stderr.write(done.stderr)
        raise RuntimeError(
            f"trainer_fingerprint.py failed ({done.returncode}): {done.stderr[-400:]}"
        )
    return Fingerprint.from_wire(json.loads(done.stdout))


def trainer_logprobs(
    trainer: RealSGLang, checkpoint: str, prompt: list[int], tokens: list[int]
) -> list[float]:
    """The log-probability of each of ``tokens`` after ``prompt`` under ``checkpoint``, as the
    trainer computes it (``trainer_logprobs.py``, float32)."""
    done = subprocess.run(
        [trainer.python, str(HERE / "trainer_logprobs.py"), checkpoint, json.dumps(prompt),
         json.dumps(tokens)],
        check=True,
        capture_output=True,
        text=True,
        env=trainer_env(),
    )  # fmt: skip
    found: list[float] = json.loads(done.stdout)
    return found
