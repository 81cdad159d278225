"""The PyTorch baseline: the same scheduler over a transformers model with its KV cache and a
torch sampler (sort-based top-p), so speed is compared on identical work. Needs the export extra.

With the same uniforms it draws the same tokens as the Numba kernel (same kept set, same
inverse CDF in id order), up to float noise in the logits of the two runtimes.
"""
from __future__ import annotations

import math
import time
from functools import cached_property

import numpy as np

from . import kernels
from .backend import left_pad
from .errors import DBSError
from .kernels import StepRules
from .manifest import read_manifest
from .model import load_tokenizer
from .text.constraints import banned_tokens
from .text.occurrence import WordTable, word_table


def torch_sample(logits, uniforms, row_word, dense_boosts, cfg, boost_first, min_p=None):
    """logits (R, V) torch float32 (shaped and banned); dense_boosts (W, V) torch or None; `cfg`'s
    temperature and top_p; `min_p` (R,) each row's (None: `cfg`'s). Returns ids, unguided logp."""
    import torch

    top_p = cfg.top_p
    s = logits.float() / cfg.temperature
    dev = s.device
    logp = torch.log_softmax(s, dim=-1)
    guided = torch.as_tensor(row_word >= 0, device=dev)
    boost = torch.zeros_like(s)
    if dense_boosts is not None and bool(guided.any()):
        boost[guided] = dense_boosts[torch.as_tensor(row_word[row_word >= 0], dtype=torch.long, device=dev)]
    bf = torch.as_tensor(np.asarray(boost_first, bool), device=dev).reshape(-1, 1)    # one flag, or one per row
    key = torch.where(bf, s + boost, s)
    plausible = torch.ones_like(s, dtype=torch.bool)
    min_p = np.full(len(s), cfg.min_p) if min_p is None else np.asarray(min_p, np.float64)
    if (min_p > 0).any():                # the model's own probability against its top token's, before boosts
        floor = torch.as_tensor([math.log(p) if p > 0 else -math.inf for p in min_p], dtype=s.dtype, device=dev)
        plausible = s - s.max(-1, keepdim=True).values >= floor[:, None]
        key = torch.where(plausible, key, -torch.inf)
    if top_p < 1.0:
        sorted_key, order = torch.sort(key, dim=-1, descending=True)
        probs = torch.softmax(sorted_key.double(), dim=-1)
        cum = probs.cumsum(-1)
        k = torch.searchsorted(cum, torch.full((s.shape[0], 1), top_p, dtype=cum.dtype, device=dev)).clamp(
            max=s.shape[1] - 1)
        cut = sorted_key.gather(1, k)
        kept = (key >= cut) & plausible
    else:
        kept = plausible
    final = torch.where(bf, key, s + torch.where(kept, boost, torch.zeros_like(boost)))
    w = torch.where(kept, torch.exp((final - s.max(-1, keepdim=True).values).double()), torch.zeros_like(final, dtype=torch.float64))
    c = w.cumsum(-1)
    u = torch.as_tensor(uniforms, dtype=torch.float64, device=dev)[:, None] * c[:, -1:]
    ids = torch.searchsorted(c, u, right=True).clamp(max=s.shape[1] - 1)
    return ids[:, 0], logp.gather(1, ids)[:, 0]


