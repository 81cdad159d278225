"""The Python API: `DirectedBeamSearch(model, embeddings, config).generate(context, keywords)`."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from . import constraints, kernels, occurrence
from .beam import BeamSearch, Finished, Request
from .config import DBSConfig
from .embeddings import Embeddings, SimilarityTable
from .errors import DBSError
from .home import EMBEDDED_DIRS, MANIFEST, embedded_model_dir, predates_v2
from .prefix import DECODE_GRAPH, KV_LAYOUTS

MAX_KEYWORDS = 62           # one bit each in the scheduler's int64 masks
_START_TOKENS = ("<|endoftext|>", "<bos>", "<s>")   # an empty context starts a document with one
_EMB_CACHE: dict[str, Embeddings] = {}


@dataclass
class GenerationResult:
    text: str                     # context + generated text of the best beam
    context: str
    generated: str
    keywords: list[str]
    found: dict                   # keyword -> {"char": offset in generated, "token": index} or None
    success_rate: float
    success_length: int           # generated tokens until every keyword occurred (all if never)
    stopped: str                  # "sentence" / "eos": ended naturally; "trimmed": cut back to the last
    #                               sentence end after the keywords at max_new_tokens; "max": budget
    perplexity: float             # exp(-mean scorer log-prob) of the generated tokens
    new_tokens: int
    beams: list[dict]             # every final beam: text, score
    seconds: float
    tokens_per_second: float      # generated tokens of the result / seconds
    candidate_tokens_per_second: float  # all sampled candidate tokens / seconds (batch-wide)
    timings: dict = field(default_factory=dict)  # seconds by stage (batch-wide)
    kv_cache_bytes: int = 0       # peak bytes of the batch's KV cache over its steps (0: not known)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> dict:
        """`to_dict` as strict JSON: a non-finite float (the score of a dropped beam, the
        perplexity of an empty text) becomes null. What `generate --json` and the service send."""
        return json_safe(self.to_dict())


def json_safe(x):
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def resolve_model_dir(model: str | Path, quiet: bool = True) -> Path:
    if str(model) in EMBEDDED_DIRS:
        d = embedded_model_dir(str(model))
        old = (d / MANIFEST).is_file()
        if old and not predates_v2(d):
            return d
        try:
            from .export.convert import ensure_embedded
        except ImportError as e:
            if old:                       # made before engine v2: it runs on the row layout
                return d
            raise DBSError(f"the embedded model {model!r} is exported on first use, which needs the export "
                           f"extra: pip install 'dbs-fast[export]' (missing: {e.name})") from None
        return ensure_embedded(str(model), quiet=quiet)
    p = Path(model).expanduser()
    if not p.is_dir():
        raise DBSError(f"model directory not found: {model} (export one with `dbs-fast export`)")
    return p


def parse_constraints(keywords, ban=None):
    """(keywords, banned words) parsed from the constraint syntax (`dbs_fast.constraints`) and
    checked against each other; DBSError names what is wrong."""
    kws = constraints.parse_keywords(keywords)
    if len(kws) > MAX_KEYWORDS:
        raise DBSError(f"at most {MAX_KEYWORDS} keywords, got {len(kws)}")
    bans = [] if ban is None else constraints.parse_keywords(ban, what="banned word")
    constraints.check_bans(kws, bans)
    return kws, bans


def validate_keywords(keywords) -> list[str]:
    """Keywords normalised ("ice  cream |gelato" -> "ice cream|gelato"); DBSError if bad."""
    return [k.text for k in parse_constraints(keywords)[0]]


class DirectedBeamSearch:
    """Built once per (model, embeddings, scorer); `generate` / `generate_batch` many times."""

    def __init__(self, model: str | Path = "default", embeddings: str = "default",
                 config: DBSConfig | None = None, scorer: str = "self", backend: str = "onnx",
                 provider: str = "cpu", threads: int | None = None, subword_fallback: bool = False,
                 quiet: bool = True, kv_layout: str = "auto"):
        self.config = config or DBSConfig()
        self.model_dir = resolve_model_dir(model, quiet)
        kernels.set_threads(threads, sleep_when_idle=backend != "torch")
        self.decoder = None
        if backend == "onnx":
            from .backend import OnnxBackend
            from .session import OnnxModel

            self.decoder = self._decoder(self.model_dir, kv_layout, provider, threads)
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
        """(V,) bool: tokens that continue a word (built on first use of guarantee/boost_word_starts)."""
        if self._word_piece is None:
            self._word_piece = occurrence.word_piece_tokens(self.backend.decode_one, self.backend.vocab_size)
        return self._word_piece

    def _pieces(self, text: str) -> list[int]:
        """Tokens of a piece of running text (no BOS or other special tokens)."""
        return self.backend.tokenizer.encode(text, add_special_tokens=False).ids

    def _subwords(self, word: str) -> list[int]:
        return self._pieces(" " + word)

    @staticmethod
    def _decoder(model_dir: Path, kv_layout: str, provider, threads):
        """Engine v2's decode graph (decode.onnx, `export/prefix_graph.py`), or None for the row layout."""
        if kv_layout not in KV_LAYOUTS:
            raise DBSError(f"`kv_layout` must be one of {KV_LAYOUTS}, got {kv_layout!r}")
        path = model_dir / DECODE_GRAPH
        if kv_layout == "rows" or (kv_layout == "auto" and not path.is_file()):
            return None
        if not path.is_file():
            raise DBSError(f"kv_layout 'prefix' needs {path} (re-export the model with this version)")
        from .prefix import PrefixDecoder

        return PrefixDecoder(path, provider, threads)

    def _make_scorer(self, scorer: str, provider, threads, kv_layout: str):
        """`self`, or a second exported LM whose cache takes the same layout rule as the generator's."""
        from .scorer import OnnxScorer, SelfScorer

        if scorer == "self":
            return SelfScorer()
        from .session import OnnxModel

        model_dir = resolve_model_dir(scorer)
        decoder = self._decoder(model_dir, kv_layout, provider, threads)
        return OnnxScorer(OnnxModel(model_dir, provider, threads, lazy=decoder is not None), self.backend.tokenizer,
                          decoder)

    def generate(self, context: str, keywords, seed: int = 0, config: DBSConfig | None = None,
                 progress=None, ban=None) -> GenerationResult:
        return self.generate_batch([(context, keywords)], seeds=[seed], config=config, progress=progress,
                                   bans=[ban])[0]

    def _context_ids(self, context: str) -> list[int]:
        """The context's tokens; an empty context is the model's document-start token."""
        if not isinstance(context, str):
            raise DBSError(f"the context must be a string, got {context!r}")
        ids = self.backend.encode(context) if context else []
        if not context or not ids:
            start = [i for i in (self.backend.tokenizer.token_to_id(t) for t in _START_TOKENS) if i is not None]
            if context or not start:
                raise DBSError("the context encodes to no tokens: give some text, e.g. --context \"It is\"")
            ids = start[:1]
        return ids

    def request(self, context, keywords, ban=None, seed: int = 0, config: DBSConfig | None = None) -> Request:
        """One request with its constraints tokenised and its boosts built; DBSError names what
        is wrong (the service's and the CLI's validation)."""
        cfg = config or self.config
        kws, bans = parse_constraints(keywords, ban)
        ids = self._context_ids(context)
        limit = self.backend.max_positions
        if limit and len(ids) + cfg.max_new_tokens > limit:
            raise DBSError(f"context ({len(ids)} tokens) + max_new_tokens ({cfg.max_new_tokens}) exceeds "
                           f"the model's context window of {limit} tokens")
        enc = self._pieces
        force = [constraints.keyword_tokens(enc, k)[0] for k in kws]
        for k, f in zip(kws, force):
            if len(f) > cfg.max_new_tokens:
                raise DBSError(f"keyword {k.text!r} takes {len(f)} tokens, more than max_new_tokens "
                               f"({cfg.max_new_tokens})")
        if cfg.guarantee and sum(map(len, force)) > cfg.max_new_tokens:
            raise DBSError(f"--guarantee: the keywords take {sum(map(len, force))} tokens, more than "
                           f"max_new_tokens ({cfg.max_new_tokens}) can hold; raise it or give fewer keywords")
        phrases = [(i, head, whole) for i, k in enumerate(kws)
                   for head, whole in constraints.phrase_starts(enc, k, words=cfg.complete_words)]
        allowed = ~self.word_piece if cfg.boost_word_starts else None
        boosts = [constraints.keyword_boost(self.table, k, cfg.lam, cfg.boost_cutoff, self.subword_fallback,
                                            lenient=cfg.guarantee, allowed=allowed,
                                            own=constraints.first_tokens(enc, k) if cfg.complete_words else ())
                  for k in kws]
        return Request(ids, [k.text for k in kws], int(seed), boosts, force, phrases,
                       constraints.ban_sequences(enc, bans), context)

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

    def _search(self, cfg: DBSConfig, progress=None) -> BeamSearch:
        be = self.backend
        if self.decoder is not None:
            from .backend import PrefixBackend

            be = PrefixBackend(self.backend, self.decoder, cfg.candidates, cfg.chunk, cfg.max_new_tokens)
        return BeamSearch(be, self.scorer, cfg, (), progress,
                          self.sentence_end if cfg.stop == "sentence" else None,
                          self.word_piece if cfg.guarantee or cfg.boost_word_starts else None)

    @staticmethod
    def _found(texts: list[str], kws, rule: str = "stem") -> dict:
        """keyword -> first occurrence {"char", "token"} in the final text (texts: every token prefix)."""
        generated = texts[-1] if texts else ""
        found = {}
        for kw in kws:
            span = occurrence.first_match(generated, kw, rule)  # its tokens: those that complete it
            found[kw] = None if span is None else {
                "char": span[0], "token": next(n + 1 for n, t in enumerate(texts) if len(t) >= span[1])}
        return found

    def result(self, fin: Finished, cfg: DBSConfig, timings: dict, kv_bytes: int = 0) -> GenerationResult:
        """The result of a request that left the batch: its best beam, trimmed, with its stats."""
        rows, seconds, context, kws = fin.rows, fin.seconds, fin.request.context, fin.request.keywords
        order = np.argsort(-rows.cum, kind="stable")
        best = order[0]
        n_gen = int(rows.n_tok[best])
        toks = rows.tokens[best, :n_gen]
        texts = self.backend.decode_batch([toks[:n] for n in range(1, len(toks) + 1)]) or [""]
        found = self._found(texts, kws, cfg.match)
        stopped = "max"
        if rows.ended[best]:
            stopped = "eos" if n_gen and toks[-1] in self.backend.eos_ids else "sentence"
        elif cfg.stop == "sentence":   # budget ran out: cut back to the last sentence end after the keywords
            need = max([f["token"] for f in found.values() if f is not None], default=0)
            ends = [n for n in range(max(need, 1), n_gen + 1) if self.sentence_end[toks[n - 1]]]
            if ends:
                n_gen, stopped = ends[-1], ("trimmed" if ends[-1] < n_gen else "sentence")
                toks, texts = toks[:n_gen], texts[:n_gen]
        generated = texts[-1] if texts else ""
        hits = [found[k]["token"] for k in kws if found[k] is not None]   # a keyword listed twice counts twice
        success_length = max(hits) if len(hits) == len(kws) else cfg.max_new_tokens
        lp = rows.logp[best, :n_gen]
        beams = [{"text": t, "score": float(rows.cum[i])} for i, t in
                 zip(order, self.backend.decode_batch([rows.tokens[i, : rows.n_tok[i]] for i in order]))]
        return GenerationResult(
            text=context + generated, context=context, generated=generated, keywords=kws, found=found,
            success_rate=len(hits) / len(kws), success_length=int(success_length), stopped=stopped,
            perplexity=float(np.exp(-lp.mean())) if n_gen else float("nan"), new_tokens=n_gen,
            beams=beams, seconds=seconds, tokens_per_second=n_gen / seconds,
            candidate_tokens_per_second=fin.candidate_tokens_per_second, timings=timings,
            kv_cache_bytes=kv_bytes)

    def certain(self, search: BeamSearch, q: int) -> str:
        """Text of request q that no later chunk can change: the common prefix of its beams'
        tokens (with stop="sentence", up to its last sentence end: a result can be trimmed back
        to one), decoded without a trailing partial character."""
        rows = search.rows
        seqs = [rows.generated(i) for i in np.flatnonzero(rows.req == q)]
        n = min(map(len, seqs), default=0)
        if seqs and n:
            same = np.all(np.stack([s[:n] for s in seqs]) == seqs[0][:n], axis=0)
            n = int(np.argmin(same)) if not same.all() else n
        if search.cfg.stop == "sentence":
            ends = np.flatnonzero(self.sentence_end[seqs[0][:n]]) if n else []
            n = int(ends[-1]) + 1 if len(ends) else 0
        return self.backend.decode_batch([seqs[0][:n]])[0].rstrip("\ufffd") if n else ""


