"""The Python API: `DirectedBeamSearch(model, embeddings, config).generate(context, keywords)`."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .backend import SCHEDULES, OnnxBackend, onnx_backend
from .config import SEED_MAX, DBSConfig
from .errors import DBSError, naming
from .home import EMBEDDED_DIRS, embedded_model_dir
from .kv.decoder import ContextStore, PrefixDecoder
from .kv.prefix_cache import DECODE_GRAPH, KV_LAYOUTS
from .manifest import current_export, read_manifest, window_unmasked
from .model import OnnxModel, load_tokenizer
from .numba_runtime import set_threads
from .scorer import OnnxScorer, SelfScorer
from .search.beam import BeamSearch, Finished, Request, certain_text
from .search.result import GenerationResult, build_result, json_safe  # noqa: F401  (json_safe: part of the API)
from .text import constraints, occurrence, openings, prompt
from .text.chat import ChatTemplate
from .text.embeddings import Embeddings, SimilarityTable

MAX_KEYWORDS = 62           # one bit each in the scheduler's int64 masks
_START_TOKENS = ("<|endoftext|>", "<bos>", "<s>")   # a plain-text context starts a document with one
_EMB_CACHE: dict[str, Embeddings] = {}


def resolve_model_dir(model: str | Path, quiet: bool = True) -> Path:
    if str(model) in EMBEDDED_DIRS:
        d = embedded_model_dir(str(model))
        current = current_export(d)
        manifest = read_manifest(d) if current else {}
        if current and (manifest.get("prefix_decode") or {}).get("written", True) and not window_unmasked(manifest):
            return d
        try:
            from .export.convert import ensure_embedded
        except ImportError as e:
            if current:          # without its decode graph, on the row layout
                return d
            raise DBSError(f"the embedded model {model!r} is exported on first use, which needs the export "
                           f"extra: pip install 'dbs-fast[export]' (missing: {e.name})") from None
        return ensure_embedded(str(model), quiet=quiet)
    p = Path(model).expanduser()
    if not p.is_dir():
        raise DBSError(f"model directory not found: {model} (export one with `dbs-fast export`)")
    return p


def parse_constraints(keywords, ban=None):
    """(keywords, banned words) parsed from the constraint syntax (`dbs_fast.text.constraints`) and
    checked against each other; DBSError names what is wrong."""
    with naming("keywords", keywords):
        kws = constraints.parse_keywords(keywords)
    if len(kws) > MAX_KEYWORDS:
        raise DBSError(f"at most {MAX_KEYWORDS} keywords, got {len(kws)}", "keywords", keywords)
    with naming("ban", ban):
        bans = [] if ban is None else constraints.parse_keywords(ban, what="banned word")
        constraints.check_bans(kws, bans, ban)
    return kws, bans


def available_memory() -> int:
    """Bytes this machine can still give (MemAvailable; total memory where /proc is missing)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_needed(cfg: DBSConfig, context_tokens: int, manifest: dict) -> int:
    """Bytes a request at `cfg` needs at least: the logits of its rows (held three times over: the
    pending ones, the model's output buffer, the kernel's work) and a KV cache of one row per
    candidate over the whole text (the row layout; the prefix cache holds less)."""
    rows = cfg.beams * cfg.candidates
    per_token = 2 * manifest["num_layers"] * manifest["num_kv_heads"] * manifest["head_dim"] * 4
    return 3 * rows * manifest["vocab_size"] * 4 + rows * (context_tokens + cfg.max_new_tokens) * per_token


def decode_window(manifest: dict, kv_layout: str = "auto") -> int | None:
    """The tokens the decode graph attends to when the model's layers slide a window (Gemma's
    local layers) that the graph does not mask (an export older than the masked window), on the
    layout `kv_layout` picks; None: no limit."""
    unmasked = window_unmasked(manifest) and kv_layout != "rows"
    return manifest["prefix_decode"]["sliding_window"] if unmasked else None


