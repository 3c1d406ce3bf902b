"""Prints, as JSON, the fingerprint an engine serving a tiny GPT-2 checkpoint reports,
computed from the checkpoint's tensors with ``rollout_lifecycle.trainer``. Run with an engine
environment's interpreter (it has torch), the repository on ``PYTHONPATH``:

    python tests/real/trainer_fingerprint.py CHECKPOINT sglang|vllm

The layouts are the servers' of this tier: SGLang serves the model in float16 (its CPU
default) and holds GPT-2's ``Conv1D`` weights transposed; vLLM serves it in float32
(``--dtype float32``) under one worker's name prefix, and on a CPU holds no linear weight where
its checksum looks: once packed for the CPU kernels, each ``layer.weight`` is replaced by an
empty tensor (vllm: model_executor/layers/utils.py dispatch_cpu_unquantized_gemm), so those
tensors digest as zero bytes.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from safetensors.torch import load_file

from rollout_lifecycle.contract.fingerprint import SGLANG_SCHEME, VLLM_SCHEME
from rollout_lifecycle.trainer import (
    GPT2_CONV1D_WEIGHTS,
    VLLM_PREFIX,
    emptying,
    fingerprint,
    transposing,
)

LAYOUTS: dict[str, dict[str, Any]] = {
    "sglang": {
        "scheme": SGLANG_SCHEME,
        "dtype": torch.float16,
        "prefix": "",
        "transform": transposing(GPT2_CONV1D_WEIGHTS),
    },
    "vllm": {
        "scheme": VLLM_SCHEME,
        "dtype": torch.float32,
        "prefix": VLLM_PREFIX,
        "transform": emptying(GPT2_CONV1D_WEIGHTS),
    },
}


def main(checkpoint: str, engine: str) -> None:
    tensors = load_file(f"{checkpoint}/model.safetensors")
    layout = LAYOUTS[engine]
    found = fingerprint(tensors, **layout)
    json.dump(found.to_wire(), sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