class Batch:
    """A running batch of one config (continuous batching): `admit` requests between chunks,
    `step` decodes one chunk and returns the results of the requests that ended, `drop`
    cancels requests. Batching changes when a result comes, never what it is."""

    def __init__(self, dbs: DirectedBeamSearch, config: DBSConfig, progress=None):
        self.dbs, self.config = dbs, config
        self.search = dbs._search(config, progress)

    @property
    def requests(self) -> list[Request]:
        return self.search.requests

    @property
    def rows(self) -> int:
        return self.search.n_rows

    @property
    def candidate_tokens(self) -> int:
        return self.search.candidate_tokens

    def admit(self, requests: list[Request]) -> None:
        if requests:
            self.search.admit(requests)

    def drop(self, requests: list[Request]) -> None:
        self.search.drop(requests)

    def step(self) -> list[tuple[Request, GenerationResult]]:
        return [(f.request, self._result(f)) for f in self.search.step()]

    def _result(self, fin) -> GenerationResult:
        return self.dbs.result(fin, self.config, dict(self.search.t.seconds), self.search.t.kv_bytes)

    def run(self) -> list[GenerationResult]:
        """Every admitted request to its end; results in admission order."""
        return [self._result(f) for f in self.search.run()]

    def certain(self, wanted=None) -> list[tuple[Request, str]]:
        """Per request in the batch (those for which `wanted(request)` holds): its text that is
        already certain (see `DirectedBeamSearch.certain`)."""
        return [(r, self.dbs.certain(self.search, q)) for q, r in enumerate(self.requests)
                if wanted is None or wanted(r)]
