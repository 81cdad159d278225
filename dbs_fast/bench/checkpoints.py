"""Randomly initialised checkpoints with real shapes for speed measurements (no hub needed).

GPT-2 large: GPT2Config(n_layer=36, n_embd=1280, n_head=20) with the real GPT-2 tokenizer
(`../shared/data/gpt2-tokenizer/` or `--tokenizer DIR`): the same cost per step as the real model.

    python -m dbs_fast.bench.checkpoints --out ckpt/gpt2-large-random --tokenizer ../shared/data/gpt2-tokenizer
"""
from __future__ import annotations

import argparse
from pathlib import Path

SHAPES = {
    "gpt2-large": dict(n_layer=36, n_embd=1280, n_head=20),
    "distilgpt2": dict(n_layer=6, n_embd=768, n_head=12),
    "gpt2": dict(n_layer=12, n_embd=768, n_head=12),
}


def make_random_gpt2(out: Path, tokenizer_dir: Path, shape: str = "gpt2-large", seed: int = 0) -> Path:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

    torch.manual_seed(seed)
    tok = GPT2TokenizerFast.from_pretrained(str(tokenizer_dir))
    cfg = GPT2Config(vocab_size=len(tok), n_positions=1024, **SHAPES[shape])
    model = GPT2LMHeadModel(cfg).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer", required=True, help="folder with GPT-2 vocab.json + merges.txt")
    ap.add_argument("--shape", default="gpt2-large", choices=sorted(SHAPES))
    a = ap.parse_args(argv)
    print(make_random_gpt2(Path(a.out), Path(a.tokenizer), a.shape))


if __name__ == "__main__":
    main()
