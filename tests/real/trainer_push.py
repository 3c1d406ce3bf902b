"""The trainer's side of a push that is not a checkpoint on disk, run with the SGLang
environment's interpreter (it has torch and sglang), the repository on ``PYTHONPATH``:

    python tests/real/trainer_push.py tensor CHECKPOINT
        prints the checkpoint's tensors as a ``FromTensor`` payload (JSON, one line), made by
        ``rollout_lifecycle.trainer.sglang_tensor_payload``, and keeps their shared memory
        alive until its standard input closes;
    python tests/real/trainer_push.py distributed CHECKPOINT ADDRESS PORT WORLD_SIZE GROUP
        joins the group ``GROUP`` as rank 0 over gloo, as SGLang's engines do when told
        ``init_weights_update_group`` (sglang: ``utils/common.py`` ``init_custom_process_group``),
        broadcasts the checkpoint's tensors in ``tensor_specs`` order, and leaves.
"""

from __future__ import annotations

import json
import sys

import torch
from safetensors.torch import load_file
from sglang.srt.utils.common import init_custom_process_group

from rollout_lifecycle.trainer import sglang_tensor_payload

#: GPT-2's attention masks, stored in some checkpoints, which the engines do not load.
NOT_WEIGHTS = (".attn.bias", ".attn.masked_bias")


def weights(checkpoint: str) -> list[tuple[str, torch.Tensor]]:
    tensors = load_file(f"{checkpoint}/model.safetensors")
    return [(n, tensors[n]) for n in sorted(tensors) if not n.endswith(NOT_WEIGHTS)]


def main(mode: str, checkpoint: str, *group: str) -> None:
    named = weights(checkpoint)
    if mode == "tensor":
        print(json.dumps(sglang_tensor_payload(named)), flush=True)
        sys.stdin.read()
        return
    address, port, world_size, name = group
    pg = init_custom_process_group(
        backend="gloo",
        init_method=f"tcp://{address}:{port}",
        world_size=int(world_size),
        rank=0,
        group_name=name,
    )
    for _, tensor in named:
        torch.distributed.broadcast(tensor.contiguous(), src=0, group=pg)
    torch.distributed.destroy_process_group(pg)


if __name__ == "__main__":
    main(*sys.argv[1:])
