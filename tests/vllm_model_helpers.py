"""Tiny random-weight models of the encoder-only and MLA tests, and one engine run each, as a subprocess.

`python tests/vllm_model_helpers.py embed --model DIR --out FILE`: a BERT-style embedding
model (`runner="pooling"`) embeds ragged prompts in one batch; the per-token hidden
states and the pooled embeddings go to FILE (JSON). Run once with vLLM's own CPU
attention and once with `VLLM_GAUDI_UNIFIED=1`.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys

import vllm_helpers

VOCAB = 512
#: Ragged prompts of one batch: one token, a few, several blocks' worth.
EMBED_LENGTHS = (1, 5, 17, 64, 130, 9, 33)


def make_tiny_bert(path: str, hidden: int = 128, layers: int = 2, heads: int = 4, seed: int = 0) -> str:
    """Save a random-weight BertModel (float32) to `path`; returns `path`."""
    import torch
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=2 * hidden, max_position_embeddings=512, initializer_range=0.05,
                        torch_dtype="float32", architectures=["BertModel"])
    torch.manual_seed(seed)
    BertModel(config).to(torch.float32).save_pretrained(path, safe_serialization=True)
    _save_word_tokenizer(path)  # the pooling entry points need one, though the prompts are token ids
    return path


def _save_word_tokenizer(path: str) -> None:
    """A BERT word-piece tokenizer over `VOCAB` made-up words (no download)."""
    from transformers import BertTokenizerFast

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(VOCAB - 5)]
    vocab = os.path.join(path, "vocab.txt")
    with open(vocab, "w") as f:
        f.write("\n".join(words) + "\n")
    BertTokenizerFast(vocab_file=vocab).save_pretrained(path)


def embed_prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in EMBED_LENGTHS]


def run_embed(model: str, out: str) -> None:
    """Every prompt in one batch, twice: the per-token hidden states (`token_embed`: every row of the
    attention output reaches them) and the pooled, normalised embeddings (`embed`), each engine in
    this process (no engine subprocess)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM
    from vllm.config import PoolerConfig

    prompts = [{"prompt_token_ids": p} for p in embed_prompts()]
    results = {}
    for task in ("token_embed", "embed"):
        llm = LLM(model=model, runner="pooling", enforce_eager=True, dtype="float32", seed=0, max_model_len=512,
                  max_num_seqs=8, max_num_batched_tokens=1024, kv_cache_memory_bytes=64 << 20,
                  pooler_config=PoolerConfig(task=task))
        outs = llm.encode(prompts, pooling_task=task, use_tqdm=False)
        results[task] = [o.outputs.data.tolist() for o in outs]
        del llm
    with open(out, "w") as f:
        json.dump(results, f)


def main(argv=None) -> int:
    vllm_helpers.keep_vllm_gaudi_out()
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("make-bert",):
        sub.add_parser(name).add_argument("path")
    em = sub.add_parser("embed", help="embed the ragged prompts with one engine")
    em.add_argument("--model", required=True)
    em.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.cmd == "make-bert":
        make_tiny_bert(args.path)
    else:
        run_embed(args.model, args.out)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
