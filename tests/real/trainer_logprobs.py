"""Prints, as JSON, the log-probability a Hugging Face GPT-2 loaded from CHECKPOINT (float32)
gives each of TOKENS after PROMPT, the trainer's side of a comparison with an engine's. Run with
the SGLang environment's interpreter (it has torch and transformers):

    python tests/real/trainer_logprobs.py CHECKPOINT '[prompt ids]' '[token ids]'
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import GPT2LMHeadModel


def main(checkpoint: str, prompt: list[int], tokens: list[int]) -> None:
    model = GPT2LMHeadModel.from_pretrained(checkpoint, torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        found = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    json.dump(found.tolist(), sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]))
