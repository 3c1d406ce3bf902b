"""Checkpoints the real vLLM tests serve: copies of the tiny model with their tensors rewritten
(a longer context, other weights), made with the vLLM environment's own torch."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from real.servers import RealVLLM

#: The key the session's first real vLLM server is started with.
API_KEY = "real-vllm-key-3f9a"


def rewrite_weights(env: RealVLLM, folder: Path, change: str) -> str:
    """A copy of ``env``'s model in ``folder`` whose tensors ``t`` (a dict) ``change``
    rewrites."""
    source = env.model
    for item in Path(source).iterdir():
        if item.name != "model.safetensors":
            shutil.copy(item, folder / item.name)
    script = (
        "import sys, torch; from safetensors.torch import load_file, save_file; "
        f"t = load_file(sys.argv[1]); {change}; "
        "save_file({k: v.contiguous() for k, v in t.items()}, sys.argv[2])"
    )
    weights = (f"{source}/model.safetensors", str(folder / "model.safetensors"))
    subprocess.run([env.python, "-c", script, *weights], check=True)
    return str(folder)


def long_model(env: RealVLLM, folder: Path) -> str:
    """The tiny model with its 2,048 position embeddings repeated to 8,192, so a request can
    decode for seconds: at ~500 tokens/s here, one that ends within 2,048 tokens can finish
    before a control call gets through the busy server."""
    path = rewrite_weights(
        env,
        folder,
        "t['transformer.wpe.weight'] = t['transformer.wpe.weight'].repeat(4, 1)",
    )
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "n_positions": 8192}))
    return path
