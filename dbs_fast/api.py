"""The Python API: `DirectedBeamSearch(model, embeddings, config).generate(context, keywords)`.

`DirectedBeamSearch` is the composition root: it builds the engine for one model (backend,
decode graph, scorer, guide-word table) and hands requests to `request.RequestBuilder` and runs
to `Batch`; whether a request fits is `preflight`'s to say. An embedded model is exported on its
first use (`resolve_model_dir`): the one call the runtime makes into `export/`."""
from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

import numpy as np

from .backend import SCHEDULES, OnnxBackend, onnx_backend
from .config import STREAM_LAG, DBSConfig
from .errors import DBSError
from .home import EMBEDDED_DIRS, embedded_model_dir
from .kv.decoder import ContextStore, PrefixDecoder
from .kv.prefix_cache import DECODE_GRAPH, KV_LAYOUTS
from .manifest import current_export, read_manifest, stale_embedded
from .model import OnnxModel
from .numba_runtime import set_threads
from .preflight import decode_window
from .request import RequestBuilder, parse_constraints  # noqa: F401  (parse_constraints: part of the API)
from .scorer import OnnxScorer, SelfScorer
from .search.beam import BeamSearch, Finished, Request, certain_span, span_text
from .search.result import (  # noqa: F401  (json_safe: part of the API)
    GenerationResult,
    build_result,
    json_safe,
    tokens_with_logprobs,
)
from .text import occurrence
from .text.embeddings import Embeddings, SimilarityTable

_EMB_CACHE: dict[str, Embeddings] = {}


def resolve_model_dir(model: str | Path, quiet: bool = True, row_layout: bool = False) -> Path:
    """An export's directory: an embedded model's (exported on first use, and again where this
    version writes it differently), or `model` as a path. `row_layout`: model.onnx is needed."""
    if str(model) in EMBEDDED_DIRS:
        d = embedded_model_dir(str(model))
        current = current_export(d)
        manifest = read_manifest(d) if current else {}
        if current and (manifest.get("prefix_decode") or {}).get("written", True) and \
                not stale_embedded(manifest, row_layout):
            return d
        try:
            from .export.convert import ensure_embedded
        except ImportError as e:
            if current and not (row_layout and not manifest.get("onnx")):
                return d     # as it is (without its decode graph: on the row layout)
            raise DBSError(f"the embedded model {model!r} is exported on first use, which needs the export "
                           f"extra: pip install 'dbs-fast[export]' (missing: {e.name})") from None
        return ensure_embedded(str(model), quiet=quiet, row_layout=row_layout)
    p = Path(model).expanduser()
    if p.is_file():
        raise DBSError(f"{model} is a file; the engine runs an export's directory: "
                       f"dbs-fast export --model {model} --out DIR, then --model DIR")
    if not p.is_dir():
        names = ", ".join(EMBEDDED_DIRS)
        raise DBSError(f"model not found: {model} is neither an embedded model ({names}) nor a directory "
                       f"(export one with `dbs-fast export`)")
    return p


def checked_config(config, default: DBSConfig) -> DBSConfig:
    """`config`, or `default` where it is None; anything but a DBSConfig is a DBSError."""
    if config is None:
        return default
    if not isinstance(config, DBSConfig):
        hint = f": DBSConfig(**{config!r})" if isinstance(config, dict) else ""
        raise DBSError(f"{{field}} must be a DBSConfig, got a {type(config).__name__}{hint}", "config", config)
    return config


