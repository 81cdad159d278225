"""Quality features of the search: anti-repetition, natural stopping, the quality score's
deadline rules, and their bad input."""
import numpy as np
import pytest
from conftest import GPT2_VOCAB

from dbs_fast import DBSConfig, DirectedBeamSearch
from dbs_fast.cli import main as cli
from dbs_fast.errors import DBSError
from dbs_fast.search.beam import BeamSearch, Request
from dbs_fast.text import occurrence
from dbs_fast.text.constraints import parse_keyword

KW = ["colony", "enemy"]


# -- the engine ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dbs(exported):
    return DirectedBeamSearch(exported["gpt2"], config=DBSConfig.paper(beams=2, candidates=3, chunk=4,
                                                                      max_new_tokens=24))


def _run(dbs, cfg, seed=0, sentence_end=None):
    be = dbs.backend
    ctx = be.encode("It is")
    boosts = [dbs.table.sparse(k, cfg.lam, cfg.boost_cutoff) for k in KW]
    search = BeamSearch(be, dbs.scorer, cfg, [Request(ctx, [parse_keyword(k) for k in KW], seed, boosts)], sentence_end=sentence_end)
    return ctx, search.run()[0].rows


def _max_ngram_count(seq, n):
    grams = [tuple(seq[i:i + n]) for i in range(len(seq) - n + 1)]
    return max((grams.count(g) for g in grams), default=0)


def test_no_repeat_ngram_never_repeats_and_the_test_bites(dbs):
    # penalty < 1 *rewards* reuse: the tiny random model then loops, unless n-grams are banned
    loopy = DBSConfig.paper(beams=2, candidates=3, chunk=4, max_new_tokens=24, repetition_penalty=0.02,
                                       guided=False)
    ctx, rows = _run(dbs, loopy)
    assert max(_max_ngram_count(ctx + list(rows.tokens[i, :rows.n_tok[i]]), 2) for i in range(len(rows.req))) > 1
    from dataclasses import replace

    ctx, rows = _run(dbs, replace(loopy, no_repeat_ngram_size=2))
    for i in range(len(rows.req)):
        assert _max_ngram_count(ctx + list(rows.tokens[i, :rows.n_tok[i]]), 2) == 1


@GPT2_VOCAB
def test_stop_sentence_ends_at_the_first_sentence_end_after_the_last_keyword(dbs):
    from dataclasses import replace

    V = dbs.backend.vocab_size
    ends = np.random.default_rng(0).random(V) < 0.15          # many "sentence ends": stops happen
    dbs._sentence_end = ends                                   # what the API passes to the scheduler
    try:
        cfg = replace(dbs.config, stop="sentence", max_new_tokens=60, lam=40.0)
        stopped = []
        for seed in range(4):
            r = dbs.generate("It is", KW, seed=seed, config=cfg)
            stopped.append(r.stopped)
            if r.stopped == "sentence":
                assert r.success_rate == 1.0
                last_kw = max(f["token"] for f in r.found.values())
                # a sentence end closes the text; none came between the last keyword and it
                assert r.new_tokens >= last_kw and r.new_tokens < cfg.max_new_tokens
            if r.stopped == "trimmed":
                assert r.new_tokens <= cfg.max_new_tokens
        assert "sentence" in stopped
    finally:
        dbs._sentence_end = None


def _sentence_ends(dbs, toks, ends):
    """For a row's tokens: whether its first n tokens end at a real sentence end (a token of the
    table `ends` where a sentence splitter ends the text), and the first n with every keyword in
    (None: never)."""
    texts = dbs.backend.decode_batch([toks[:n] for n in range(1, len(toks) + 1)])

    def real_end(n):
        return ends[toks[n - 1]] and occurrence.ends_a_sentence_here(texts[n - 1])

    all_in = next((n for n, t in enumerate(texts, 1) if all(occurrence.count(t, parse_keyword(k)) for k in KW)), None)
    return real_end, all_in


