"""The hyper-parameters of Directed Beam Search, validated once, and their presets.

`DBSConfig()` is what `generate`, the API and the CLI use: the paper's search with the
anti-degeneration settings that measured best (docs: quality); `DBSConfig.paper()` is the
paper's protocol exactly (fixed 90 tokens, no repetition control), which `eval` and `bench`
use for the paper comparison; `DBSConfig.commongen()` is the CommonGen task's (any order,
lemma matching, one short sentence), with `COMMONGEN_CONTEXT` as its context;
`DBSConfig.chat()` is the chat door's (/v1/chat/completions, `eval --sets chat`). `preset(task,
paper, chat)` gives the config and the context a request starts from; every front door (the CLI,
the API, /v1/generate, the OpenAI endpoints) starts there.

Every field a user can set carries its flag and help in its metadata (`option`): `OPTIONS`, the
CLI flags and the service's JSON fields are all derived from it.
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, fields, replace
from functools import cached_property
from keyword import iskeyword

import numpy as np

from .errors import DBSError

BOOST_ORDERS = ("filter_then_boost", "boost_then_filter")
STOPS = ("max", "sentence", "eos")
MIN_TEMPERATURE = 0.01       # a lower positive temperature draws at this one (as vLLM does): float32 logits
                             # over it overflow; 0 is the greedy draw
PICKS = ("q", "likelihood", "consensus", "blend")      # dbs_fast.search.result.pick
ORDERS = ("next", "any")
MATCHES = ("stem", "lemma")
PROMPT_STYLES = ("none", "instruction", "chat", "few-shot")   # dbs_fast.text.prompt
OPENINGS = ("none", "subjects")                                # dbs_fast.text.openings
FEW_SHOT_POOL = 200                                            # examples in data/commongen_train_pool.tsv


def inv_temperature(temperature):
    """1 / the temperature the draws scale the logits by (a number, or an array: per row): 1 for a
    greedy draw (temperature 0, the mode at temperature 1), and a positive temperature no lower
    than MIN_TEMPERATURE."""
    t = np.asarray(temperature, np.float64)
    return np.where(t > 0, 1.0 / np.maximum(t, MIN_TEMPERATURE), 1.0)


def bias_table(biases: list[tuple]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Logit-bias sets (each a `logit_bias` tuple of (token id, bias), ids ascending) as CSR:
    (ptr (n + 1,) int64, token ids int32, biases float32); set i is ids[ptr[i]:ptr[i + 1]]."""
    ptr = np.concatenate([[0], np.cumsum([len(b) for b in biases])]).astype(np.int64)
    return (ptr, np.array([t for b in biases for t, _ in b], np.int32),
            np.array([v for b in biases for _, v in b], np.float32))


def parse_bool(v: str) -> bool:
    if v.lower() not in ("true", "false"):
        raise ValueError(v)                  # argparse: "invalid parse_bool value", exit 2
    return v.lower() == "true"


def parse_logit_bias(v: str) -> dict:
    """argparse type of --logit-bias: a JSON object of token ids and biases ('{"198": -100}')."""
    import argparse
    import json

    try:
        bias = json.loads(v)
    except json.JSONDecodeError:
        bias = None
    if not isinstance(bias, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object of token ids and biases, as '{{\"198\": -100}}'; "
                                         f"got {v!r}")
    return bias


LOGIT_BIAS_MAX = 100.0      # OpenAI's range for a logit bias: -100..100
# the draw's settings that are each request's own, read per row (`DBSConfig.batched`), with the
# values a running batch's own config holds, which change no draw
OWN_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                "frequency_penalty": 0.0}
PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")     # `DBSConfig.shapes_with`'s order
MAX_LOGPROBS = 20           # alternatives returned beside each token at most (OpenAI's top_logprobs)


