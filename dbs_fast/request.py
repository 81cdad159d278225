"""Request building: (context, keywords, options) -> a `search.beam.Request`, its constraints
parsed, its context prompted, tokenised and healed, its boosts and openings built, its size
checked (`preflight`). Every DBSError names the field at fault."""
from __future__ import annotations

from functools import cached_property
from pathlib import Path

import numpy as np

from .config import OWN_SAMPLING, SEED_MAX, DBSConfig
from .errors import DBSError, naming
from .preflight import check_size
from .search.beam import Request
from .text import constraints, occurrence, openings, prompt
from .text.chat import ChatTemplate
from .text.embeddings import SimilarityTable

MAX_KEYWORDS = 62           # one bit each in the scheduler's int64 masks
_START_TOKENS = ("<|endoftext|>", "<bos>", "<s>")   # a plain-text context starts a document with one


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


def named_keywords(keywords, said: str, cfg: DBSConfig) -> list[bool]:
    """Whether the text the user wrote (`said`: a plain context, or a chat's messages without the
    template's own text) names each keyword (by `cfg.match`: a message asking for the word), read
    once per request; all False where neither `lam_named` nor `min_p_named` is set."""
    if cfg.lam_named is None and cfg.min_p_named is None:
        return [False] * len(keywords)
    return [occurrence.first_match(said, k, rule=cfg.match) is not None for k in keywords]


def lam_of(named: bool, cfg: DBSConfig, ahead: bool = False) -> float:
    """A keyword's guidance strength: `lam_named` where the user's text names it, else `lam_ahead`
    for a row `ahead` of its deadline where it is set, else `lam`."""
    if named and cfg.lam_named is not None:
        return cfg.lam_named
    return cfg.lam_ahead if ahead and cfg.lam_ahead is not None else cfg.lam


def min_p_of(named: list[bool], cfg: DBSConfig) -> float:
    """A request's min_p: `min_p_named` where the user's text names every keyword (the model means
    to write them all), else `min_p`."""
    return cfg.min_p_named if cfg.min_p_named is not None and named and all(named) else cfg.min_p


