"""Builds the real-SGLang tier's model: a random 2-layer GPT-2 and a byte-level BPE tokenizer
trained here on generated text, so no model hub is needed. Run with SGLang's interpreter:

    python tests/real/tiny_model.py OUT_DIR

GPT-2 because it has no rotary embeddings: on a CPU, SGLang's rotary embedding falls back to a
custom op that is not there. The weights are random, so the text is noise; tests ask for
``ignore_eos`` and count tokens.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

EOS = "<|endoftext|>"
VOCAB = 512
SEED = 20261123


def corpus(lines: int = 4000) -> list[str]:
    """Deterministic pseudo-English: enough variety for a BPE vocabulary of ``VOCAB``."""
    rng = random.Random(SEED)
    syllables = ["ro", "ll", "out", "en", "gi", "ne", "pa", "use", "fl", "ush", "re", "lea", "se"]
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(600)]
    return [" ".join(rng.choices(words, k=rng.randint(4, 16))) + "." for _ in range(lines)]


def main(out: Path) -> None:
    torch.manual_seed(SEED)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        corpus(),
        trainers.BpeTrainer(
            vocab_size=VOCAB,
            special_tokens=[EOS],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token=EOS, eos_token=EOS, unk_token=EOS
    )
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=2048,
        n_embd=64,
        n_layer=2,
        n_head=2,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        torch_dtype="float32",
    )
    model = GPT2LMHeadModel(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    print(f"tiny model: {sum(p.numel() for p in model.parameters())} parameters in {out}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/real/tiny_model.py OUT_DIR")
    main(Path(sys.argv[1]))
