"""Continuous batching in the engine: requests join a running batch and leave it between chunks,
and each gets exactly the result it gets alone (tiny random GPT-2, seconds)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from dbs_fast.api import DirectedBeamSearch
from dbs_fast.config import DBSConfig

# 22 tokens in chunks of 4 (a short last chunk); n-gram bans and a two-word ban need each row's
# history, which is shifted for rows that joined late. The word-loop rule is off: it reads the same
# history, and with it on these seeds reach a draw at a boundary that a last-bit difference of
# the logits (6e-8: this tiny model's prefix graph in a batch of four requests, against alone)
# flips
CFG = DBSConfig(beams=2, candidates=3, chunk=4, max_new_tokens=22, no_repeat_ngram_size=2, no_repeat_word_window=0,
                stop="max")
JOBS = [("It is", "colony,enemy", None, 0),
        ("The quick brown fox jumps over the lazy dog near the river", "mouth|meet", "of the", 1),
        ("A", "speed,river,enemy", "fox", 2),
        ("Colonies, mouths, meetings and", "meet", None, 3)]


@pytest.fixture(scope="module", params=["prefix", "rows"])
def dbs(exported, request):
    """Both KV layouts: the prefix cache's (each beam's prefix once) and one cache row per candidate."""
    return DirectedBeamSearch(exported["gpt2"], config=CFG, kv_layout=request.param)


def _alone(dbs, cfg, job):
    ctx, kw, ban, seed = job
    return dbs.generate(ctx, kw, seed=seed, config=cfg, ban=ban)


def _staggered(dbs, cfg, jobs, join_after=1, drop=None):
    """Jobs join one by one, `join_after` chunks apart; `drop`: a job cancelled after its first chunk."""
    batch = dbs.batch(cfg)
    reqs = [dbs.request(c, k, b, s, cfg) for c, k, b, s in jobs]
    out, waiting, steps = {}, list(reqs), 0
    while waiting or batch.requests:
        if waiting and steps % join_after == 0:
            batch.admit([waiting.pop(0)])
        if batch.requests:
            out.update((id(r), res) for r, res in batch.decode_chunk())
        steps += 1
        if drop is not None and steps == 2 and any(r is reqs[drop] for r in batch.requests):
            batch.drop([reqs[drop]])
    assert batch.n_rows == 0 and batch.search.cache is None
    return [out.get(id(r)) for r in reqs]


@pytest.mark.parametrize("cfg", [CFG, replace(CFG, order="any", guarantee=True, stop="sentence"),
                                 replace(CFG, chunk=5, max_new_tokens=20, repetition_penalty=1.3)],
                         ids=["next-max", "any-guarantee-sentence", "penalty"])
def test_a_request_that_joins_a_running_batch_gets_the_result_it_gets_alone(dbs, cfg):
    alone = [_alone(dbs, cfg, j) for j in JOBS]
    for join_after in (1, 2):
        merged = _staggered(dbs, cfg, JOBS, join_after)
        for a, m in zip(alone, merged):
            assert m.generated == a.generated and m.found == a.found and m.stopped == a.stopped
            assert m.perplexity == pytest.approx(a.perplexity, rel=1e-4)
            assert [b["text"] for b in m.beams] == [b["text"] for b in a.beams]


@pytest.mark.parametrize("cfg", [CFG, replace(CFG, stop="eos"), replace(CFG, stop="eos", stream_lag=0.5)],
                         ids=["max", "eos", "eos-streamed"])
def test_requests_that_differ_in_their_budget_alone_share_a_batch_and_get_what_they_get_alone(dbs, cfg):
    """Each request carries its budget: one batch, at the config with the budget set aside, runs
    requests of 22, 9, 14 and 5 new tokens, each to its own budget. A budget under a chunk batches
    with its like only (its batch holds no chunk slots it cannot fill)."""
    budgets = (22, 9, 14, 5)
    own = [replace(cfg, max_new_tokens=n) for n in budgets]
    alone = [_alone(dbs, c, j) for c, j in zip(own, JOBS)]
    assert len({c.batched for c in own}) == 1 and replace(cfg, max_new_tokens=3).batched != cfg.batched
    batch = dbs.batch(cfg.batched)
    reqs = [dbs.request(c, k, b, s, o) for o, (c, k, b, s) in zip(own, JOBS)]
    out, waiting = {}, list(reqs)
    while waiting or batch.requests:
        if waiting:
            batch.admit([waiting.pop(0)])
        out.update((id(r), res) for r, res in batch.decode_chunk())
    for r, a, n in zip(reqs, alone, budgets):
        m = out[id(r)]
        assert m.generated == a.generated and m.found == a.found and m.stopped == a.stopped
        assert m.new_tokens == a.new_tokens <= n and m.success_length == a.success_length
    assert max(a.new_tokens for a in alone) > min(budgets)      # the budgets bite


def _one_batch(dbs, own: list) -> list:
    """JOBS at their own configs `own` in one batch at the config they share (`DBSConfig.batched`),
    two from the start and one more after each chunk: each one's result."""
    batch = dbs.batch(own[0].batched)
    reqs = [dbs.request(c, k, b, s, o) for o, (c, k, b, s) in zip(own, JOBS)]
    batch.admit(reqs[:2])
    out, waiting = {}, reqs[2:]
    while waiting or batch.requests:
        out.update((id(r), res) for r, res in batch.decode_chunk())
        if waiting:
            batch.admit([waiting.pop(0)])
    return [out[id(r)] for r in reqs]