def logit_bias_pairs(value) -> tuple:
    """A logit bias ({token id: bias}, as a JSON object's string keys or ints, or (id, bias)
    pairs) as the config holds it: (id, bias) pairs by id. ValueError says what is wrong."""
    items = value.items() if isinstance(value, dict) else value
    pairs = {}
    for item in items:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise ValueError("must be a JSON object of token ids and biases")
        key, bias = item
        if isinstance(key, str) and key.strip().isdigit():
            key = int(key)
        if not (isinstance(key, int) and not isinstance(key, bool) and key >= 0):
            raise ValueError(f"must have token ids (integers >= 0) as its keys, not {key!r}")
        if not (isinstance(bias, (int, float)) and not isinstance(bias, bool) and math.isfinite(bias)
                and abs(bias) <= LOGIT_BIAS_MAX):
            raise ValueError(f"must have biases in -100..100, not {bias!r} for token {key}")
        if key in pairs:
            raise ValueError(f"gives token {key} twice")
        pairs[key] = float(bias)
    return tuple(sorted(pairs.items()))


def option(default, typ, text: str, choices: tuple | None = None):
    """A dataclass field a user sets: its flag in the CLI, its JSON name over HTTP (`NAMES`)."""
    return field(default=default, metadata={"option": True, "type": typ, "help": text, "choices": choices})