def check_size(cfg: DBSConfig, context_tokens: int, manifest: dict, window: int | None = None) -> None:
    """DBSError, before anything is allocated, for a request longer than the model's context window
    (or than `window`, `decode_window`'s) or larger than this machine's free memory (`manifest`:
    the export's)."""
    if window and context_tokens + cfg.max_new_tokens > window:
        raise DBSError(f"context ({context_tokens} tokens) + max_new_tokens ({cfg.max_new_tokens}) exceeds the "
                       f"{window} tokens of this model's sliding attention window, which its shared-context "
                       f"decode graph does not slide: use --kv-layout rows for longer texts", "context")
    limit = manifest.get("max_positions")
    if limit and context_tokens + cfg.max_new_tokens > limit:
        field = "max_new_tokens" if cfg.max_new_tokens >= limit else "context"
        raise DBSError(f"context ({context_tokens} tokens) + max_new_tokens ({cfg.max_new_tokens}) exceeds "
                       f"the model's context window of {limit} tokens", field,
                       cfg.max_new_tokens if field == "max_new_tokens" else None)
    need, free = memory_needed(cfg, context_tokens, manifest), available_memory()
    if need > free:
        field = "beams" if cfg.beams >= cfg.candidates else "candidates"
        raise DBSError(f"beams x candidates = {cfg.beams} x {cfg.candidates} rows of {manifest['vocab_size']} "
                       f"logits and their KV cache over {context_tokens + cfg.max_new_tokens} tokens need about "
                       f"{need / 2**30:.1f} GiB; this machine has {free / 2**30:.1f} GiB free: lower --beams, "
                       f"--candidates or --max-new-tokens", field, getattr(cfg, field))


def preflight(model, cfg: DBSConfig, context: str, quiet: bool = True, kv_layout: str = "auto") -> None:
    """`check_size` from the export's manifest and tokenizer alone, before the model loads (the
    CLI's check: a bad size fails in a second, not after loading a model)."""
    d = resolve_model_dir(model, quiet)
    n = len(load_tokenizer(str(d / "tokenizer.json")).encode(context or "").ids) if isinstance(context, str) else 0
    manifest = read_manifest(d)
    check_size(cfg, max(n, 1), manifest, decode_window(manifest, kv_layout))