class RequestBuilder:
    """Turns (context, keywords, ban, seed, config) into a Request for one model: its tokenizer
    (the backend's), its guide-word table, its export's manifest and chat template. `window`: the
    tokens its decode graph attends to if that is less than the model's window
    (`preflight.decode_window`); `subword_fallback`: boost a word the embeddings lack by its
    subword tokens, in every request (a request asks for it with `DBSConfig.subword_fallback`)."""

    def __init__(self, backend, table: SimilarityTable, model_dir: Path, manifest: dict, window: int | None,
                 subword_fallback: bool = False):
        self.backend, self.table, self.model_dir = backend, table, model_dir
        self.manifest, self.window = manifest, window
        self.subword_fallback = subword_fallback

    def pieces(self, text: str) -> list[int]:
        """Tokens of a piece of running text (no BOS or other special tokens)."""
        return self.backend.tokenizer.encode(text, add_special_tokens=False).ids

    @cached_property
    def special_ids(self) -> frozenset:
        """The tokenizer's special tokens (document and turn markers, ...)."""
        added = self.backend.tokenizer.get_added_tokens_decoder()
        return frozenset(i for i, t in added.items() if t.special)

    @cached_property
    def token_texts(self) -> constraints.TokenTexts:
        """Every token's text, sorted, for token healing (built on first use)."""
        return constraints.TokenTexts(self.backend.decode_one, self.backend.vocab_size, self.special_ids)

    @cached_property
    def chat_template(self) -> ChatTemplate | None:
        """The export's chat template (None: it has none), read on first use."""
        return ChatTemplate.of(self.model_dir)

    @cached_property
    def not_document_starts(self) -> np.ndarray:
        """Tokens a text does not start with (sorted): those whose text does not begin with a
        capital, a digit, a double quote or an opening bracket (a space, a lower-case word
        piece, other punctuation), and the special tokens. Given an empty context, the model's
        own first token after its document start is often a fragment (" into a river.")."""
        starts = [i for i, t in zip(self.token_texts.ids, self.token_texts.texts)
                  if t[:1].isupper() or t[:1].isdigit() or t[:1] in "\"\u201c(["]
        return np.setdiff1d(np.arange(self.backend.vocab_size), starts).astype(np.int32)

    @cached_property
    def word_piece(self) -> np.ndarray:
        """(V,) bool: tokens that continue a word, the WORD_PIECE tokens of the backend's word table
        (`occurrence.word_table`), which the word-loop rule reads too: the vocabulary is decoded
        once for both (built on first use)."""
        return self.backend.words.word_class == occurrence.WORD_PIECE

    def _prompted_ids(self, context: str, kws, cfg: DBSConfig) -> tuple[list[int], bool]:
        """The tokens the model reads: the hidden prompt of `cfg.prompt_style` (`dbs_fast.text.prompt`),
        then the context; and whether the context's end may be healed (a plain-text context of
        its own, not empty)."""
        if not isinstance(context, str):
            raise DBSError(f"the context must be a string, got {context!r}", "context", context)
        text = prompt.prompt_text(cfg.prompt_style, kws, context, self.chat_template, cfg.shots)
        if not text:
            return self.context_ids(context)
        head, _ = self.context_ids(text)          # a chat template frames itself
        ctx = self.pieces(context) if context else []
        return head + ctx, bool(ctx) and ctx[0] not in self.special_ids

    def context_ids(self, context: str) -> tuple[list[int], bool]:
        """The context's tokens as the model reads a document, its document-start token then the
        text, and True; a context that starts with a special token (a rendered chat template)
        frames itself: its tokens as they are, and False."""
        ids = self.pieces(context) if context else []
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
        if len(ids) == 1 and ids[0] in self.special_ids:    # an empty context: a document's first token
            return constraints.Healing(ids, "", self.not_document_starts)
        if not cfg.heal or ids[-1] in self.special_ids:
            return None
        if cfg.guarantee and forced_tokens >= cfg.max_new_tokens:
            return None
        banned = [b[0] for b in ban_seqs if len(b) == 1]
        return self.token_texts.heal(ids, self.backend.decode_one(ids[-1]), banned)

    def request(self, context, keywords, ban, seed: int, cfg: DBSConfig) -> Request:
        """One request with its constraints tokenised and its boosts built; DBSError names what
        is wrong (the service's and the CLI's validation)."""
        if not (isinstance(seed, (int, np.integer)) and not isinstance(seed, bool) and 0 <= seed <= SEED_MAX):
            raise DBSError.about("seed", f"must be an integer in 0..{SEED_MAX}", seed)
        vocab = self.backend.vocab_size
        if cfg.logit_bias and cfg.logit_bias[-1][0] >= vocab:
            raise DBSError.about("logit_bias", f"must have the model's token ids (0..{vocab - 1}) as its keys, not "
                                 f"{cfg.logit_bias[-1][0]}", {str(t): b for t, b in cfg.logit_bias})
        kws, bans = parse_constraints(keywords, ban)
        if cfg.inflect:
            kws = [constraints.inflected(k, lambda w: self.table.emb.vector(w) is not None) for k in kws]
        ids, plain = self._prompted_ids(context, kws, cfg)
        check_size(cfg, len(ids), self.manifest, self.window)
        enc = self.pieces
        force = [constraints.keyword_tokens(enc, k)[0] for k in kws]
        for k, f in zip(kws, force):
            if len(f) > cfg.max_new_tokens:
                raise DBSError(f"keyword {k.text!r} takes {len(f)} tokens, more than --max-new-tokens "
                               f"({cfg.max_new_tokens})", "keywords", keywords)
        if cfg.guarantee and sum(map(len, force)) > cfg.max_new_tokens:
            raise DBSError(f"--guarantee: the keywords take {sum(map(len, force))} tokens, more than "
                           f"--max-new-tokens ({cfg.max_new_tokens}) can hold; raise it or give fewer keywords",
                           "keywords", keywords)
        phrases = [(i, head, whole) for i, k in enumerate(kws)
                   for head, whole in constraints.phrase_starts(enc, k, words=cfg.complete_words)]
        allowed = ~self.word_piece if cfg.boost_word_starts else None
        said = self.chat_template.said(context) if self.chat_template else context
        named = named_keywords(kws, said, cfg)

        fallback = (lambda word: self.pieces(" " + word)) if self.subword_fallback or cfg.subword_fallback else None

        def boost(k, lam: float):
            return constraints.keyword_boost(self.table, k, lam, cfg.boost_cutoff, fallback,
                                             lenient=cfg.guarantee, allowed=allowed,
                                             own=constraints.first_tokens(enc, k) if cfg.complete_words else (),
                                             power=cfg.similarity_power)

        with naming("keywords", keywords):                   # a word the embeddings lack
            lams = [lam_of(n, cfg) for n in named]
            boosts = [boost(k, lam) for k, lam in zip(kws, lams)]
            if cfg.lam_ahead is not None:    # a row ahead of its deadline reads these rows, after those at lambda
                boosts += [b if ahead == lam else boost(k, ahead)
                           for k, b, lam, ahead in zip(kws, boosts, lams, (lam_of(n, cfg, True) for n in named))]
        ban_seqs = constraints.ban_sequences(enc, bans)
        heal = self._heal(ids, cfg, sum(map(len, force)), ban_seqs) if plain else None
        req_ids = heal.context_ids if heal else ids
        return Request(req_ids, kws, int(seed), boosts, force, phrases, ban_seqs, context, heal=heal,
                       openings=self._openings(context, kws, cfg, len(ids) - len(req_ids), named, said != context),
                       min_p=min_p_of(named, cfg), max_new_tokens=cfg.max_new_tokens,
                       logprobs=cfg.logprobs, logit_bias=cfg.logit_bias,
                       sampling={name: getattr(cfg, name) for name in OWN_SAMPLING})

    def _openings(self, context: str, kws, cfg: DBSConfig, healed: int, named: list[bool], chat: bool) -> list[tuple]:
        """The token sequences of `cfg.openings`' phrases after `context` (from the token the healing
        re-writes, if any), each as the context and the phrase tokenise together; a phrase that
        would change the context's own tokens is left out. After a `chat` (a context its template framed) an answer
        opens with a word the user's message leaves out (`named`), never with people in general;
        where the message names every word, the model opens as it means to."""
        if cfg.openings == "none":
            return []
        words = [k.text for k, n in zip(kws, named) if not n]
        ctx = self.pieces(context)
        keep = len(ctx) - healed
        out = []
        for phrase in openings.subject_phrases(words, cfg.opened_rows, people=not chat):
            ids = self.pieces(openings.opening_text(context, phrase))
            if ids[:keep] == ctx[:keep] and len(ids) > keep:
                out.append(tuple(ids[keep:]))
        return out
