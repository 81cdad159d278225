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
from .config import PENALTIES, inv_temperature
from .errors import DBSError
from .kernels import StepRules
from .kv.prefix_cache import round_up
from .manifest import read_manifest
from .model import load_tokenizer
from .text.constraints import banned_tokens
from .text.occurrence import WordTable, word_table


def torch_sample(logits, uniforms, row_word, dense_boosts, cfg, boost_first, min_p=None, rank=None,
                 temperature=None, top_p=None):
    """logits (R, V) torch float32 (shaped and banned); dense_boosts (W, V) torch or None; each
    row's `temperature` (R,) (0: the kept token of the rank[r]-th largest weight at temperature 1,
    `rank` (R,) as `kernels.StepRules` has it, None: the largest), `top_p` (R,) and `min_p` (R,)
    (None: `cfg`'s). Returns ids, unguided logp."""
    import torch

    temperature, top_p = (np.broadcast_to(np.asarray(own if v is None else v, np.float64), (len(logits),)).copy()
                          for v, own in ((temperature, cfg.temperature), (top_p, cfg.top_p)))
    dev = logits.device
    s = logits.float() * torch.as_tensor(inv_temperature(temperature), dtype=torch.float32, device=dev)[:, None]
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
    kept = plausible
    if (top_p < 1.0).any():              # a row at top_p 1 keeps what min_p keeps
        sorted_key, order = torch.sort(key, dim=-1, descending=True)
        probs = torch.softmax(sorted_key.double(), dim=-1)
        cum = probs.cumsum(-1)
        k = torch.searchsorted(cum, torch.as_tensor(top_p, dtype=cum.dtype, device=dev)[:, None]).clamp(
            max=s.shape[1] - 1)
        cut = torch.where(torch.as_tensor(top_p < 1.0, device=dev)[:, None], sorted_key.gather(1, k), -torch.inf)
        kept = (key >= cut) & plausible
    final = torch.where(bf, key, s + torch.where(kept, boost, torch.zeros_like(boost)))
    w = torch.where(kept, torch.exp((final - s.max(-1, keepdim=True).values).double()), torch.zeros_like(final, dtype=torch.float64))
    c = w.cumsum(-1)
    u = torch.as_tensor(uniforms, dtype=torch.float64, device=dev)[:, None] * c[:, -1:]
    ids = torch.searchsorted(c, u, right=True).clamp(max=s.shape[1] - 1)
    greedy = temperature == 0
    if greedy.any():                     # the greedy rows' ranked likeliest kept tokens
        order = torch.sort(w, dim=-1, descending=True, stable=True).indices     # equal weights: the lower id first
        n = (w > 0).sum(-1, keepdim=True).clamp(min=1)
        r = torch.zeros_like(n) if rank is None else torch.as_tensor(np.asarray(rank), device=dev).reshape(-1, 1)
        ids = torch.where(torch.as_tensor(greedy, device=dev)[:, None], order.gather(1, r % n), ids)
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
        self.static: StaticSteps | None = None     # decode steps on a static cache (`compile`)

    def set_dtype(self, dtype: str) -> None:
        """The model's weights and activations in `dtype` ("float16", "bfloat16" or "float32"), the
        logits still handed to the sampler in float32: the baseline in the engine's dtype."""
        self.model.to(getattr(self.torch, dtype))

    def compile(self, mode: str = "reduce-overhead", backend: str = "inductor") -> None:
        """Decode steps through `torch.compile(mode="reduce-overhead")` (CUDA graphs on a GPU) on a
        static cache (`StaticSteps`): each step's shapes are its bucket's, so a generation compiles
        once per bucket and never falls back to recompiling as the cache grows. The prefill stays
        eager. The first generation compiles and records (run it outside the timing);
        `compile_stats` counts what it did. `backend` "eager": dynamo's capture alone (tests)."""
        self.static = StaticSteps(self.model, self.device)
        self.static.forward = self.torch.compile(self.model.forward, mode=None if backend == "eager" else mode,
                                                 backend=backend, dynamic=False)

    def compile_stats(self) -> dict:
        """torch.compile's counters (graphs compiled, recompiles, graph breaks) since start, and the
        static cache's buckets (rows x cache length) the steps ran at."""
        from torch._dynamo.utils import counters

        out = {group: dict(c) for group, c in counters.items() if group in ("stats", "recompiles", "graph_break")}
        if self.static is not None:
            out["buckets"] = sorted(self.static.shapes)
        return out

    def prefill(self, contexts, reserve: int = 0):
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
        if isinstance(cache, StaticState):
            with t.inference_mode():
                t0 = time.perf_counter()
                logits = self.static.step(cache, tokens)
                if self.device.type == "cuda":
                    t.cuda.synchronize()
                self.graph_seconds += time.perf_counter() - t0
            return logits, cache
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
        if self.static is not None:             # the prefill's cache moves into the static one here
            with self.torch.inference_mode():
                if isinstance(cache, StaticState):
                    return self.static.select(cache, idx)
                return self.static.start(cache, self._mask, idx)
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

    def shape(self, logits, cfg, history, history_start, words, generated_start, penalties=None):
        """Repetition penalty and n-gram bans with transformers' own logits processors, per row
        (rows have different left padding); presence and frequency penalties (OpenAI's, on the
        generated tokens from `generated_start`) and word loops by the kernel's rules, which
        transformers does not have. `penalties`: each row's repetition, presence and frequency
        penalties ((R,) each, `StepRules.per_row`; None: `cfg`'s)."""
        from transformers import (
            NoRepeatNGramLogitsProcessor,
            RepetitionPenaltyLogitsProcessor,
        )

        t = self.torch
        R = logits.shape[0]
        own = (cfg.repetition_penalty, cfg.presence_penalty, cfg.frequency_penalty) if penalties is None else penalties
        rep, presence, frequency = (np.broadcast_to(np.asarray(p, np.float64), (R,)) for p in own)
        ngram = [NoRepeatNGramLogitsProcessor(cfg.no_repeat_ngram_size)] if cfg.no_repeat_ngram_size > 0 else []
        out = logits.clone()
        W = cfg.no_repeat_word_window
        for r in range(R):
            ids = t.as_tensor(history[r, history_start[r]:], dtype=t.long, device=self.device)[None]
            row = out[r:r + 1]
            for p in ([RepetitionPenaltyLogitsProcessor(float(rep[r]))] if rep[r] != 1.0 else []) + ngram:
                row = p(ids, row)
            if presence[r] or frequency[r]:                      # after the repetition penalty, as the kernel
                gen = t.as_tensor(history[r, generated_start[r]:], dtype=t.long, device=self.device)
                count = t.bincount(gen, minlength=row.shape[1]).to(row.dtype)
                row = row - float(frequency[r]) * count - float(presence[r]) * (count > 0).to(row.dtype)
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
        ptr, ids, vals, row_bias = rules.biases(logits.shape[0])
        biased = bool((row_bias >= 0).any())
        if biased:                              # on the raw logits, before the penalties (vLLM's order)
            logits = logits.clone()
            for b in np.unique(row_bias[row_bias >= 0]):         # each set on its rows
                rows = self.torch.as_tensor(np.flatnonzero(row_bias == b), device=self.device)
                cols = self.torch.as_tensor(ids[ptr[b]:ptr[b + 1]].astype(np.int64), device=self.device)
                bias = self.torch.as_tensor(vals[ptr[b]:ptr[b + 1]], device=self.device, dtype=logits.dtype)
                logits[rows[:, None], cols[None, :]] += bias
        shaped = bool(rules.shaped(logits.shape[0]).any())
        if shaped:
            start, gen = rules.starts(logits.shape[0])
            logits = self.shape(logits, cfg, rules.history, start, rules.words, gen,
                                [rules.per_row(n, logits.shape[0]) for n in PENALTIES])
        if rules.bans is not None:
            logits = self.ban(logits, rules.history, rules.history_start, rules.bans, rules.row_ban)
        R = logits.shape[0]
        row_word = np.full(R, -1, np.int32) if rules.row_word is None else np.asarray(rules.row_word)
        if rules.boosts is not None and self._dense_key is not rules.boosts:   # the table on the device, once
            dense = kernels.dense_boosts(*rules.boosts, self.vocab_size, exp=False)
            self._dense, self._dense_key = self.torch.as_tensor(dense, device=self.device), rules.boosts
        with self.torch.inference_mode():
            tok, lp = torch_sample(logits, uniforms, row_word, self._dense, cfg, rules.boost_firsts(R), rules.min_ps(R),
                                   rules.ranks(R), rules.temperatures(R), rules.top_ps(R))
            if rules.force is not None:
                f = self.torch.as_tensor(rules.force, device=self.device)
                tok = self.torch.where(f >= 0, f, tok)
            if shaped or biased or rules.bans is not None or rules.force is not None:
                # the model's own log-prob
                inv_t = self.torch.as_tensor(rules.inv_temperatures(R), device=self.device)[:, None]
                lp = self.torch.log_softmax(raw.float() * inv_t, -1).gather(1, tok[:, None])[:, 0]
        return tok.cpu().numpy().astype(np.int64), lp.float().cpu().numpy()

    def encode(self, text):
        return self.tokenizer.encode(text).ids

    def decode_batch(self, seqs):
        return self.tokenizer.decode_batch([list(map(int, s)) for s in seqs], skip_special_tokens=True)

    def decode_one(self, i):
        return self.tokenizer.decode([i], skip_special_tokens=False)