@dataclass(frozen=True)
class DBSConfig:
    lam: float = option(20.0, float, "guidance strength (the paper picks 20: best success)")
    lam_named: float | None = option(
        None, float, "guidance strength of a keyword the context already names (a message that asks for "
        "the word, matched by --match; a chat template's own text does not count): the model leans to it "
        "already, and a full boost writes it at once and lists it twice (default: lambda's; the chat door's "
        "preset: 1)")
    lam_ahead: float | None = option(
        5.0, float, "guidance strength of a keyword the context does not name while the row is ahead of its "
        "deadline (at least reserve-per-keyword tokens left per keyword still to place): a light boost places "
        "the words that fit the text, and lambda's places the rest in time (default 5; the paper's protocol "
        "and the CommonGen task: lambda's throughout)")
    similarity_power: float = option(
        2.0, float, "p: a token's boost is lambda * max(0, cos)^p, cos its word's GloVe similarity to the guide "
        "word (the paper's 2); a larger p keeps the full boost for the word and its near forms and less for words "
        "merely related to it")
    beams: int = option(7, int, "b: beams kept after every chunk")
    candidates: int = option(10, int, "s: candidates per beam, all b*s decoded as one batch")
    chunk: int = option(5, int, "k: tokens per chunk; sets keyword density")
    top_p: float = option(0.9, float, "nucleus sampling mass")
    temperature: float = option(1.0, float, "sampling temperature (at least 0.01: lower draws at 0.01); 0 "
                                "draws the likeliest tokens of what temperature 1 would sample from (its "
                                "nucleus, boosted), rows of one history taking them in turn: deterministic")
    min_p: float = option(0.0, float, "keep only tokens at least this times as likely as the top "
                          "one, by the model's own probabilities before boosts (0 = off)")
    min_p_named: float | None = option(
        None, float, "min_p of a request whose context names every keyword (a message that asks for the "
        "words, as for --lambda-named): the model means to write them, so its implausible tokens can go "
        "(default: min-p's; the chat door's preset: 0.1)")
    alpha: float = option(0.001, float, "weight of perplexity in the quality score Q")
    alpha_fluent: float | None = option(
        0.02, float, "weight of perplexity in Q while the beam is ahead of its deadline (at "
        "least reserve-per-keyword tokens left per keyword still to place): fluent chunks win then, and Q is "
        "the paper's again when time is short")
    late_boost_first: bool = option(True, parse_bool,
                                    "true/false: rows behind the deadline boost before the top-p cut")
    reserve_per_keyword: int = option(15, int,
                                      "tokens kept per keyword still to place (the deadline)")
    boost_first_reserve: int = option(
        0, int, "with late-boost-first: a row boosts before the top-p cut only once fewer than this many tokens "
        "are left per keyword still to place, a later deadline than reserve-per-keyword's; between the two "
        "the full boost places a word once the model's nucleus holds it, where it fits the text (0: at the "
        "deadline)")
    c_star: float = option(2.0, float, "Q's penalty for a chunk without the guide word")
    max_new_tokens: int = option(90, int, "token budget")
    boost_order: str = option("filter_then_boost", str,
                              "filter_then_boost (the authors' code: top-p first) or boost_then_filter",
                              BOOST_ORDERS)
    boost_cutoff: float = 0.01   # the sparse boost table drops boosts below this (logit units = max error)
    # boost only tokens that start a word: a boosted "rink" no longer glues onto "hockey"
    boost_word_starts: bool = True
    complete_words: bool = option(True, parse_bool,
                                  "true/false: a keyword of several tokens is boosted from its own first "
                                  "token and its rest forced once that is out")
    guided: bool = True          # False = the unguided baseline (no boosts)
    order: str = option("next", str, "next: keywords one at a time in the given order (the paper); "
                        "any: guide towards all remaining keywords at once", ORDERS)
    match: str = option("stem", str, "how a keyword is recognised in text: stem (equal Porter stems, "
                        "the paper) or lemma (lemminflect lemmas meet: CommonGen's coverage rule)", MATCHES)
    inflect: bool = option(False, parse_bool,
                           "true/false: with match lemma, a one-word keyword's inflections (lemminflect: sends, "
                           "sent and sending for send) join its alternatives: the one-token ones get the keyword's "
                           "own boost and their vectors guide too, so the text may write the form that fits it")
    guarantee: bool = option(False, "switch", "force each keyword's tokens when the budget left "
                             "is what the remaining keywords need: every keyword appears")
    subword_fallback: bool = option(False, "switch", "a keyword the embeddings lack is guided by the mean of its "
                                    "subword tokens' vectors; with --guarantee it is placed (14 of 14 such words, "
                                    "docs/results/quality/unknown-words.md)")
    prompt_style: str = option("none", str, "a hidden prompt before the context that names the "
                               "keywords: none, instruction (one line), chat (the model's chat template) or "
                               "few-shot (examples from CommonGen train); the text still continues the context",
                               PROMPT_STYLES)
    shots: int = option(3, int, "examples in the few-shot prompt (1..200, from CommonGen train)")
    heal: bool = option(True, parse_bool, "true/false: token healing: the context's last token is "
                        "taken back and the first generated token re-writes it, so a new word never glues "
                        "onto the context (\"The\" + \"Bella\") and a word the context ends in can be finished")
    sentence_deadline: int = option(0, int, "for one-sentence tasks: the keywords' deadline "
                                    "is this many tokens, not the budget's end (0 = the budget): no sentence end "
                                    "and no EOS while a keyword is missing before it; with --guarantee every keyword "
                                    "is forced in time and sentence ends wait for all, so all are in the first "
                                    "sentence")
    keyword_deadline: int = option(
        0, int, "the keywords' deadline in new tokens, where the budget is longer: each keyword is due by then "
        "(reserve-per-keyword tokens kept before it per keyword still to place), and the text goes on to end "
        "where the model ends it, within the budget (0 = the budget's end; unlike sentence-deadline, no sentence "
        "end or EOS is held back; the chat door's preset: 90 of a budget of 150)")
    min_sentence: int = option(0, int, "no sentence end and no EOS before this many new tokens "
                               "(0 = off); under --guarantee sentence ends then also wait for every keyword")
    repetition_penalty: float = option(1.0, float,
                                       "> 1 discourages tokens already used (1 = off)")
    presence_penalty: float = option(0.0, float, "subtracted from the logit of every token the text has "
                                     "generated so far, as OpenAI's (-2..2; 0 = off; > 0 discourages)")
    frequency_penalty: float = option(0.0, float, "subtracted from a token's logit once for every time the "
                                      "text has generated it, as OpenAI's (-2..2; 0 = off; > 0 discourages)")
    logit_bias: tuple = option((), parse_logit_bias, "token id -> bias in -100..100, added to the model's "
                               "logits before the penalties and the temperature, as OpenAI's: a JSON object, "
                               "'{\"198\": -100}' (-100 bans the token, 100 all but forces it; the guide words' "
                               "boosts and forcing act after it; the scorer reads the model's own log-probs)")
    logprobs: int | None = option(
        None, int, "return each token's log-probability, the model's own at the sampling temperature (before "
        "the penalties, the bias and the boosts, as the quality score reads it), with this many likeliest "
        "alternatives at each place (0..20; default: none returned)")
    no_repeat_ngram_size: int = option(3, int,
                                       "ban repeating any n-gram of this size (0 = off)")
    no_repeat_word_window: int = option(5, int,
                                        "word loops: a word is not drawn right after itself, nor a third time "
                                        "within this many words (0 = off)")
    stop: str = option("sentence", str, "sentence: end at the first sentence end after the last "
                       "keyword; eos: end where the model ends its text (EOS) after the last keyword; max: always "
                       "max-new-tokens (the paper). sentence and eos cut a text the budget ends back to its last "
                       "sentence end after the keywords, from another beam or candidate where the best has none",
                       STOPS)
    finished: int = option(1, int, "stop=sentence or eos: the finished candidates (every keyword, then "
                           "its end) a request gathers before it ends; each is set aside and the "
                           "other beams go on (1: the first chunk with one ends the request); where the "
                           "budget ends it with fewer, its beams that can be cut back to a sentence end after "
                           "every keyword join them, cut back; --pick chooses among them")
    openings: str = option("none", str, "subjects: the first chunk draws b*s candidates, one "
                           "begun with each subject phrase (\"The dog\", \"A dog\" for a concept \"dog\", then "
                           "\"A man\", \"A woman\", ...) and the rest free; the quality score keeps b. For "
                           "one-sentence tasks after a context that ends a line, and chat answers (the words "
                           "the message leaves out, no people; none where it names every word)", OPENINGS)
    stream_lag: float = option(0, float, "chunks: after each chunk commit the best beam's text older than this "
                               "and drop the beams that disagree, so that text streams early; a fraction holds "
                               "back part of a chunk (0.4 of 5 tokens: 2) and commits after the first (0 = off: "
                               "the text is chosen whole at the end; a stream's default is the service's)")
    pick: str = option("blend", str, "the beam returned: q, the best by the quality score (the paper); "
                       "likelihood, the finished beam with the best mean log-prob per token; consensus, the "
                       "finished beam most like the other finished ones (BLEU-4, minimum Bayes risk); blend, the finished beam "
                       "with the smallest place by Q plus half its place by likelihood", PICKS)
    length_penalty: float = option(1.0, float, "the likelihood that --pick likelihood and blend compare: a finished "
                                   "beam's summed log-prob over its length in tokens to this power (as transformers' "
                                   "beam search; 1 = the mean per token, 0 = the sum: shorter answers; in -2..4)")

    @classmethod
    def paper(cls, **overrides) -> "DBSConfig":
        """The paper's protocol: fixed-length, no repetition control (overrides apply on top)."""
        return replace(cls(), **{**PAPER, **overrides})

    @classmethod
    def chat(cls, **overrides) -> "DBSConfig":
        """The chat door's settings (a rendered conversation as the context); overrides apply on top."""
        return replace(cls(), **{**CHAT, **overrides})

    @classmethod
    def commongen(cls, **overrides) -> "DBSConfig":
        """The CommonGen task's settings (use with `COMMONGEN_CONTEXT`); overrides apply on top."""
        return replace(cls(), **{**COMMONGEN, **overrides})

    def __post_init__(self):
        def bad(name: str, rule: str):
            raise DBSError.about(name, rule, getattr(self, name))

        for name in ("beams", "candidates", "chunk", "max_new_tokens", "finished"):
            if not _is_int(getattr(self, name), 1):
                bad(name, "must be an integer >= 1")
        if not (0.0 < self.top_p <= 1.0):
            bad("top_p", "must be a float in (0, 1]")
        for name in ("min_p", "min_p_named"):
            v = getattr(self, name)
            if (v is not None or name == "min_p") and not (isinstance(v, (int, float)) and 0.0 <= v < 1.0):
                bad(name, "must be a float in [0, 1) (0 = off)")
        for name in ("lam", "lam_named", "lam_ahead"):
            v = getattr(self, name)
            if v is not None and not (0.0 <= v <= 80.0):
                bad(name, "must be in [0, 80] (exp(lambda) must fit float32)")
        if not self.temperature >= 0.0:
            bad("temperature", "must be >= 0 (0 = the likeliest token)")
        for name in ("alpha", "c_star", "alpha_fluent"):
            v = getattr(self, name)
            if v is not None and v < 0:
                bad(name, "must be >= 0")
        if not (_is_int(self.shots, 1) and self.shots <= FEW_SHOT_POOL):
            bad("shots", f"must be an integer in 1..{FEW_SHOT_POOL} (the examples packaged from CommonGen train)")
        if not _is_int(self.min_sentence, 0):
            bad("min_sentence", "must be an integer >= 0 (0 = off)")
        for name in ("sentence_deadline", "keyword_deadline"):
            if not _is_int(getattr(self, name), 0):
                bad(name, "must be an integer >= 0 (0 = off)")
        if not _is_int(self.reserve_per_keyword, 0):
            bad("reserve_per_keyword", "must be an integer >= 0")
        if not (_is_int(self.boost_first_reserve, 0) and self.boost_first_reserve <= self.reserve_per_keyword):
            bad("boost_first_reserve", f"must be an integer in 0..reserve_per_keyword ({self.reserve_per_keyword}): "
                "the later of two deadlines (0 = the deadline)")
        if not _is_number(self.similarity_power, 0.5, 32):
            bad("similarity_power", "must be a number in 0.5..32 (the paper's 2)")
        if self.boost_cutoff < 0:
            bad("boost_cutoff", "must be >= 0")
        if not (isinstance(self.repetition_penalty, (int, float)) and self.repetition_penalty > 0):
            bad("repetition_penalty", "must be > 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v, -2, 2):
                bad(name, "must be a number in -2..2 (0 = off)")
        if not _is_number(self.length_penalty, -2, 4):
            bad("length_penalty", "must be a number in -2..4 (1 = the mean log-prob per token, 0 = the sum)")
        if not _is_number(self.stream_lag, 0, self.max_new_tokens):
            bad("stream_lag", "must be a number of chunks >= 0 (0 = off), at most the token budget")
        try:
            object.__setattr__(self, "logit_bias", logit_bias_pairs(() if self.logit_bias is None else self.logit_bias))
        except (TypeError, ValueError) as e:
            bad("logit_bias", str(e) if isinstance(e, ValueError) else "must be a JSON object of token ids and biases")
        if self.logprobs is not None and not (_is_int(self.logprobs, 0) and self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"must be an integer in 0..{MAX_LOGPROBS} (the alternatives returned beside each token)")
        if not _is_int(self.no_repeat_ngram_size, 0):
            bad("no_repeat_ngram_size", "must be an integer >= 0 (0 = off)")
        if not _is_int(self.no_repeat_word_window, 0) or self.no_repeat_word_window == 1:
            bad("no_repeat_word_window", "must be 0 (off) or an integer >= 2")
        for f in fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                bad(f.name, f"must be one of {choices}")
        for name in ("complete_words", "guarantee", "heal", "inflect"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be true or false")
        if self.inflect and self.match != "lemma":
            bad("inflect", "needs match lemma: under the stem rule an inflection such as `sent` is another word")
        if self.match == "lemma":
            from importlib.util import find_spec
            if find_spec("lemminflect") is None:
                raise DBSError("{field} lemma needs lemminflect, a dependency of dbs-fast that is missing here: "
                               "pip install lemminflect", "match", self.match)

    @property
    def opened_rows(self) -> int:
        """Rows a request's first chunk adds to its b free ones for its openings, the most that
        openings begin: b*s candidates in all where it has some (`openings` set), b where not."""
        return self.beams * (self.candidates - 1) if self.openings != "none" else 0

    @property
    def needs_sentence_ends(self) -> bool:
        """Whether the search reads the sentence-end token table (stopping, deadlines, bans)."""
        return self.finishes or bool(self.sentence_deadline) or bool(self.min_sentence)

    @property
    def finishes(self) -> bool:
        """Whether a text ends when it is finished (every keyword, then its end: stop sentence or
        eos), gathering finished candidates, and is cut back to a sentence end at the budget."""
        return self.stop != "max"

    def deadline_within(self, budget):
        """The new tokens by which every keyword is due at a request's own `budget` (an array: per
        row): the budget's end, or `sentence_deadline` or `keyword_deadline` where either comes
        before it."""
        due = np.asarray(budget)
        for d in (self.sentence_deadline, self.keyword_deadline):
            if d:
                due = np.minimum(due, d)
        return due

    @property
    def fallback_tokens(self) -> int:
        """A text that stops at EOS keeps, within this many tokens of the budget
        (`reserve_per_keyword`, at most its last third), a copy of each candidate at a sentence
        end after its last keyword, and the candidate goes on: where the budget then ends every
        beam inside the sentence of its last keyword, with no sentence end after it to cut back
        to, a copy is returned instead (a keyword placed late left 3 of 100 chat answers open at
        the budget). The search is the same with or without them. A stream commits none of these
        last tokens (`commit_within`), so that its text too can be cut back at the budget. 0: none."""
        return int(self.fallback_within(self.max_new_tokens))

    def fallback_within(self, budget):
        """`fallback_tokens` at a request's own `budget` of new tokens (an array: per row)."""
        return np.minimum(self.reserve_per_keyword, np.asarray(budget) // 3) * (self.stop == "eos")

    def commit_within(self, budget):
        """The most tokens a stream commits (`stream_lag`) of a request with `budget` new tokens
        (an array: per request): all but the last `fallback_within(budget)`, whose text an
        answer the budget ends may be cut back into, as an unstreamed one is."""
        return np.asarray(budget) - self.fallback_within(budget)

    @property
    def batched(self) -> "DBSConfig":
        """The config of the running batch that a request at this one joins: the same with the
        budget, the number of `logprobs` alternatives, the `logit_bias`, `subword_fallback` (read
        when the request is built) and the draw's
        `OWN_SAMPLING` settings (temperature, top_p, the repetition, presence and frequency
        penalties) set aside: each request carries its own (`Request.max_new_tokens`, `.logprobs`,
        `.logit_bias`, `.sampling`) and the search and the draw read them per row, so that requests
        that differ in those alone decode together. Its budget is a whole chunk (the cache's chunk
        slots; the stream's lag's, if longer), or the request's own where that is less (a batch of such requests holds
        no more slots than they fill): a hint for the cache, which each admission raises to its
        requests' budgets. Where log-probs are asked, every row keeps the most alternatives
        (`MAX_LOGPROBS`) and each request returns its own number of them."""
        return replace(self, max_new_tokens=min(self.max_new_tokens, max(self.chunk, math.ceil(self.stream_lag))),
                       logprobs=None if self.logprobs is None else MAX_LOGPROBS, logit_bias=(), subword_fallback=False,
                       **OWN_SAMPLING)

    @property
    def lag_tokens(self) -> int:
        """`stream_lag` in tokens: the tokens a commit holds back (a part of a chunk rounds up)."""
        return math.ceil(self.stream_lag * self.chunk - 1e-9) if self.stream_lag else 0

    @property
    def inv_temperature(self) -> float:
        """1 / the temperature the draws scale the logits by: 1 for a greedy draw (temperature 0,
        the mode at temperature 1), and a positive temperature no lower than MIN_TEMPERATURE."""
        return float(inv_temperature(self.temperature))

    @property
    def shapes_logits(self) -> bool:
        """Whether the draw shapes the logits (penalties, n-gram bans, word loops)."""
        return bool(self.shapes_with(self.repetition_penalty, self.presence_penalty, self.frequency_penalty))

    def shapes_with(self, repetition_penalty, presence_penalty, frequency_penalty):
        """`shapes_logits` at these penalties (arrays: per row, a request's own)."""
        return ((self.no_repeat_ngram_size > 0) | (self.no_repeat_word_window > 0)
                | (np.asarray(repetition_penalty) != 1) | (np.asarray(presence_penalty) != 0)
                | (np.asarray(frequency_penalty) != 0))

    @cached_property
    def logit_bias_table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The config's logit bias as the kernel's table of biases reads it (`bias_table`), built
        once per config: one set, or none."""
        return bias_table([self.logit_bias] if self.logit_bias else [])

    def to_dict(self) -> dict:
        """The fields as JSON writes and reads them back (the logit bias as its object)."""
        return {**asdict(self), "logit_bias": {str(t): b for t, b in self.logit_bias}}


def _is_int(v, least: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


def _is_number(v, least: float, most: float) -> bool:
    """A number (not a bool) in least..most; NaN is none."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and least <= v <= most


# The one place where a door's name for a field differs from the field's own (the Python API's):
# `lambda` is a Python keyword, so the field is `lam`; OpenAI's bodies have a `stop` of their own
# (stop sequences) and `max_tokens`, so the engine's stop rule is `stop_at` there.
_JSON_RENAMED = {"lam": "lambda", "lam_named": "lambda_named", "lam_ahead": "lambda_ahead"}
RENAMED = {"json": _JSON_RENAMED,
           "openai": {**_JSON_RENAMED, "stop": "stop_at", "max_new_tokens": "max_tokens"}}
DOORS = ("python", "json", "openai", "cli")


def door_name(name: str, door: str = "json") -> str:
    """What `door` calls the DBSConfig or request field `name`: "python" (the field itself), "json"
    (the service's bodies), "openai" (its OpenAI endpoints' bodies) or "cli" (the flag: the JSON
    name with dashes, "--top-p")."""
    if door == "cli":
        return "--" + door_name(name).replace("_", "-")
    return RENAMED.get(door, {}).get(name, name)


def body_attr(name: str, door: str = "json") -> str:
    """The attribute of a parsed body of `door` that holds the field `name`: its name there, or the
    field's own where that is a Python keyword (an alias then: "lambda")."""
    key = door_name(name, door)
    return name if iskeyword(key) else key


# a stream's fixed lag, in chunks, where the request names none (`stream_lag`; a request not streamed
# has none, so that its text does not change): 4 of a 5-token chunk held back (3 of the chat door's
# 3), so text commits after the first chunk; benchmarks/streaming.py, docs/results/streaming.md
STREAM_LAG = 0.8

# Every DBSConfig field a user can set: (field, CLI flag, type, help). `generate` and `eval` take
# them as flags, the service as JSON fields (`door_name`).
OPTIONS = tuple((f.name, door_name(f.name, "cli"), f.metadata["type"], f.metadata["help"])
                for f in fields(DBSConfig) if f.metadata.get("option"))
CHOICES = {f.name: f.metadata["choices"] for f in fields(DBSConfig) if f.metadata.get("choices")}
JSON_NAMES = {name: door_name(name) for name, *_ in OPTIONS}       # field -> its name in a JSON body
# field -> the CLI flag that sets it: the flags an engine message may name, which it speaks as the CLI
FLAG_FIELDS = {name: door_name(name, "cli") for name in (*JSON_NAMES, "keywords", "context", "ban", "seed", "task",
                                                         "paper")}
FLAG = re.compile(r"`?(--[a-z][a-z0-9-]*)`?")
COMMAND = re.compile(r"dbs-fast [a-z-]+[^,;)]*")          # a command line quoted whole


def door_words(message: str, door: str) -> str:
    """An engine message, in the CLI's words, in `door`'s (`door_name`): each flag it names becomes
    the field of that door's that sets the same option (`--max-new-tokens` is `max_tokens` on the
    OpenAI endpoints, `max_new_tokens` in Python); a flag that no field sets is the server's option
    of that name over HTTP and the argument of that name in Python (`kv_layout`). A command
    line the message quotes (`dbs-fast export --model F --out DIR`) keeps its flags."""
    flags = {flag: door_name(name, door) for name, flag in FLAG_FIELDS.items()}

    def field(m):
        flag = m.group(1)
        if flag in flags:
            return f"`{flags[flag]}`"
        return f"`{flag[2:].replace('-', '_')}`" if door == "python" else f"the server's {flag[2:]} option"

    out, at = [], 0
    for c in COMMAND.finditer(message):
        out += [FLAG.sub(field, message[at:c.start()]), c.group()]
        at = c.end()
    return "".join(out) + FLAG.sub(field, message[at:])

# The presets: the paper's protocol, and the CommonGen task's defaults (where flags leave them open).
# CommonGen: unordered concepts, one sentence, after a context that asks for a sentence. A hidden
# few-shot prompt (3 examples of CommonGen train) names the concepts, so guidance can be gentle:
# lambda 1 kept coverage at 0.98 and the sentences' length at people's (dev sets 0-39: lambda 8
# wrote 6.9-word telegraph, judge perplexity 124; lambda 1, 9.5 words and 49; people, 10.1 and 36).
# With --guarantee the concepts are forced in time for a 24-token sentence and no sentence ends
# before they are all in. The sentence returned is picked (`blend`, the default) among 7 finished
# ones. The first chunk's candidates open with subject phrases ("The dog", "A man"): on dev sets
# 100-249 BLEU-4 rose from 10.0 to 14.3 and CIDEr-D from 10.47 to 13.07, the judge's median level
# (39.6, 40.1). With openings the likeliest finished sentence (`likelihood`) is returned: on all
# 993 dev sets BLEU-4 15.6, CIDEr-D 12.15, judge median 34.9 (people's 33.4), where `blend` gave
# 16.5, 12.56 and 43.8; without openings `blend` gave 13.4, 10.62 and 39.7.
PAPER = {"boost_word_starts": False, "complete_words": False, "alpha_fluent": None, "late_boost_first": False,
         "repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "no_repeat_word_window": 0, "stop": "max",
         "pick": "q", "lam_ahead": None}
COMMONGEN = {"order": "any", "match": "lemma", "max_new_tokens": 40, "lam": 1.0, "lam_ahead": None, "reserve_per_keyword": 6,
             "prompt_style": "few-shot", "shots": 3, "sentence_deadline": 24, "finished": 7, "openings": "subjects",
             "pick": "likelihood"}
# Chat: a rendered conversation as the context, answered at its own length: the answer ends where
# the model ends it (stop "eos"), not at the first sentence end after the last word, which cut
# answers a sentence short and left the words' sentence last (on 20 requests the judge's ratio to
# the model's own answer went from 2.09x to 1.56x where the message leaves the words out). A
# keyword the user's message names is one the model means to write: at lambda 1 (`lam_named`) such
# answers read at 1.3x the judge's perplexity of the model's own where lambda 20 read at 2.5x,
# every word placed; a word the message leaves out needs the full boost (lambda 1 placed a quarter
# of them). Where the message names every word, min_p 0.1 (`min_p_named`) leaves out the tail of
# tokens the model finds implausible (the chat set's 50 such requests: 1.78x -> 1.07x, coverage
# 1.000 -> 0.987); where it leaves one out, min_p would drop that word too. A word the message
# leaves out is boosted at 5 while the answer is ahead of its deadline (`lam_ahead`), the deadline
# at 20 tokens a word still to place: 33 of the 50 such answers more fluent to the judge (1.86x the
# model's own, not 2.01x), 0.980 of their words placed (1.000); at the task's 15 tokens, 0.953.
# The first chunk's candidates open with a word the message leaves out ("The barber"), besides
# the model's own openings (`openings`): on those 50 messages 1.79x, not 1.86x, 0.993 of the words
# placed (0.980); a message naming every word opens as the model means to. Chunks of 3 tokens, not
# 5: the answers 0.86x and 0.97x as perplexing to the judge, paired (1.62x the model's own where
# the message leaves the words out, 1.11x where it names them), coverage 0.983. Unordered words
# matched by lemma, the likeliest of 7 finished answers returned (docs/results/chat.md). A word's
# inflections (`inflect`) are left out: on the 100 requests they read 0.99x as perplexing, paired,
# on both halves, but placed fewer words (0.980 -> 0.973; streamed 0.977 -> 0.967, under 0.97).
# The words are due by the 90th token (`keyword_deadline`) and the answer may run to 150 to end
# where the model ends it: a budget of 90 cut answers back that the model would have gone on with
# (where the message leaves the words out: 1.62x the model's own to the judge -> 1.43x, coverage
# 0.987 both, 1.23x -> 1.21x its length); a deadline counted back from 150 left words out of
# answers that ended before it.
CHAT = {"order": "any", "match": "lemma", "lam_named": 1.0, "min_p_named": 0.1, "lam_ahead": 5.0,
        "reserve_per_keyword": 20, "finished": 7, "pick": "likelihood", "stop": "eos", "openings": "subjects",
        "chunk": 3, "max_new_tokens": 150, "keyword_deadline": 90}
COMMONGEN_CONTEXT = "Here is one sentence describing an everyday scene:\n"
DEFAULT_CONTEXT = "It is"           # the context when a request gives none (the paper's examples start so)
SEED_MAX = 2**63 - 1                # numpy's generators take seeds in 0..2**63-1
TASKS = ("commongen",)


def preset(task: str | None = None, paper: bool = False, chat: bool = False) -> tuple[DBSConfig, str]:
    """The config and the context a request starts from: the default (the chat door's where `chat`),
    the paper's protocol (`paper`) or a task's; the options a request gives apply on top, and a
    context it gives replaces this one."""
    if task is None:
        return (DBSConfig.paper() if paper else DBSConfig.chat() if chat else DBSConfig()), DEFAULT_CONTEXT
    if task not in TASKS:
        raise DBSError.about("task", f"must be one of {list(TASKS)}", task)
    if paper:
        raise DBSError(f"task {task!r} and {{field}} are two presets: give one", "paper", paper)
    return DBSConfig.commongen(), COMMONGEN_CONTEXT
