"""Checkpoints the real vLLM tests serve: copies of the tiny model with their tensors rewritten
(a longer context, other weights), made with the vLLM environment's own torch."""

from __future__ import annotations

import json
from pathlib import Path

from real.checkpoints import rewrite_weights
from real.servers import RealVLLM

#: The key the session's first real vLLM server is started with.
API_KEY = "real-vllm-key-3f9a"


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