ROWS_GRANULE = 8            # a static cache's rows round up to this
LENGTH_GRANULE = 64         # and its length, as the engine's CUDA-graph buckets round a context (`kv.buckets`)


class StaticState:
    """A batch's static cache: transformers' `StaticCache` of `rows` x `length` (the bucket), the
    attention mask at the same shape, `live` rows in use (the rest repeat row 0 and are dropped),
    and `at`, the next column to write."""

    def __init__(self, cache, mask, live: int, at: int):
        self.cache, self.mask, self.live, self.at = cache, mask, live, at

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.mask.shape)


class StaticSteps:
    """Decode steps at fixed shapes, as `torch.compile(mode="reduce-overhead")` needs them to compile
    once and replay: the cache is a `StaticCache` whose rows and length round up to a bucket
    (ROWS_GRANULE, LENGTH_GRANULE), written in place at `cache_position`; the mask is a tensor of
    the same shape updated in place; beams are reordered in place. A cache that fills moves into
    the next length bucket (a new shape: one more compilation). Models whose cache has sliding
    layers keep the dynamic cache (`DBSError` names them)."""

    def __init__(self, model, device):
        from transformers import StaticCache

        self.model, self.device, self.forward = model, device, model.forward
        self._StaticCache = StaticCache
        self.shapes: set[tuple[int, int]] = set()
        kinds = {type(layer).__name__ for layer in StaticCache(config=model.config, max_cache_len=8).layers}
        if kinds != {"StaticLayer"}:
            raise DBSError(f"a static cache for {model.config.model_type!r}: its sliding attention layers keep "
                           "transformers' dynamic cache (use the eager baseline)")

    def _alloc(self, rows: int, length: int, template) -> StaticState:
        import torch

        cache = self._StaticCache(config=self.model.config, max_cache_len=length)
        for layer in cache.layers:
            layer.lazy_initialization(template.new_zeros((rows, template.shape[1], 1, template.shape[3])))
        mask = torch.zeros((rows, length), dtype=torch.long, device=self.device)
        return StaticState(cache, mask, 0, 0)

    def start(self, dynamic, mask, idx) -> StaticState:
        """The prefill's dynamic cache and mask, rows `idx`, into a new static cache."""
        n, T = len(idx), mask.shape[1]
        keys = dynamic.layers[0].keys
        st = self._alloc(round_up(n, ROWS_GRANULE), round_up(T + 1, LENGTH_GRANULE), keys)
        full = self._padded(idx, st.mask.shape[0])
        for src, dst in zip(dynamic.layers, st.cache.layers):
            dst.keys[:, :, :T] = src.keys[full]
            dst.values[:, :, :T] = src.values[full]
        st.mask[:, :T] = mask[full]
        st.live, st.at = n, T
        return st

    @staticmethod
    def _padded(idx, rows: int):
        import torch

        return torch.cat([idx, idx[:1].expand(rows - len(idx))]) if rows > len(idx) else idx

    def select(self, st: StaticState, idx) -> StaticState:
        """Rows `idx` of the batch, in place where they fit its rows; else a larger bucket."""
        if len(idx) == 0:                               # every row done: nothing to keep
            st.live = 0
            return st
        if len(idx) > st.mask.shape[0]:
            return self._grow(st, idx, st.mask.shape[1])
        full = self._padded(idx, st.mask.shape[0])
        for layer in st.cache.layers:
            layer.keys.copy_(layer.keys[full])
            layer.values.copy_(layer.values[full])
        st.mask.copy_(st.mask[full])
        st.live = len(idx)
        return st

    def _grow(self, st: StaticState, idx, length: int) -> StaticState:
        """The rows `idx` of `st` in a new static cache of `length` columns (and enough rows)."""
        new = self._alloc(round_up(len(idx), ROWS_GRANULE), length, st.cache.layers[0].keys)
        full = self._padded(idx, new.mask.shape[0])
        T = st.at
        for src, dst in zip(st.cache.layers, new.cache.layers):
            dst.keys[:, :, :T] = src.keys[full, :, :T]
            dst.values[:, :, :T] = src.values[full, :, :T]
        new.mask[:, :T] = st.mask[full, :T]
        new.live, new.at = len(idx), T
        return new

    def step(self, st: StaticState, tokens):
        """One decode step of the live rows' `tokens`: (live, V) float32 logits."""
        import torch

        if st.at == st.mask.shape[1]:                     # full: the next length bucket
            grown = self._grow(st, torch.arange(st.mask.shape[0], device=self.device),
                               st.mask.shape[1] + LENGTH_GRANULE)
            st.cache, st.mask = grown.cache, grown.mask
        rows = st.mask.shape[0]
        ids = torch.zeros((rows, 1), dtype=torch.long, device=self.device)
        ids[:st.live, 0] = torch.as_tensor(tokens, dtype=torch.long, device=self.device)
        ids[st.live:, 0] = ids[0, 0]
        st.mask[:, st.at] = 1
        pos = st.mask.sum(1, keepdim=True) - 1
        self.shapes.add(st.shape)
        out = self.forward(input_ids=ids, attention_mask=st.mask, position_ids=pos, past_key_values=st.cache,
                           cache_position=torch.tensor([st.at], device=self.device), use_cache=True)
        st.at += 1
        # a copy: a replayed CUDA graph writes its next logits over this step's
        return out.logits[:st.live, -1].to(torch.float32, copy=True)