class DirectedBeamSearch:
    """Built once per (model, embeddings, scorer); `generate` / `generate_batch` many times."""

    def __init__(self, model: str | Path = "default", embeddings: str = "default",
                 config: DBSConfig | None = None, scorer: str = "self", backend: str = "onnx",
                 provider: str = "cpu", threads: int | None = None, subword_fallback: bool = False,
                 quiet: bool = True, kv_layout: str = "auto", context_cache_mb: int = 256,
                 schedule: str = "distinct", cuda_graph: bool = False, buckets=None):
        if schedule not in SCHEDULES:
            raise DBSError.about("schedule", f"must be one of {SCHEDULES}", schedule)
        for name, value, least in (("threads", threads, 1), ("context_cache_mb", context_cache_mb, 0)):
            if (value is not None or name != "threads") and (not isinstance(value, int) or isinstance(value, bool)
                                                              or value < least):
                raise DBSError.about(name, f"must be an integer >= {least}" + (" or None" if name == "threads" else ""),
                                     value)
        if cuda_graph and (provider != "cuda" or backend != "onnx" or kv_layout == "rows"):
            raise DBSError("{field} needs the CUDA provider, the onnx backend and the prefix cache (its decode graph)",
                           "cuda_graph", cuda_graph)
        self.config, self.schedule = checked_config(config, DBSConfig()), schedule
        self.model_dir = resolve_model_dir(model, quiet, row_layout=kv_layout == "rows")
        self.manifest = read_manifest(self.model_dir)
        set_threads(threads, sleep_when_idle=backend != "torch")
        self.decoder = None
        if backend == "onnx":
            self.decoder = self._decoder(self.model_dir, kv_layout, provider, threads, cuda_graph, buckets)
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
        self.builder = RequestBuilder(self.backend, self.table, self.model_dir, self.manifest,
                                      decode_window(self.manifest) if self.decoder is not None else None,
                                      subword_fallback)
        self._sentence_end = None
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
        """(V,) bool: tokens that continue a word (`RequestBuilder.word_piece`)."""
        return self.builder.word_piece

    @property
    def chat_template(self):
        """The export's chat template, or None (`RequestBuilder.chat_template`)."""
        return self.builder.chat_template

    def request(self, context, keywords, ban=None, seed: int = 0, config: DBSConfig | None = None) -> Request:
        """One request with its constraints tokenised and its boosts built (`RequestBuilder`);
        DBSError names what is wrong (the service's and the CLI's validation)."""
        return self.builder.request(context, keywords, ban, seed, self._config(config))

    @staticmethod
    def _decoder(model_dir: Path, kv_layout: str, provider, threads, cuda_graph: bool = False, buckets=None):
        """The decode graph (decode.onnx, `export/prefix_graph.py`), or None for the row layout;
        `buckets` (`dbs_fast.kv.buckets.Buckets`): its decode steps at bucket shapes, each replayed
        as one CUDA graph where `cuda_graph` (on the CPU, where the cache is on a device as an fp16
        export's is, the same path without capture)."""
        if kv_layout not in KV_LAYOUTS:
            raise DBSError(f"`kv_layout` must be one of {KV_LAYOUTS}, got {kv_layout!r}")
        path = model_dir / DECODE_GRAPH
        if kv_layout == "rows" or (kv_layout == "auto" and not path.is_file()):
            return None
        if not path.is_file():
            raise DBSError(f"kv_layout 'prefix' needs {path} (re-export the model with this version)")

        return PrefixDecoder(path, provider, threads, buckets=buckets, cuda_graph=cuda_graph)

    def _make_scorer(self, scorer: str, provider, threads, kv_layout: str):
        """`self`, or a second exported LM whose cache takes the same layout rule as the generator's."""
        if scorer == "self":
            return SelfScorer()

        model_dir = resolve_model_dir(scorer, row_layout=kv_layout == "rows")
        decoder = self._decoder(model_dir, kv_layout, provider, threads)
        return OnnxScorer(OnnxModel(model_dir, provider, threads, lazy=decoder is not None), self.backend.tokenizer,
                          decoder)

    def generate(self, context: str, keywords, seed: int = 0, config: DBSConfig | None = None,
                 progress=None, ban=None) -> GenerationResult:
        return self.generate_batch([(context, keywords)], seeds=[seed], config=config, progress=progress,
                                   bans=[ban])[0]

    def _config(self, config) -> DBSConfig:
        """`config`, or this engine's where it is None (`checked_config`)."""
        return checked_config(config, self.config)

    def stream(self, context: str, keywords, seed: int = 0, config: DBSConfig | None = None,
               ban=None) -> "Stream":
        """`generate`, its text as it becomes certain: iterate the answer for the pieces, then read
        its `result`. The text is committed with `config.stream_lag` chunks of lag, or the
        service's streams' (`STREAM_LAG`) where it has none, so it is `generate`'s text with that
        lag."""
        cfg = self._config(config)
        cfg = cfg if cfg.stream_lag else replace(cfg, stream_lag=STREAM_LAG)
        batch = self.batch(cfg)
        batch.admit([self.request(context, keywords, ban, seed, cfg)])
        return Stream(batch)

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
        return Batch(self, self._config(config), progress)

    def generate_batch(self, requests, seeds=None, config: DBSConfig | None = None,
                       progress=None, bans=None) -> list[GenerationResult]:
        """Many (context, keywords) requests decoded as one batch of rows; `bans`: per request,
        banned words (comma-separated or a list) or None."""
        cfg = self._config(config)
        given = requests
        requests = None if isinstance(requests, (str, bytes, dict)) or not hasattr(requests, "__iter__") else list(requests)
        if requests is None or not all(isinstance(r, (tuple, list)) and len(r) == 2 for r in requests):
            raise DBSError("{field} must be a list of (context, keywords) pairs", "requests", given)
        seeds = list(seeds) if seeds is not None else list(range(len(requests)))
        bans = list(bans) if bans is not None else [None] * len(requests)
        for name, given in (("seeds", seeds), ("bans", bans)):
            if len(given) != len(requests):          # zip would drop the requests past the shorter list
                raise DBSError(f"{{field}} must hold one per request: {len(given)} for {len(requests)} requests",
                               name, given)
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