def _same_logprobs(m, a) -> None:
    """The tokens and alternatives of `m`'s answer and beams are `a`'s; the log-probs to the last bits."""
    for got, want in [(m.logprobs, a.logprobs)] + [(x["logprobs"], y["logprobs"]) for x, y in zip(m.beams, a.beams)]:
        assert _entries(got) == _entries(want)
        np.testing.assert_allclose(_logprobs(got), _logprobs(want), atol=1e-4)


def test_requests_that_differ_in_their_logprobs_alone_share_a_batch_and_get_what_they_get_alone(dbs):
    """Each request returns its own number of alternatives per token from one batch whose rows keep
    the most: the texts, tokens, log-probs and alternatives of each are those it gets alone."""
    own = [replace(CFG, logprobs=n) for n in (0, 3, 20, 1)]
    alone = [_alone(dbs, c, j) for c, j in zip(own, JOBS)]
    assert len({c.batched for c in own}) == 1 and CFG.batched != own[0].batched
    for m, a, o in zip(_one_batch(dbs, own), alone, own):
        assert m.generated == a.generated and [len(e["top"]) for e in m.logprobs] == [o.logprobs] * len(m.logprobs)
        _same_logprobs(m, a)


SAMPLING = {"temperature-top_p": [dict(temperature=t, top_p=p)
                                  for t, p in [(1.0, 0.9), (0.0, 0.9), (0.5, 1.0), (1.6, 0.6)]],
            # no n-gram bans: a request with no penalties is not shaped at all, beside those that are
            "penalties": [dict(no_repeat_ngram_size=0, repetition_penalty=r, presence_penalty=p, frequency_penalty=f)
                          for r, p, f in [(1.0, 1.5, 0.0), (1.0, 0.0, 0.0), (1.4, 0.0, 0.5), (1.0, -0.5, 1.0)]],
            "logit_bias": [dict(logit_bias=b) for b in [{262: 8.0, 13: -100.0}, {}, {11: 6.0}, {262: 8.0, 13: -100.0}]]}


@pytest.mark.parametrize("kind", SAMPLING)
def test_requests_that_differ_in_their_sampling_alone_share_a_batch_and_get_what_they_get_alone(dbs, kind):
    """Each request draws at its own temperature (0: greedy) and top_p, its own repetition,
    presence and frequency penalties, or its own logit bias, in one batch whose config sets them
    aside: its text, tokens
    and log-probs (the model's own at its temperature) and its alternatives are those it gets
    alone."""
    own = [replace(CFG, logprobs=2, **o) for o in SAMPLING[kind]]
    alone = [_alone(dbs, c, j) for c, j in zip(own, JOBS)]
    assert len({c.batched for c in own}) == 1 and CFG.batched != replace(CFG, no_repeat_ngram_size=3).batched
    assert _alone(dbs, replace(own[0], **SAMPLING[kind][1]), JOBS[0]).generated != alone[0].generated  # they bite
    for m, a in zip(_one_batch(dbs, own), alone):
        assert m.generated == a.generated and m.found == a.found and m.stopped == a.stopped
        assert [b["text"] for b in m.beams] == [b["text"] for b in a.beams]
        _same_logprobs(m, a)


def _entries(tokens):
    return [(e["id"], e["token"], [(t["id"], t["token"]) for t in e["top"]]) for e in tokens]


def _logprobs(tokens):
    return [[e["logprob"]] + [t["logprob"] for t in e["top"]] for e in tokens]


def test_a_dropped_request_leaves_no_result_and_changes_no_other(dbs):
    alone = [_alone(dbs, CFG, j) for j in JOBS]
    merged = _staggered(dbs, CFG, JOBS, 1, drop=1)
    assert merged[1] is None
    for i in (0, 2, 3):
        assert merged[i].generated == alone[i].generated