class TorchBackend:
    """`device`: "cpu", or "cuda" (the model, its cache and the sampler on the GPU; the drawn ids
    come to the host for the scheduler), as `provider` picks it for the ONNX engine."""

    name = "torch"
    computed = None                  # every row of a step is a model row

    def __init__(self, model_dir, threads: int | None = None, device: str = "cpu"):
        try:
            import torch

            from .export.source import load_torch_model, resolve
        except ImportError as e:
            raise DBSError(f"--backend torch needs the export extra: pip install 'dbs-fast[export]' ({e})") from None
        if threads:
            torch.set_num_threads(threads)
        self.torch = torch
        m = read_manifest(model_dir)
        if device != "cpu" and not torch.cuda.is_available():
            raise DBSError(f"--backend torch on {device!r}: this torch build sees no GPU")
        self.device = torch.device(device)
        self.graph_seconds = 0.0       # inside the model's forward at decode steps
        self.model, _ = load_torch_model(resolve(m["source"]))
        self.model.to(self.device)
        self.tokenizer = load_tokenizer(str(model_dir / "tokenizer.json"))
        self.vocab_size = m["vocab_size"]
        self.eos_ids = tuple(m.get("eos_token_ids", []))
        self.pad_id = self.eos_ids[0] if self.eos_ids else 0
        self.max_positions = m.get("max_positions")
        self._dense = None
        self._dense_key = None
        self._mask = None

    def set_dtype(self, dtype: str) -> None:
        """The model's weights and activations in `dtype` ("float16", "bfloat16" or "float32"), the
        logits still handed to the sampler in float32: the baseline in the engine's dtype."""
        self.model.to(getattr(self.torch, dtype))

    def compile(self) -> None:
        """The model's forward through `torch.compile(mode="reduce-overhead")` (CUDA graphs), sizes
        dynamic so that a growing cache does not recompile at every step; the first generation
        compiles and records (run it outside the timing), `compile_stats` counts what it did."""
        self.model.forward = self.torch.compile(self.model.forward, mode="reduce-overhead", dynamic=True)

    def compile_stats(self) -> dict:
        """torch.compile's counters (graphs compiled, recompiles, graph breaks) since start."""
        from torch._dynamo.utils import counters

        return {group: dict(c) for group, c in counters.items() if group in ("stats", "recompiles", "graph_break")}

    def prefill(self, contexts):
        ids, mask = left_pad(contexts, self.pad_id)
        t = self.torch
        self._mask = t.from_numpy(mask).to(self.device)
        with t.inference_mode():
            pos = (self._mask.cumsum(1) - 1).clamp(min=0)
            out = self.model(input_ids=t.from_numpy(ids).to(self.device), attention_mask=self._mask, position_ids=pos,
                             use_cache=True)
        return out.logits[:, -1].float(), out.past_key_values

    def step(self, tokens, cache, need=None):
        """The plain schedule: every row, whatever `need` says (the reference the others are measured by)."""
        t = self.torch
        self._mask = t.cat([self._mask, t.ones((self._mask.shape[0], 1), dtype=self._mask.dtype, device=self.device)], 1)
        with t.inference_mode():
            pos = self._mask.sum(1, keepdim=True) - 1
            ids = t.as_tensor(tokens, dtype=t.long, device=self.device)[:, None]
            t0 = time.perf_counter()
            out = self.model(input_ids=ids, attention_mask=self._mask, position_ids=pos, past_key_values=cache,
                             use_cache=True)
            if self.device.type == "cuda":      # the kernels' time, not their launch (the logits are read next)
                t.cuda.synchronize()
            self.graph_seconds += time.perf_counter() - t0
        return out.logits[:, -1].float(), out.past_key_values

    def select(self, cache, idx):
        idx = self.torch.as_tensor(idx, dtype=self.torch.long, device=self.device)
        cache.reorder_cache(idx)
        self._mask = self._mask[idx]
        return cache

    def take(self, x, idx):
        return x[self.torch.as_tensor(idx, dtype=self.torch.long, device=self.device)]

    def concat(self, a, b):
        raise DBSError("the PyTorch baseline decodes fixed batches: requests cannot join a running one "
                       "(use the onnx backend)")

    merge = concat

    def release(self):
        """Nothing binds the cache between runs."""

    def gather(self, logits, cache, idx):
        return self.take(logits, idx), self.select(cache, idx)

    def join(self, logits, cache, new_logits, new_cache):
        return self.concat(logits, new_logits), self.merge(cache, new_cache)

    def feed(self, tokens, cache):
        raise DBSError("the PyTorch baseline is a generator, not a second-LM scorer")

    @staticmethod
    def trim(cache):
        return cache

    def shape(self, logits, cfg, history, history_start, words):
        """Repetition penalty and n-gram bans with transformers' own logits processors, per row
        (rows have different left padding); word loops by the kernel's rule, which transformers
        does not have."""
        from transformers import (
            NoRepeatNGramLogitsProcessor,
            RepetitionPenaltyLogitsProcessor,
        )

        t = self.torch
        procs = ([RepetitionPenaltyLogitsProcessor(cfg.repetition_penalty)] if cfg.repetition_penalty != 1.0 else []) \
            + ([NoRepeatNGramLogitsProcessor(cfg.no_repeat_ngram_size)] if cfg.no_repeat_ngram_size > 0 else [])
        out = logits.clone()
        W = cfg.no_repeat_word_window
        for r in range(out.shape[0]):
            ids = t.as_tensor(history[r, history_start[r]:], dtype=t.long, device=self.device)[None]
            row = out[r:r + 1]
            for p in procs:
                row = p(ids, row)
            out[r] = row[0]
            if W:
                banned = kernels.word_loop_tokens(history[r].astype(np.int64), int(history_start[r]), history.shape[1],
                                                  *words, W)
                out[r, t.as_tensor(banned, device=self.device)] = -float("inf")
        return out

    @cached_property
    def words(self) -> WordTable:
        """The vocabulary's words, for the word-loop rule (`occurrence.word_table`)."""
        return word_table(self.decode_one, self.vocab_size)

    def ban(self, logits, history, history_start, bans, row_ban):
        """Banned sequences per row, by `constraints.banned_tokens` (the kernel's rule); a group's
        one-token sequences (tens of thousands under token healing) by one index per row."""
        gptr, sptr, stok = bans
        out = logits.clone()
        for r, g in enumerate(row_ban):
            if g < 0:
                continue
            q = np.arange(gptr[g], gptr[g + 1])
            one = sptr[q + 1] - sptr[q] == 1
            out[r, self.torch.as_tensor(stok[sptr[q[one]]].astype(np.int64), device=out.device)] = -float("inf")
            h = None if history is None else history[r, history_start[r]:]
            for t in banned_tokens(h, [stok[sptr[i]:sptr[i + 1]] for i in q[~one]]):
                out[r, t] = -float("inf")
        return out

    def sample(self, logits, uniforms, rules: StepRules):
        cfg = rules.config
        raw = logits
        if cfg.shapes_logits:
            logits = self.shape(logits, cfg, rules.history, rules.history_start, rules.words)
        if rules.bans is not None:
            logits = self.ban(logits, rules.history, rules.history_start, rules.bans, rules.row_ban)
        R = logits.shape[0]
        row_word = np.full(R, -1, np.int32) if rules.row_word is None else np.asarray(rules.row_word)
        if rules.boosts is not None and self._dense_key is not rules.boosts:   # the table on the device, once
            dense = kernels.dense_boosts(*rules.boosts, self.vocab_size, exp=False)
            self._dense, self._dense_key = self.torch.as_tensor(dense, device=self.device), rules.boosts
        with self.torch.inference_mode():
            tok, lp = torch_sample(logits, uniforms, row_word, self._dense, cfg, rules.boost_firsts(R), rules.min_ps(R))
            if rules.force is not None:
                f = self.torch.as_tensor(rules.force, device=self.device)
                tok = self.torch.where(f >= 0, f, tok)
            if cfg.shapes_logits or rules.bans is not None or rules.force is not None:   # the model's own log-prob
                lp = self.torch.log_softmax(raw.float() / cfg.temperature, -1).gather(1, tok[:, None])[:, 0]
        return tok.cpu().numpy().astype(np.int64), lp.float().cpu().numpy()

    def encode(self, text):
        return self.tokenizer.encode(text).ids

    def decode_batch(self, seqs):
        return self.tokenizer.decode_batch([list(map(int, s)) for s in seqs], skip_special_tokens=True)

    def decode_one(self, i):
        return self.tokenizer.decode([i], skip_special_tokens=False)
