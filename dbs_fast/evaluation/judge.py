"""An independent judge: a second exported LM that scores generated text with its own tokenizer.

The generator's own perplexity grades itself (DBS's beam selection even optimises it). The judge
is another model (Gemma 3 270M judges SmolLM2, and the other way round): it reads the context
with its own tokenizer (its BOS too, where its tokenizer adds one), then scores every token of
the continuation. Whole sequences go through the ONNX session in batches (no torch), sized so
that the logits of a batch stay under `max_logit_bytes`.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..backend import left_pad
from ..errors import DBSError
from ..model import OnnxModel
from ..scorer import token_logprobs


def perplexity(lp: np.ndarray) -> float:
    """exp(-mean) of log-probs `lp`; nan for none."""
    return float(math.exp(-np.mean(lp))) if len(lp) else float("nan")


def judge_for(generator: str) -> str:
    """The default judge of a generator: the embedded model of the other family."""
    return "default" if str(generator) == "gemma3-270m" else "gemma3-270m"


class Judge:
    def __init__(self, model, generator_dir: Path | None = None, provider: str = "cpu",
                 threads: int | None = None, max_logit_bytes: int = 256 * 1024**2):
        from ..api import resolve_model_dir

        self.name = str(model)
        self.dir = resolve_model_dir(model, row_layout=True)     # the judge reads model.onnx, fp32
        if generator_dir is not None and Path(generator_dir).resolve() == self.dir.resolve():
            raise DBSError(f"the judge {model!r} is the generator itself ({self.dir}): a model grading its own "
                           f"text is not a judge; pick another model (e.g. --judge {judge_for('default')})")
        self.model = OnnxModel(self.dir, provider, threads)
        self.pad = self.model.eos_ids[0] if self.model.eos_ids else 0
        self.max_logit_bytes = max_logit_bytes

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        tok = self.model.tokenizer
        return tok.encode(context).ids, tok.encode(continuation, add_special_tokens=False).ids

    def offsets(self, continuation: str) -> list[tuple[int, int]]:
        """(start, end) characters of each of `continuation`'s tokens, as `encode_pair` cuts it."""
        return self.model.tokenizer.encode(continuation, add_special_tokens=False).offsets

    def token_logprobs(self, pairs) -> list[np.ndarray]:
        """Per (context, continuation): log-probs of the continuation's tokens given what precedes
        them. With no context token (and no BOS) the first continuation token cannot be scored."""
        enc = [self.encode_pair(c, x) for c, x in pairs]
        order = sorted(range(len(enc)), key=lambda i: -(len(enc[i][0]) + len(enc[i][1])))
        out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(enc)
        i = 0
        while i < len(order):
            T = max(1, len(enc[order[i]][0]) + len(enc[order[i]][1]))
            B = max(1, int(self.max_logit_bytes // (T * self.model.vocab_size * 4)))
            part = order[i:i + B]
            i += B
            seqs = [enc[j][0] + enc[j][1] for j in part]
            if max(map(len, seqs)) < 2:
                continue
            ids, mask = left_pad(seqs, self.pad)
            logits, _ = self.model.forward(ids, self.model.empty_cache(len(seqs)), mask)   # (B, T, V)
            width = ids.shape[1]
            for row, j in enumerate(part):
                ctx, cont = enc[j]
                start = width - len(cont)                # first continuation position
                first = max(start, width - len(seqs[row]) + 1)
                if first >= width:
                    continue
                out[j] = token_logprobs(logits[row, first - 1:width - 1], ids[row, first:width])
        return out

    def perplexity(self, pairs) -> list[float]:
        """exp(-mean log-prob) of each continuation under the judge; nan for an empty one."""
        return [perplexity(lp) for lp in self.token_logprobs(pairs)]