class Stream:
    """One request's text as it becomes certain (`DirectedBeamSearch.stream`): iterating decodes
    it chunk by chunk and yields each new piece of its generated text, appended and never revised,
    which joined are `result.generated`; `result` is its GenerationResult once the iteration ends."""

    def __init__(self, batch: "Batch"):
        self.batch, self.result, self.sent = batch, None, ""

    def __iter__(self):
        while self.result is None:
            done = self.batch.decode_chunk()
            if done:
                self.result = done[0][1]
                text = self.result.generated
            else:
                ((_, text),) = self.batch.certain()
            if len(text) > len(self.sent) and text.startswith(self.sent):
                piece, self.sent = text[len(self.sent):], text
                yield piece


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
        sentence_end = self.dbs.sentence_end if self.config.finishes else None
        return build_result(fin, self.config, be.decode_batch, be.eos_ids, sentence_end,
                            dict(self.search.t.seconds), self.search.t.kv_bytes, be.decode_one)

    def run(self) -> list[GenerationResult]:
        """Every admitted request to its end; results in admission order."""
        return [self._result(f) for f in self.search.run()]

    def certain(self, wanted=None) -> list[tuple[Request, str]]:
        """Per request in the batch (those for which `wanted(request)` holds): its text that is
        already certain (`search.beam.certain_text`)."""
        return [(r, text) for r, text, _ in self.certain_tokens(wanted)]

    def certain_tokens(self, wanted=None) -> list[tuple[Request, str, list[dict] | None]]:
        """`certain`'s text and, where the request asks for `logprobs`, the entries of its certain
        tokens (`search.result.tokens_with_logprobs`; None where not asked): what a stream sends,
        from one look at the beams."""
        out, be = [], self.dbs.backend
        token_text = functools.cache(be.decode_one)
        for q, r in enumerate(self.requests):
            if wanted is None or wanted(r):
                rows, i, n = certain_span(self.search, q)
                K = r.alternatives(self.config)
                entries = None if K is None else \
                    tokens_with_logprobs(rows, i, n, be.eos_ids, token_text, self.search.tables.tail[q], K) if n else []
                out.append((r, span_text(self.search, q, rows, i, n), entries))
        return out