class DirectedBeamSearch:
    """Built once per (model, embeddings, scorer); `generate` / `generate_batch` many times."""

    def __init__(self, model: str | Path = "default", embeddings: str = "default",
                 config: DBSConfig | None = None, scorer: str = "self", backend: str = "onnx",
                 provider: str = "cpu", threads: int | None = None, subword_fallback: bool = False,
                 quiet: bool = True, kv_layout: str = "auto", context_cache_mb: int = 256,
                 schedule: str = "distinct"):
        if schedule not in SCHEDULES:
            raise DBSError(f"`schedule` must be one of {SCHEDULES}, got {schedule!r}", "schedule", schedule)
        self.config, self.schedule = config or DBSConfig(), schedule
        self.model_dir = resolve_model_dir(model, quiet)
        self.manifest = read_manifest(self.model_dir)
        set_threads(threads, sleep_when_idle=backend != "torch")
        self.decoder = None
        if backend == "onnx":
            self.decoder = self._decoder(self.model_dir, kv_layout, provider, threads)
            if self.decoder is not None and context_cache_mb:      # prefilled contexts kept across requests
                self.decoder.store = ContextStore(context_cache_mb * 2**20)
            self.backend = OnnxBackend(OnnxModel(self.model_dir, provider, threads, lazy=self.decoder is not None))
        elif backend == "torch":
            from .torch_backend import TorchBackend

            self.backend = TorchBackend(self.model_dir, threads, device="cuda" if provider == "cuda" else "cpu")
        else:
            raise DBSError(f"`backend` must be onnx or torch, got {backend!r}")
        if embeddings not in _EMB_CACHE:
            _EMB_CACHE[embeddings] = Embeddings.load(embeddings)
        self.table = SimilarityTable.for_tokenizer(self.backend.decode_one, self.backend.vocab_size,
                                                   _EMB_CACHE[embeddings])
        self.subword_fallback = self._subwords if subword_fallback else None
        self._sentence_end = None
        self._word_piece = None
        self._special = self._token_texts = None
        self._chat = False     # the chat template, read on first use (None: the export has none)
        self.scorer_name = scorer
        self.scorer = self._make_scorer(scorer, provider, threads, kv_layout)

    @property
    def sentence_end(self) -> np.ndarray:
        """(V,) bool: tokens that end a sentence (built on first use of stop="sentence")."""
        if self._sentence_end is None:
            self._sentence_end = occurrence.sentence_end_tokens(self.backend.decode_one, self.backend.vocab_size)
        return self._sentence_end

    @property
    def word_piece(self) -> np.ndarray:
        """(V,) bool: tokens that continue a word, the WORD_PIECE tokens of the backend's word table
        (`occurrence.word_table`), which the word-loop rule reads too: the vocabulary is decoded
        once for both (built on first use)."""
        if self._word_piece is None:
            self._word_piece = self.backend.words.word_class == occurrence.WORD_PIECE
        return self._word_piece

    def _pieces(self, text: str) -> list[int]:
        """Tokens of a piece of running text (no BOS or other special tokens)."""
        return self.backend.tokenizer.encode(text, add_special_tokens=False).ids

    def _subwords(self, word: str) -> list[int]:
        return self._pieces(" " + word)

    @staticmethod
    def _decoder(model_dir: Path, kv_layout: str, provider, threads):
        """The decode graph (decode.onnx, `export/prefix_graph.py`), or None for the row layout."""
        if kv_layout not in KV_LAYOUTS:
            raise DBSError(f"`kv_layout` must be one of {KV_LAYOUTS}, got {kv_layout!r}")
        path = model_dir / DECODE_GRAPH
        if kv_layout == "rows" or (kv_layout == "auto" and not path.is_file()):
            return None
        if not path.is_file():
            raise DBSError(f"kv_layout 'prefix' needs {path} (re-export the model with this version)")

        return PrefixDecoder(path, provider, threads)

    def _make_scorer(self, scorer: str, provider, threads, kv_layout: str):
        """`self`, or a second exported LM whose cache takes the same layout rule as the generator's."""
        if scorer == "self":
            return SelfScorer()

        model_dir = resolve_model_dir(scorer)
        decoder = self._decoder(model_dir, kv_layout, provider, threads)
        return OnnxScorer(OnnxModel(model_dir, provider, threads, lazy=decoder is not None), self.backend.tokenizer,
                          decoder)

    def generate(self, context: str, keywords, seed: int = 0, config: DBSConfig | None = None,
                 progress=None, ban=None) -> GenerationResult:
        return self.generate_batch([(context, keywords)], seeds=[seed], config=config, progress=progress,
                                   bans=[ban])[0]

    @property
    def special_ids(self) -> frozenset:
        """The tokenizer's special tokens (document and turn markers, ...)."""
        if self._special is None:
            added = self.backend.tokenizer.get_added_tokens_decoder()
            self._special = frozenset(i for i, t in added.items() if t.special)
        return self._special

    @property
    def token_texts(self) -> constraints.TokenTexts:
        """Every token's text, sorted, for token healing (built on first use)."""
        if self._token_texts is None:
            self._token_texts = constraints.TokenTexts(self.backend.decode_one, self.backend.vocab_size,
                                                       self.special_ids)
        return self._token_texts

    @property
    def chat_template(self) -> ChatTemplate | None:
        if self._chat is False:
            self._chat = ChatTemplate.of(self.model_dir)
        return self._chat

    def _prompted_ids(self, context: str, kws, cfg: DBSConfig) -> tuple[list[int], bool]:
        """The tokens the model reads: the hidden prompt of `cfg.prompt_style` (`dbs_fast.text.prompt`),
        then the context; and whether the context's end may be healed (a plain-text context of
        its own, not empty)."""
        if not isinstance(context, str):
            raise DBSError(f"the context must be a string, got {context!r}", "context", context)
        text = prompt.prompt_text(cfg.prompt_style, kws, context, self.chat_template, cfg.shots)
        if not text:
            return self._context_ids(context)
        head, _ = self._context_ids(text)          # a chat template frames itself
        ctx = self._pieces(context) if context else []
        return head + ctx, bool(ctx) and ctx[0] not in self.special_ids

    def _context_ids(self, context: str) -> tuple[list[int], bool]:
        """The context's tokens as the model reads a document, its document-start token then the
        text, and True; a context that starts with a special token (a rendered chat template)
        frames itself: its tokens as they are, and False."""
        ids = self._pieces(context) if context else []
        if ids and ids[0] in self.special_ids:
            return ids, False
        start = [i for i in (self.backend.tokenizer.token_to_id(t) for t in _START_TOKENS) if i in self.special_ids]
        if not (start or ids):
            raise DBSError("the context encodes to no tokens: give some text, e.g. --context \"It is\"",
                           "context", context)
        return start[:1] + ids, True

    def _heal(self, ids: list[int], cfg: DBSConfig, forced_tokens: int, ban_seqs) -> constraints.Healing | None:
        """Token healing of a plain-text context (`cfg.heal`), where the budget leaves room for
        the token that re-writes the context's end (with `guarantee`, besides the keywords) and
        the bans leave one that can."""
        if not cfg.heal or ids[-1] in self.special_ids:
            return None
        if cfg.guarantee and forced_tokens >= cfg.max_new_tokens:
            return None
        banned = [b[0] for b in ban_seqs if len(b) == 1]
        return self.token_texts.heal(ids, self.backend.decode_one(ids[-1]), banned)

    def request(self, context, keywords, ban=None, seed: int = 0, config: DBSConfig | None = None) -> Request:
        """One request with its constraints tokenised and its boosts built; DBSError names what
        is wrong (the service's and the CLI's validation)."""
        cfg = config or self.config
        if not (isinstance(seed, (int, np.integer)) and not isinstance(seed, bool) and 0 <= seed <= SEED_MAX):
            raise DBSError(f"`seed` must be an integer in 0..{SEED_MAX}, got {seed!r}", "seed", seed)
        kws, bans = parse_constraints(keywords, ban)
        ids, plain = self._prompted_ids(context, kws, cfg)
        check_size(cfg, len(ids), self.manifest, decode_window(self.manifest) if self.decoder is not None else None)
        enc = self._pieces
        force = [constraints.keyword_tokens(enc, k)[0] for k in kws]
        for k, f in zip(kws, force):
            if len(f) > cfg.max_new_tokens:
                raise DBSError(f"keyword {k.text!r} takes {len(f)} tokens, more than max_new_tokens "
                               f"({cfg.max_new_tokens})", "keywords", keywords)
        if cfg.guarantee and sum(map(len, force)) > cfg.max_new_tokens:
            raise DBSError(f"--guarantee: the keywords take {sum(map(len, force))} tokens, more than "
                           f"max_new_tokens ({cfg.max_new_tokens}) can hold; raise it or give fewer keywords",
                           "keywords", keywords)
        phrases = [(i, head, whole) for i, k in enumerate(kws)
                   for head, whole in constraints.phrase_starts(enc, k, words=cfg.complete_words)]
        allowed = ~self.word_piece if cfg.boost_word_starts else None
        with naming("keywords", keywords):                   # a word the embeddings lack
            boosts = [constraints.keyword_boost(self.table, k, cfg.lam, cfg.boost_cutoff, self.subword_fallback,
                                                lenient=cfg.guarantee, allowed=allowed,
                                                own=constraints.first_tokens(enc, k) if cfg.complete_words else ())
                      for k in kws]
        ban_seqs = constraints.ban_sequences(enc, bans)
        heal = self._heal(ids, cfg, sum(map(len, force)), ban_seqs) if plain else None
        req_ids = heal.context_ids if heal else ids
        return Request(req_ids, kws, int(seed), boosts, force, phrases, ban_seqs, context, heal=heal,
                       openings=self._openings(context, kws, cfg, len(ids) - len(req_ids)) if plain else [])

    def _openings(self, context: str, kws, cfg: DBSConfig, healed: int) -> list[tuple]:
        """The token sequences of `cfg.openings`' phrases after `context` (from the token the healing
        re-writes, if any), each as the context and the phrase tokenise together; a phrase that
        would change the context's own tokens is left out."""
        if cfg.openings == "none":
            return []
        ctx = self._pieces(context)
        keep = len(ctx) - healed
        out = []
        for phrase in openings.subject_phrases([k.text for k in kws], cfg.opened_rows):
            ids = self._pieces(openings.opening_text(context, phrase))
            if ids[:keep] == ctx[:keep] and len(ids) > keep:
                out.append(tuple(ids[keep:]))
        return out

    def prefill_left(self, request: Request) -> int:
        """Context tokens that `request`'s admission would prefill now (all but what the context
        store holds; 0 where nothing can be prefilled ahead)."""
        return 0 if self.decoder is None else self.decoder.prefill_left(request.context_ids)

    def prefill_ahead(self, request: Request) -> bool:
        """Prefill one more slice of `request`'s context into the context store, so that a long
        context joins a running batch in pieces between its chunks; False when the store cannot
        keep it (admit it whole then)."""
        m = self.backend.model
        return self.decoder.prefill_ahead(request.context_ids, m.kv_heads, m.head_dim)

    def batch(self, config: DBSConfig | None = None, progress=None) -> "Batch":
        """An empty running batch that requests can join and leave between chunks."""
        return Batch(self, config or self.config, progress)

    def generate_batch(self, requests, seeds=None, config: DBSConfig | None = None,
                       progress=None, bans=None) -> list[GenerationResult]:
        """Many (context, keywords) requests decoded as one batch of rows; `bans`: per request,
        banned words (comma-separated or a list) or None."""
        cfg = config or self.config
        seeds = list(seeds) if seeds is not None else list(range(len(requests)))
        bans = list(bans) if bans is not None else [None] * len(requests)
        reqs = [self.request(context, keywords, ban, seed, cfg)
                for (context, keywords), ban, seed in zip(requests, bans, seeds)]
        batch = self.batch(cfg, progress)
        batch.admit(reqs)
        return batch.run()

    def beam_search(self, cfg: DBSConfig, progress=None) -> BeamSearch:
        """An empty scheduler for `cfg` on this model: on the prefix cache where the export has a
        decode graph, else on one cache row per candidate."""
        be = self.backend
        if self.decoder is not None:
            be = onnx_backend(self.backend.model, self.decoder, cfg, self.schedule)
        return BeamSearch(be, self.scorer, cfg, (), progress,
                          self.sentence_end if cfg.needs_sentence_ends else None,
                          self.word_piece if cfg.guarantee or cfg.boost_word_starts else None)