def test_stop_sentence_scheduler_rule(dbs):
    """Scheduler level: every finished beam ends with a sentence end at or after the point where
    its last keyword appeared, and no earlier sentence end follows that point. A sentence end is a
    token of the table whose text a sentence splitter ends there (not "Dr.")."""
    from dataclasses import replace

    V = dbs.backend.vocab_size
    ends = (np.random.default_rng(1).random(V) < 0.15) | dbs.sentence_end   # many tokens in the table
    cfg = replace(dbs.config, stop="sentence", max_new_tokens=60, lam=40.0)
    finished_any = False
    for seed in range(4):
        ctx, rows = _run(dbs, cfg, seed, sentence_end=ends)
        for i in range(len(rows.req)):
            if not (rows.ended[i] and rows.found[i] == (1 << len(KW)) - 1) or not np.isfinite(rows.cum[i]):
                continue
            finished_any = True
            toks = rows.tokens[i, :rows.n_tok[i]]
            real_end, all_in = _sentence_ends(dbs, toks, ends)
            assert real_end(len(toks)) or toks[-1] in dbs.backend.eos_ids
            assert not any(real_end(n) for n in range(all_in + 1, len(toks)))
    assert finished_any


@GPT2_VOCAB
def test_stop_eos_goes_on_past_sentence_ends_to_the_models_own_end(dbs):
    """stop="eos" (the chat door's): a beam with every keyword in goes on past its sentence ends
    and ends only at EOS; a text the budget ends is cut back to its last sentence end after the
    keywords, as with stop="sentence"."""
    from dataclasses import replace

    V = dbs.backend.vocab_size
    ends = (np.random.default_rng(1).random(V) < 0.15) | dbs.sentence_end   # many tokens in the table
    cfg = replace(dbs.config, stop="eos", max_new_tokens=60, lam=40.0)
    went_on = False
    for seed in range(4):
        ctx, rows = _run(dbs, cfg, seed, sentence_end=ends)
        for i in range(len(rows.req)):
            toks = rows.tokens[i, :rows.n_tok[i]]
            if rows.ended[i]:
                assert toks[-1] in dbs.backend.eos_ids
            real_end, all_in = _sentence_ends(dbs, toks, ends)
            went_on |= all_in is not None and any(real_end(n) for n in range(all_in + 1, len(toks)))
    assert went_on                  # stop="sentence" would have ended those beams there
    streamed = replace(cfg, stream_lag=0.8)     # commits none of the budget's last tokens: it is cut back too
    upto = int(streamed.commit_within(cfg.max_new_tokens))
    assert upto == cfg.max_new_tokens - min(cfg.reserve_per_keyword, cfg.max_new_tokens // 3)
    be = dbs.backend
    boosts = [dbs.table.sparse(k, cfg.lam, cfg.boost_cutoff) for k in KW]
    for seed in range(4):
        request = Request(be.encode("It is"), [parse_keyword(k) for k in KW], seed, boosts)
        fin = BeamSearch(be, dbs.scorer, streamed, [request], sentence_end=ends).run()[0]
        assert 0 < fin.committed <= upto           # it streamed, and held back the budget's last tokens
        for i in np.flatnonzero(fin.rows.ended):   # a beam ends at EOS, as unstreamed
            assert fin.rows.tokens[i, fin.rows.n_tok[i] - 1] in be.eos_ids
    dbs._sentence_end = ends
    trimmed = 0
    try:
        for seed, c in [(seed, c) for seed in range(4) for c in (cfg, streamed)]:
            r = dbs.generate("It is", KW, seed=seed, config=c)
            assert r.stopped in ("eos", "sentence", "trimmed", "max")
            if r.stopped in ("sentence", "trimmed"):    # cut back at the budget: to a sentence end
                assert r.new_tokens <= cfg.max_new_tokens and occurrence.ends_a_sentence_here(r.text)
                trimmed += c.stream_lag > 0
    finally:
        dbs._sentence_end = None
    assert trimmed                                  # a stream the budget ended, cut back as unstreamed


@GPT2_VOCAB
def test_a_text_the_budget_ends_is_a_beam_that_can_be_cut_back_to_a_sentence_end_after_its_keywords(dbs):
    """At the budget, where the beam the pick prefers placed its last keyword in a sentence the
    budget cut off, a beam that placed as many keywords before a sentence end is returned, cut back
    to it; where none did, the preferred beam is returned as it is."""
    from dataclasses import replace

    from dbs_fast.search.beam import Finished
    from dbs_fast.search.result import build_result
    from dbs_fast.search.rows import Rows

    be = dbs.backend
    kws = [parse_keyword(k) for k in KW]

    def rows_of(texts, logps):
        toks = [be.encode(t) for t in texts]
        rows = Rows.new(np.zeros(len(toks), np.int64), max(map(len, toks)), be.pad_id, col0=np.zeros(len(toks), np.int64))
        for i, (t, lp) in enumerate(zip(toks, logps)):
            rows.tokens[i, :len(t)], rows.logp[i, :len(t)], rows.n_tok[i] = t, lp, len(t)
        rows.cum[:] = [2.0 - i for i in range(len(toks))]
        return rows

    def result(texts, logps, cfg, landings=()):
        fin = Finished(Request(be.encode("It is"), kws, 0, context="It is"), rows_of(texts, logps), 1.0, 1,
                       landings=rows_of(landings, [-3.0] * len(landings)) if landings else None)
        return build_result(fin, cfg, be.decode_batch, be.eos_ids, dbs.sentence_end, {})

    cfg = replace(dbs.config, stop="eos", pick="likelihood")
    open_end = " a colony. The enemy was a dog that the cat"            # the likelier: its last keyword's sentence is open
    closed = " a colony. The enemy sat down by the river. It was"      # can be cut back after "river."
    r = result([open_end, closed], [-1.0, -2.0], cfg)
    assert r.generated == " a colony. The enemy sat down by the river." and r.stopped == "trimmed"
    assert r.success_rate == 1.0 and r.beams[0]["text"] == closed
    short = " a colony. It sat down by the river. It was"               # a sentence end, but one keyword fewer
    r = result([open_end, short], [-1.0, -2.0], cfg)
    assert r.generated == open_end and r.stopped == "max" and r.success_rate == 1.0
    r = result([open_end, closed], [-1.0, -2.0], replace(cfg, stop="max"))     # no stop: the pick as it is
    assert r.generated == open_end and r.stopped == "max"
    # no beam can be cut back: a copy kept at a sentence end near the budget is returned, where it
    # placed as many keywords; a beam that can be cut back comes first
    kept = [" a colony. The enemy sat down.", " a colony. It sat down."]
    r = result([open_end, short], [-1.0, -2.0], cfg, landings=kept)
    assert r.generated == kept[0] and r.stopped == "sentence" and r.success_rate == 1.0
    assert {b["text"] for b in r.beams} == {open_end, short, *kept}
    r = result([open_end, short], [-1.0, -2.0], cfg, landings=kept[1:])
    assert r.generated == open_end and r.stopped == "max"
    r = result([open_end, closed], [-1.0, -2.0], cfg, landings=kept)
    assert r.generated == " a colony. The enemy sat down by the river." and len(r.beams) == 2


@GPT2_VOCAB
def test_stop_eos_keeps_copies_at_sentence_ends_near_the_budget_and_searches_the_same(dbs, monkeypatch):
    """stop="eos", streamed or not: a candidate at a sentence end after every keyword within
    `fallback_tokens` of the budget leaves a copy with its request and goes on; the search's rows
    are the same as with no copies kept."""
    from dataclasses import replace

    from dbs_fast.search import beam

    V = dbs.backend.vocab_size
    ends = (np.random.default_rng(1).random(V) < 0.15) | dbs.sentence_end   # many tokens in the table
    cfg = replace(dbs.config, stop="eos", max_new_tokens=60, lam=40.0)
    assert cfg.fallback_tokens == min(cfg.reserve_per_keyword, 20) > 0
    assert replace(cfg, stream_lag=0.8).fallback_tokens == cfg.fallback_tokens
    assert replace(cfg, stop="sentence").fallback_tokens == 0
    be, kept = dbs.backend, 0

    def run(seed):
        boosts = [dbs.table.sparse(k, cfg.lam, cfg.boost_cutoff) for k in KW]
        search = BeamSearch(be, dbs.scorer, cfg, [Request(be.encode("It is"), [parse_keyword(k) for k in KW], seed,
                                                          boosts, context="It is")], sentence_end=ends)
        return search.run()[0]

    for seed in range(6):
        fin = run(seed)
        if fin.landings is not None:
            for i in range(len(fin.landings.req)):
                toks = fin.landings.tokens[i, :fin.landings.n_tok[i]]
                real_end, all_in = _sentence_ends(dbs, toks, ends)
                assert real_end(len(toks)) and all_in is not None and len(toks) > 60 - cfg.fallback_tokens
                kept += 1
        monkeypatch.setattr(beam, "LANDINGS", 0)
        plain = run(seed)
        monkeypatch.undo()
        assert plain.landings is None and np.array_equal(plain.rows.tokens, fin.rows.tokens)
    assert kept


def test_paper_preset_is_the_papers_protocol():
    p = DBSConfig.paper()
    assert (p.lam, p.beams, p.candidates, p.chunk, p.top_p, p.max_new_tokens) == (20.0, 7, 10, 5, 0.9, 90)
    assert p.repetition_penalty == 1.0 and p.no_repeat_ngram_size == 0 and p.stop == "max"
    assert p.alpha == 0.001 and p.alpha_fluent is None and p.c_star == 2.0
    assert DBSConfig().stop == "sentence" and DBSConfig.paper(beams=3).beams == 3


@pytest.mark.parametrize("kw,message", [
    ({"repetition_penalty": 0.0}, "`repetition_penalty` must be > 0"),
    ({"repetition_penalty": -1.0}, "`repetition_penalty`"),
    ({"no_repeat_ngram_size": -1}, "`no_repeat_ngram_size` must be an integer >= 0"),
    ({"stop": "never"}, "'never'"),
    ({"alpha_fluent": -0.1}, "`alpha_fluent`"),
    ({"reserve_per_keyword": -1}, "`reserve_per_keyword`"),
])
def test_config_rejects_bad_values(kw, message):
    with pytest.raises(DBSError, match=message.replace("(", r"\(").replace("[", r"\[")):
        DBSConfig(**kw)


@pytest.mark.parametrize("args,message", [
    (["--repetition-penalty", "0"], "--repetition-penalty must be > 0"),       # the CLI names its flag
    (["--no-repeat-ngram-size", "-2"], "--no-repeat-ngram-size"),
    (["--stop", "eventually"], "'eventually'"),
])
def test_cli_bad_quality_options_exit_2(exported, capsys, args, message):
    assert cli(["generate", "--model", str(exported["gpt2"]), "--keywords", "colony", "--max-new-tokens", "4"]
               + args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_paper_flag_and_overrides(exported, capsys):
    import json

    assert cli(["generate", "--model", str(exported["gpt2"]), "--keywords", "colony", "--paper", "--beams", "2",
                "--candidates", "2", "--max-new-tokens", "6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stopped"] == "max" and out["new_tokens"] == 6


@GPT2_VOCAB
def test_beams_the_budget_ends_join_too_few_finished_candidates(dbs):
    """Where the budget ends a request that gathered fewer finished candidates than `finished`,
    its open beams join them, as a beam search's open hypotheses join its finished ones at the
    length limit (before, the set-aside candidates alone were returned, however few and unlikely)."""
    from dataclasses import replace

    period = dbs.builder.pieces(".")[0]
    cfg = replace(dbs.config, stop="sentence", max_new_tokens=40, lam=40.0, finished=20, pick="likelihood",
                  logit_bias=((period, 8.0),))         # sentence ends come often; the pool never fills
    joined = 0
    for seed in range(4):
        r = dbs.generate("It is", KW, seed=seed, config=cfg)
        done = [b for b in r.beams if b["finished"]]
        assert all(occurrence.ends_a_sentence_here("It is" + b["text"]) for b in done)
        assert r.beams[0]["logprob"] == max(b["logprob"] for b in done)
        joined += r.stopped == "sentence" and len(done) < len(r.beams)      # set aside, and open beams beside
    assert joined


@GPT2_VOCAB
def test_an_open_beam_cut_back_competes_with_the_finished_candidates(dbs):
    """The beams the budget ended beside too few finished candidates (`Finished.open_from`): each
    that can be cut back to a sentence end after every keyword counts as finished, as cut back
    (its text, tokens and mean log-prob), and the likelihood pick weighs it beside them; one that
    cannot stays unfinished."""
    from dataclasses import replace

    from dbs_fast.search.beam import Finished
    from dbs_fast.search.result import build_result
    from dbs_fast.search.rows import Rows

    be = dbs.backend
    kws = [parse_keyword(k) for k in KW]
    pooled = " a colony. The enemy left."
    open_end = " a colony. The enemy sat down by the river. It was"
    cut = " a colony. The enemy sat down by the river."
    short = " a colony. It sat down by the river. It was"                # one keyword fewer

    def result(opens, mean):
        texts = [pooled, *opens]
        toks = [be.encode(t) for t in texts]
        rows = Rows.new(np.zeros(len(toks), np.int64), max(map(len, toks)), be.pad_id, col0=np.zeros(len(toks), np.int64))
        for i, t in enumerate(toks):
            rows.tokens[i, :len(t)], rows.logp[i, :len(t)], rows.n_tok[i] = t, -2.0, len(t)
        rows.ended[0], rows.found[0] = True, 0b11             # finished: ended, every keyword in
        n = len(be.encode(cut))
        rows.logp[1:, :n], rows.logp[1:, n:] = mean, -9.0               # the text after the cut: unlikely
        rows.cum[:] = 1.0
        fin = Finished(Request(be.encode("It is"), kws, 0, context="It is"), rows, 1.0, 1, pooled=True, open_from=1)
        return build_result(fin, replace(dbs.config, stop="eos", pick="likelihood"), be.decode_batch, be.eos_ids,
                            dbs.sentence_end, {})

    r = result([open_end], -1.0)                        # the cut-back beam is the likelier
    assert r.generated == cut and r.stopped == "trimmed" and r.success_rate == 1.0
    assert r.beams[0] == {**r.beams[0], "text": cut, "finished": True, "tokens": len(be.encode(cut))}
    assert r.beams[0]["logprob"] == pytest.approx(-1.0) and r.perplexity == pytest.approx(np.e)
    r = result([open_end], -3.0)                        # the finished candidate is the likelier
    assert r.generated == pooled and [b["finished"] for b in r.beams] == [True, True]
    r = result([short], -1.0)                           # cannot be cut back after every keyword
    assert r.generated == pooled and [b["finished"] for b in r.beams] == [True, False]
    r = result([pooled + " It was"], -3.0)              # cut back to the finished text: once
    assert [b["text"] for b in r.beams] == [pooled]


def test_fluency_weight_switches_back_to_the_papers_at_the_deadline():
    from dbs_fast.search import quality

    cfg = DBSConfig(max_new_tokens=90, alpha=0.001, alpha_fluent=0.02, reserve_per_keyword=10)
    remaining = 31 & ~np.array([0, 0b111, 0b11111, 0b10111])   # of 5 keywords, 0, 3, 5 and 4 placed
    ahead = quality.on_time(cfg, np.full(4, 60), remaining)    # 60 tokens done: 30 left
    # 30 left: 5 words need 50 (late), 2 need 20 (on time), 0 need 0, 1 needs 10
    assert list(ahead) == [False, True, True, True]
    assert list(quality.alphas(cfg, ahead)) == [0.001, 0.02, 0.02, 0.02]
    assert list(quality.alphas(DBSConfig.paper(), ahead)) == [0.001] * 4
    # a sentence deadline comes first: at 20 tokens, 4 left, and no keyword fits in them
    deadline = DBSConfig(max_new_tokens=90, reserve_per_keyword=10, sentence_deadline=24)
    assert list(quality.on_time(deadline, np.full(4, 20), remaining)) == [False, False, True, False]


def test_a_keyword_deadline_before_the_budget_sets_when_each_word_is_due():
    """`keyword_deadline`: the words are due by it, not by the budget's end, which may come later
    (the chat door: due by 90 tokens of a budget of 150); a request's own shorter budget still
    comes first."""
    from dbs_fast.search import quality

    remaining = 31 & ~np.array([0, 0b111, 0b11111, 0b10111])   # of 5 keywords, 0, 3, 5 and 4 placed
    cfg = DBSConfig(max_new_tokens=150, reserve_per_keyword=10)
    assert list(quality.on_time(cfg, np.full(4, 60), remaining)) == [True, True, True, True]   # 90 left
    due = DBSConfig(max_new_tokens=150, reserve_per_keyword=10, keyword_deadline=90)
    assert list(quality.on_time(due, np.full(4, 60), remaining)) == [False, True, True, True]  # 30 left
    assert list(quality.on_time(due, np.full(4, 60), remaining, budget=np.full(4, 75))) == \
        [False, False, True, True]                                                              # 15 left
    assert list(due.deadline_within(np.array([150, 75]))) == [90, 75]
    assert DBSConfig.chat().deadline_within(DBSConfig.chat().max_new_tokens) == 90
    with pytest.raises(DBSError, match="keyword_deadline"):
        DBSConfig(keyword_deadline=-1)


def test_late_rows_boost_before_the_nucleus_cut():
    from dbs_fast.search import quality

    cfg = DBSConfig(max_new_tokens=90, reserve_per_keyword=10)
    done, remaining = np.full(3, 60), 31 & ~np.array([0, 0b111, 0b11111])
    assert list(quality.boost_first(cfg, done, remaining)) == [True, False, False]   # 30 left: only 5 words are late
    assert quality.boost_first(DBSConfig(late_boost_first=False), done, remaining) is False
    assert quality.boost_first(DBSConfig.paper(boost_order="boost_then_filter"), done, remaining) is True


def test_a_later_deadline_for_boosting_before_the_nucleus_cut():
    """`boost_first_reserve`: between the deadline and the later one a row is late (the paper's
    alpha, the full boost) but boosts after the nucleus cut, so that its word goes in where the
    model's nucleus holds it; behind the later deadline it boosts first, as every late row does
    without the option."""
    from dbs_fast.search import quality

    cfg = DBSConfig(max_new_tokens=90, reserve_per_keyword=10, boost_first_reserve=5)
    done, remaining = np.array([60, 70, 60, 85]), np.array([0b11111, 0b11111, 0b111, 0b11])
    # left 30, 20, 30, 5; the deadline needs 50, 50, 30, 20 of them, the later one 25, 25, 15, 10
    assert list(quality.on_time(cfg, done, remaining)) == [False, False, True, False]
    assert list(quality.boost_first(cfg, done, remaining)) == [False, True, False, True]
    assert list(quality.boost_first(DBSConfig(max_new_tokens=90, reserve_per_keyword=10), done, remaining)) == \
        [True, True, False, True]
    with pytest.raises(DBSError, match="boost_first_reserve"):
        DBSConfig(reserve_per_keyword=10, boost_first_reserve=11)


@GPT2_VOCAB
def test_finished_candidates_are_gathered_across_chunks_and_picked_among(dbs):
    """stop="sentence" with `finished` N: each finished candidate is set aside and the other beams
    go on until N different ones are in (or the budget ends, and the beams it ended join them).
    The result's beams are those candidates, the set-aside ones finished and different; the first
    chunk's are among them (the search is the same up to there); a pick chooses among them all."""
    from dataclasses import replace

    ends = np.random.default_rng(0).random(dbs.backend.vocab_size) < 0.15
    dbs._sentence_end = ends
    try:
        cfg = replace(dbs.config, stop="sentence", max_new_tokens=60, lam=40.0)
        gathered = 0
        for seed in range(4):
            one = dbs.generate("It is", KW, seed=seed, config=cfg)
            many = dbs.generate("It is", KW, seed=seed, config=replace(cfg, finished=4))
            if not one.beams[0]["finished"]:
                continue
            texts = [b["text"] for b in many.beams if b["finished"]]
            assert len(set(texts)) == len(texts)
            assert {b["text"] for b in one.beams} <= set(texts)
            assert many.stopped in ("sentence", "eos", "trimmed") and many.success_rate == 1.0
            gathered = max(gathered, len(texts))
            liked = dbs.generate("It is", KW, seed=seed, config=replace(cfg, finished=4, pick="likelihood"))
            assert liked.beams[0]["logprob"] == max(b["logprob"] for b in many.beams if b["finished"])
            batch = dbs.batch(replace(cfg, finished=4, pick="likelihood"))   # what a stream sends stays true
            batch.admit([dbs.request("It is", KW, seed=seed, config=batch.config)])
            certain, done = [], []
            while not done:
                certain += [t for _, t in batch.certain()]
                done = batch.decode_chunk()
            assert all(done[0][1].generated.startswith(t) for t in certain)
        assert gathered > 1
    finally:
        dbs._sentence_end = None