def test_a_request_leaving_while_another_is_forced_mid_keyword_changes_nothing(dbs):
    """The forced-sequence table is rebuilt when a request leaves; rows forced across a chunk
    boundary must follow their sequence into the new table (CommonGen dev sets 770-773 under
    --guarantee: an IndexError, or another request's tokens forced)."""
    cfg = replace(CFG, order="any", guarantee=True, max_new_tokens=16, stop="max", no_repeat_ngram_size=0)
    first = ("It is", "colony,enemy", None, 0)            # its sequences come first in the table
    jobs = [("A", "mouth,qwzxvbnmkj", None, 5), ("The river", "speed,qwzxvbnmkj", None, 6)]
    bit = False
    for job in jobs:
        alone = _alone(dbs, cfg, job)
        for drop_at in (1, 2, 3):
            batch = dbs.batch(cfg)
            reqs = [dbs.request(c, k, b, s, cfg) for c, k, b, s in (first, job)]
            batch.admit(reqs)
            out = {}
            for step in range(1, 5):
                out.update((id(r), res) for r, res in batch.decode_chunk())
                if step == drop_at:
                    rows = batch.search.rows
                    bit |= bool(((rows.fseq >= 0) & (rows.req == 1)).any())
                    batch.drop([reqs[0]])
            assert out[id(reqs[1])].generated == alone.generated, drop_at
    assert bit            # the test bites: some drop came while the other request was mid-keyword


def test_the_cache_keeps_only_columns_some_row_needs(dbs):
    """Once the long-context request leaves, the padding it forced on the others is cut away."""
    batch = dbs.batch(CFG)
    longer = (JOBS[1][0] + ", and the cat sleeps under the old oak tree all day",) + JOBS[1][1:]
    short, long_ = (dbs.request(c, k, b, s, CFG) for c, k, b, s in (JOBS[0], longer))
    batch.admit([long_])
    batch.decode_chunk()
    batch.admit([short])
    width = batch.search.cache.length
    batch.drop([long_])
    assert batch.search.cache.length < width
    lay = batch.search.cache
    if hasattr(lay, "cache"):
        # the prefix cache: fewer than ALIGN leading columns of each level are padding in every row
        # (its widths are multiples of ALIGN), the context level's where it has a token (short
        # contexts are in the beams' prefixes, one masked column left)
        from dbs_fast.kv.prefix_cache import ALIGN, padding_columns

        assert padding_columns(lay.cache.mask) < ALIGN and lay.cache.mask.shape[1] % ALIGN == 0
        assert lay.cache.context_mask.shape[1] == 1 or padding_columns(lay.cache.context_mask) < ALIGN
    else:                                                    # the rows' cache: its first column is used
        assert lay.mask.any(axis=0)[0]
    rest = []
    while batch.requests:
        rest += batch.decode_chunk()
    assert rest[0][1].generated == _alone(dbs, CFG, JOBS[0]).generated


def test_a_beam_that_ended_before_its_words_does_not_commit():
    """The commit takes the best kept beam that goes on: one that ended at EOS before its words
    (the best by Q here) would have its copies replace every other beam, and the stream end there,
    without its words (3 of 100 chat answers streamed at lag 0.8)."""
    import numpy as np

    from dbs_fast.search.beam import Slot
    from dbs_fast.search.commit import commit
    from dbs_fast.search.quality import keep_going
    from dbs_fast.search.rows import Rows

    rows = Rows.new(np.zeros(3, np.int64), 0, 0, cum=np.array([5.0, 3.0, 1.0]), ended=np.array([True, False, False]),
                    tokens=np.array([[7, 8, 0, 0], [7, 9, 4, 4], [6, 6, 6, 6]]), n_tok=np.array([3, 4, 4]),
                    col0=np.zeros(3, np.int64))
    slot = Slot(None, np.random.default_rng(0), 0.0, 0)
    no_cap = np.array([4])
    keep = commit(rows, np.arange(3), [slot], np.array([True]), 2, no_cap)
    assert slot.committed == 2 and list(keep) == [1, 1, 1]
    slot.committed, rows.ended[2] = 0, True           # every kept beam ended: the best that goes on is kept
    keep = commit(rows, keep_going(rows, np.array([0, 2]), np.array([True]), np.ones(3, np.int64)), [slot],
                  np.array([True]), 2, no_cap)
    assert slot.committed == 2 and list(keep) == [1, 1]
    rows.ended[:] = True                              # none goes on: the best ended one commits
    slot.committed = 0
    keep = commit(rows, np.arange(3), [slot], np.array([True]), 2, no_cap)
    assert slot.committed == 1 and list(keep) == [0, 1, 0]      # row 1 starts with its token 7