class Batch:
    """A running batch of one config (continuous batching): `admit` requests between chunks,
    `step` decodes one chunk and returns the results of the requests that ended, `drop`
    cancels requests. Batching changes when a result comes, never what it is."""

    def __init__(self, dbs: DirectedBeamSearch, config: DBSConfig, progress=None):
        self.dbs, self.config = dbs, config
        self.search = dbs.beam_search(config, progress)

    @property
    def requests(self) -> list[Request]:
        return self.search.requests

    @property
    def n_rows(self) -> int:
        return self.search.n_rows

    @property
    def candidate_tokens(self) -> int:
        return self.search.candidate_tokens

    def admit(self, requests: list[Request]) -> None:
        if requests:
            self.search.admit(requests)

    def drop(self, requests: list[Request]) -> None:
        self.search.drop(requests)

    def decode_chunk(self) -> list[tuple[Request, GenerationResult]]:
        """One chunk for every request in the batch; the results of those that ended."""
        return [(f.request, self._result(f)) for f in self.search.decode_chunk()]

    def _result(self, fin: Finished) -> GenerationResult:
        be = self.dbs.backend
        sentence_end = self.dbs.sentence_end if self.config.stop == "sentence" else None
        return build_result(fin, self.config, be.decode_batch, be.eos_ids, sentence_end,
                            dict(self.search.t.seconds), self.search.t.kv_bytes)

    def run(self) -> list[GenerationResult]:
        """Every admitted request to its end; results in admission order."""
        return [self._result(f) for f in self.search.run()]

    def certain(self, wanted=None) -> list[tuple[Request, str]]:
        """Per request in the batch (those for which `wanted(request)` holds): its text that is
        already certain (`search.beam.certain_text`)."""
        return [(r, certain_text(self.search, q)) for q, r in enumerate(self.requests)
                if wanted is None or wanted(r)]