def test_a_commit_holds_back_the_tokens_an_answer_may_be_cut_back_into():
    """A commit covers no more than `upto` tokens of its request (`DBSConfig.commit_within`: the
    budget less the copies' window near it), and drops the copies near the budget that disagree
    with what it commits, as it drops the finished candidates set aside; once a finished answer is
    set aside, it commits nothing more, so that the pick among the finished answers stays open."""
    import numpy as np

    from dbs_fast.config import DBSConfig
    from dbs_fast.search.beam import Slot
    from dbs_fast.search.commit import commit
    from dbs_fast.search.rows import Rows

    def rows_of(tokens, cum):
        tokens = np.array(tokens)
        return Rows.new(np.zeros(len(tokens), np.int64), 0, 0, cum=np.array(cum, float),
                        ended=np.zeros(len(tokens), bool), tokens=tokens, n_tok=np.full(len(tokens), tokens.shape[1]),
                        col0=np.zeros(len(tokens), np.int64))

    rows = rows_of([[7, 8, 9, 4, 5, 6], [7, 8, 3, 3, 3, 3]], [2.0, 1.0])
    slot = Slot(None, np.random.default_rng(0), 0.0, 0)
    slot.keep_landing(rows_of([[7, 8, 9, 4]], [0.0]))     # agrees with the best beam
    slot.keep_landing(rows_of([[7, 8, 3, 3]], [0.0]))     # does not
    keep = commit(rows, np.arange(2), [slot], np.array([True]), 1, np.array([3]))
    assert slot.committed == 3 and list(keep) == [0, 0]          # 5 older than the lag; 3 at most
    assert [list(p.generated(i)) for p in slot.landings for i in range(len(p.req))] == [[7, 8, 9, 4]]
    rows = rows_of([[7, 8, 9, 4, 5, 6, 1], [7, 8, 3, 3, 3, 3, 3]], [2.0, 1.0])
    slot.set_aside(rows_of([[7, 8, 9, 4, 0]], [0.0]))     # a finished answer: the pick is made at the end
    keep = commit(rows, np.arange(2), [slot], np.array([True]), 1, np.array([6]))
    assert slot.committed == 3 and list(keep) == [0, 1] and len(slot.pool) == len(slot.landings) == 1
    cfg = DBSConfig(stop="eos", reserve_per_keyword=20)
    assert list(cfg.commit_within(np.array([150, 30]))) == [130, 20]    # at most the budget's last third
    assert list(DBSConfig(stop="sentence").commit_within(np.array([150]))) == [150]


def test_a_request_whose_kept_beams_all_ended_before_their_words_goes_on():
    """Streamed or not, where every kept beam of a request ended at EOS before its words, the best
    candidate that goes on takes the worst kept one's place, so the request goes on to place its
    words; a request that ends this chunk, whose candidates all ended, or a kept beam of which ended
    with every word in (one without keywords: at its EOS), keeps what it kept."""
    import numpy as np

    from dbs_fast.search.quality import keep_going
    from dbs_fast.search.rows import Rows

    rows = Rows.new(np.array([0, 0, 0, 1, 1]), 0, 0, cum=np.array([5.0, 3.0, 1.0, 2.0, 4.0]),
                    ended=np.array([True, False, True, True, True]), tokens=np.zeros((5, 4), np.int64),
                    n_tok=np.full(5, 4), col0=np.zeros(5, np.int64))
    keep = np.array([0, 2, 3, 4])                                 # request 0: rows 0 and 2, both ended
    missing = np.array([1, 1, 1, 0, 0])                           # request 1 has every word in
    assert list(keep_going(rows, keep, np.array([True, True]), missing)) == [0, 1, 3, 4]
    assert list(keep_going(rows, keep, np.array([False, True]), missing)) == [0, 2, 3, 4]   # request 0 ends now
    missing[2] = 0                                                # its kept row 2 ended complete
    assert list(keep_going(rows, keep, np.array([True, True]), missing)) == [0, 2, 3, 4]
    missing[2], rows.ended[1] = 1, True                           # no candidate of request 0 goes on
    assert list(keep_going(rows, keep, np.array([True, True]), missing)) == [0, 2, 3, 4]


@pytest.mark.parametrize("lag", [0, 0.5, 1, 2])
def test_certain_text_is_a_prefix_of_the_final_text(dbs, lag):
    """What a stream sends between chunks only grows and starts the final text; with a fixed lag
    (`stream_lag`) it is there before the end."""
    cfg = replace(CFG, stop="sentence", stream_lag=lag)
    batch = dbs.batch(cfg)
    req = dbs.request("It is", "colony,enemy", None, 0, cfg)
    batch.admit([req])
    seen, final = [], None
    while batch.requests:
        done = batch.decode_chunk()
        if done:
            final = done[0][1]
        else:
            (r, text), = batch.certain()
            assert r is req
            seen.append(text)
    assert final is not None and seen                        # certain text was asked for between chunks
    for s in seen:
        assert final.generated.startswith(s)
    assert all(a == b[:len(a)] for a, b in zip(seen, seen[1:]))   # it only grows
    if lag:
        assert seen[-1]                                        # committed before the request ended
    if lag < 1:                                                # a part of a chunk: after the first one
        assert bool(seen[0]) == bool(lag)
