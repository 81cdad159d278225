"""The Numba logits kernel against the NumPy reference (tests/naive.py) and transformers."""
import sys

import numpy as np
import pytest
from naive import (
    banned_ngram_tokens,
    banned_tokens,
    sample_ref,
    shape_logits,
)
from naive import (
    word_loop_tokens as word_loop_ref,
)

from dbs_fast import kernels
from dbs_fast.kernels import StepRules, csr_boosts, word_loop_tokens
from dbs_fast.text.embeddings import SparseBoost


def sample(logits, u, **rules):
    """The kernel under rules given by name (`StepRules.given`)."""
    return kernels.sample(logits, u, StepRules.given(**rules))


def _case(seed, R=24, V=3000, scale=3.0, n_boost=200, values=lambda rng, n: rng.random(n) * 20):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((R, V)) * scale).astype(np.float32)
    boosts = []
    for w in range(3):
        ids = np.sort(rng.choice(V, n_boost, replace=False)).astype(np.int32)
        boosts.append(SparseBoost(str(w), ids, values(rng, n_boost).astype(np.float32)))
    row_word = rng.integers(-1, 3, R).astype(np.int32)
    dense = []
    for r in range(R):
        d = None
        if row_word[r] >= 0:
            d = np.zeros(V)
            d[boosts[row_word[r]].ids] = boosts[row_word[r]].values
        dense.append(d)
    return rng, logits, boosts, row_word, dense


@pytest.mark.parametrize("boost_first", [False, True])
@pytest.mark.parametrize("top_p,temperature", [(0.9, 1.0), (0.5, 0.7), (1.0, 1.3), (0.999, 1.0)])
def test_kernel_matches_reference_exactly(boost_first, top_p, temperature):
    rng, logits, boosts, row_word, dense = _case(1)
    ptr, ids, vals = csr_boosts(boosts)
    for _ in range(5):
        u = rng.random(len(logits))
        got, glp = sample(logits, u, temperature=temperature, top_p=top_p, row_word=row_word, boosts=(ptr, ids, vals), boost_first=boost_first)
        want, wlp = sample_ref(logits, u, temperature, top_p, dense, boost_first)
        assert np.array_equal(got, want)
        np.testing.assert_allclose(glp, wlp, atol=1e-4)


def test_unguided_rows_ignore_boosts_and_logp_is_unguided():
    _, logits, boosts, _, _ = _case(2, R=4)
    u = np.full(4, 0.37)
    plain, lp_plain = sample(logits, u)
    ptr, ids, vals = csr_boosts(boosts)
    off, _ = sample(logits, u, row_word=np.full(4, -1, np.int32), boosts=(ptr, ids, vals))
    assert np.array_equal(plain, off)
    on, lp_on = sample(logits, u, row_word=np.zeros(4, np.int32), boosts=(ptr, ids, vals))
    s = logits.astype(np.float64)
    ref = s[np.arange(4), on] - np.log(np.exp(s - s.max(1, keepdims=True)).sum(1)) - s.max(1)
    np.testing.assert_allclose(lp_on, ref, atol=1e-4)                     # log softmax, not boosted


def test_kernel_distribution_matches_nucleus_probabilities():
    rng = np.random.default_rng(3)
    V, n = 50, 40000
    row = (rng.standard_normal(V) * 2).astype(np.float32)
    logits = np.repeat(row[None], n, 0)
    got, _ = sample(logits, rng.random(n), top_p=0.8)
    p = np.exp(row - row.max())
    p /= p.sum()
    order = np.argsort(-p)
    keep = order[: np.searchsorted(np.cumsum(p[order]), 0.8) + 1]
    want = np.zeros(V)
    want[keep] = p[keep] / p[keep].sum()
    freq = np.bincount(got, minlength=V) / n
    assert set(np.flatnonzero(freq)) <= set(keep)
    assert np.abs(freq - want).max() < 0.01


def test_nucleus_set_equals_transformers_top_p():
    torch = pytest.importorskip("torch")
    from transformers import TopPLogitsWarper

    rng = np.random.default_rng(4)
    logits = (rng.standard_normal((8, 5000)) * 4).astype(np.float32)
    warped = TopPLogitsWarper(top_p=0.9)(None, torch.from_numpy(logits.copy())).numpy()
    hf_kept = np.isfinite(warped)
    # the kernel's kept set: every token it can draw; draw with uniforms that sweep the whole CDF
    for r in range(8):
        rows = np.repeat(logits[r:r + 1], 2000, 0)
        ids, _ = sample(rows, np.linspace(0, 1, 2000, endpoint=False))
        assert set(ids) <= set(np.flatnonzero(hf_kept[r]))
        ref_ids, _ = sample_ref(logits[r:r + 1], np.array([0.0]), top_p=0.9)
        # kept set from the reference formula equals HF's (no ties in continuous random logits)
        s = logits[r].astype(np.float64)
        order = np.argsort(-s)
        p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
        k = np.searchsorted(np.cumsum(p[order]), 0.9)
        assert set(order[: k + 1]) == set(np.flatnonzero(hf_kept[r]))


def _histories(rng, R, V, H=60, vocab_used=40):
    """Left-padded histories (R, H) with many repeats (small alphabet) and their start offsets."""
    hist = np.full((R, H), -7, np.int32)                     # pad never read
    start = rng.integers(0, H // 2, R).astype(np.int32)
    alphabet = rng.choice(V, vocab_used, replace=False)
    for r in range(R):
        hist[r, start[r]:] = rng.choice(alphabet, H - start[r])
    return hist, start, [hist[r, start[r]:] for r in range(R)]


@pytest.mark.parametrize("boost_first", [False, True])
@pytest.mark.parametrize("penalty,ngram", [(1.3, 0), (1.0, 2), (1.2, 3), (0.8, 1), (2.0, 4)])
@pytest.mark.parametrize("top_p", [0.9, 1.0])
def test_anti_repetition_matches_reference_exactly(boost_first, penalty, ngram, top_p):
    rng, logits, boosts, row_word, dense = _case(5)
    hist, start, rows = _histories(rng, len(logits), logits.shape[1])
    # make repeated tokens likely, so the penalty and the bans decide draws
    for r, h in enumerate(rows):
        logits[r, h] += 4.0
    ptr, ids, vals = csr_boosts(boosts)
    for _ in range(5):
        u = rng.random(len(logits))
        got, glp = sample(logits, u, top_p=top_p, row_word=row_word, boosts=(ptr, ids, vals), boost_first=boost_first,
                          history=hist, history_start=start, repetition_penalty=penalty, no_repeat_ngram_size=ngram)
        want, wlp = sample_ref(logits, u, 1.0, top_p, dense, boost_first, rows, penalty, ngram)
        assert np.array_equal(got, want)
        np.testing.assert_allclose(glp, wlp, atol=1e-4)          # the model's own log-prob, unshaped
        for r, h in enumerate(rows):
            assert got[r] not in banned_ngram_tokens(h, ngram)


@pytest.mark.parametrize("boost_first", [False, True])
@pytest.mark.parametrize("min_p,top_p,penalty", [(0.05, 0.9, 1.0), (0.2, 1.0, 1.0), (0.1, 0.9, 1.3), (0.5, 0.5, 1.0)])
def test_min_p_matches_reference_exactly(boost_first, min_p, top_p, penalty):
    """min_p beside top-p, in both boost orders and after the penalties: the kernel draws the
    reference's tokens, never one the model finds less than min_p times as likely as its top token
    (boosts aside), returns the model's own log-prob, and lets a forced token through."""
    rng, logits, boosts, row_word, dense = _case(21, scale=2.0)
    R = len(logits)
    hist, start, rows = _histories(rng, R, logits.shape[1])
    ptr, ids, vals = csr_boosts(boosts)
    force = np.full(R, -1)
    force[2] = int(np.argmin(logits[2]))                       # far below any min_p
    for _ in range(5):
        u = rng.random(R)
        got, glp = sample(logits, u, top_p=top_p, min_p=min_p, row_word=row_word, boosts=(ptr, ids, vals),
                          boost_first=boost_first, history=hist, history_start=start, repetition_penalty=penalty,
                          force=force)
        want, wlp = sample_ref(logits, u, 1.0, top_p, dense, boost_first, rows, penalty, force=force, min_p=min_p)
        assert np.array_equal(got, want)
        np.testing.assert_allclose(glp, wlp, atol=1e-4)
        assert got[2] == force[2]
        for r in range(R):
            own = shape_logits(logits[r], rows[r], penalty).astype(np.float64)
            assert r == 2 or np.exp(own[got[r]] - own.max()) >= min_p


@pytest.mark.parametrize("boost_first", [False, True])
def test_pytorch_baselines_min_p_draws_the_references_tokens(boost_first):
    """The PyTorch baseline's sampler (`torch_sample`) applies min_p as the kernel does."""
    torch = pytest.importorskip("torch")
    from dbs_fast.config import DBSConfig
    from dbs_fast.torch_backend import torch_sample

    rng, logits, boosts, row_word, dense = _case(23, scale=2.0)
    table = torch.as_tensor(kernels.dense_boosts(*csr_boosts(boosts), logits.shape[1], exp=False))
    for min_p, top_p in ((0.05, 0.9), (0.3, 1.0)):
        u = rng.random(len(logits))
        got, _ = torch_sample(torch.as_tensor(logits), u, row_word, table, DBSConfig(top_p=top_p, min_p=min_p),
                              boost_first)
        want, _ = sample_ref(logits, u, 1.0, top_p, dense, boost_first, min_p=min_p)
        assert np.array_equal(got.numpy(), want)


@pytest.mark.parametrize("boost_first", [False, True])
def test_each_row_draws_at_its_own_min_p(boost_first):
    """`row_min_p`: each row filters at its request's min_p (0 = off for that row), the kernel, the
    reference and the PyTorch sampler alike; a row draws what a batch at its min_p alone draws."""
    rng, logits, boosts, row_word, dense = _case(24, scale=2.0)
    R = len(logits)
    per_row = np.resize([0.0, 0.3, 0.05, 0.6], R)
    ptr, ids, vals = csr_boosts(boosts)
    for _ in range(5):
        u = rng.random(R)
        got, _ = sample(logits, u, top_p=0.9, row_min_p=per_row, row_word=row_word, boosts=(ptr, ids, vals),
                        boost_first=boost_first)
        want, _ = sample_ref(logits, u, 1.0, 0.9, dense, boost_first, min_p=per_row)
        assert np.array_equal(got, want)
        for p in np.unique(per_row):
            alone, _ = sample(logits, u, top_p=0.9, min_p=float(p), row_word=row_word, boosts=(ptr, ids, vals),
                              boost_first=boost_first)
            assert np.array_equal(got[per_row == p], alone[per_row == p])
        torch = pytest.importorskip("torch")
        from dbs_fast.config import DBSConfig
        from dbs_fast.torch_backend import torch_sample

        table = torch.as_tensor(kernels.dense_boosts(ptr, ids, vals, logits.shape[1], exp=False))
        tgot, _ = torch_sample(torch.as_tensor(logits), u, row_word, table, DBSConfig(top_p=0.9), boost_first, per_row)
        assert np.array_equal(tgot.numpy(), want)


@pytest.mark.parametrize("boost_first", [False, True])
def test_each_row_draws_at_its_own_temperature_and_top_p(boost_first):
    """`row_temperature`, `row_top_p`: each row scales and filters at its request's (temperature 0:
    greedy, ranked), the kernel, the reference and the PyTorch sampler alike, with its log-prob the
    model's own at its temperature; a row draws what a batch at its settings alone draws; rows that
    read one logits row under other settings are shaped apart."""
    rng, logits, boosts, row_word, dense = _case(25, scale=2.0)
    R = len(logits)
    temps = np.resize([1.0, 0.0, 0.6, 1.7, 0.0, 0.005], R)
    top_ps = np.resize([0.9, 1.0, 0.5, 0.95], R)
    rank = np.resize([0, 1, 2], R)
    ptr, ids, vals = csr_boosts(boosts)
    guide = dict(row_word=row_word, boosts=(ptr, ids, vals), boost_first=boost_first, rank=rank)
    for _ in range(4):
        u = rng.random(R)
        got, glp = sample(logits, u, row_sampling={"temperature": temps, "top_p": top_ps}, **guide)
        want, wlp = sample_ref(logits, u, temps, top_ps, dense, boost_first, rank=rank)
        assert np.array_equal(got, want)
        np.testing.assert_allclose(glp, wlp, atol=1e-4)
        for t, p in {(t, p) for t, p in zip(temps, top_ps)}:
            at = (temps == t) & (top_ps == p)
            alone, alp = sample(logits, u, temperature=float(t), top_p=float(p), **guide)
            assert np.array_equal(got[at], alone[at]) and np.array_equal(glp[at], alp[at])
        torch = pytest.importorskip("torch")
        from dbs_fast.config import DBSConfig
        from dbs_fast.torch_backend import torch_sample

        table = torch.as_tensor(kernels.dense_boosts(ptr, ids, vals, logits.shape[1], exp=False))
        tgot, tlp = torch_sample(torch.as_tensor(logits), u, row_word, table, DBSConfig(), boost_first, rank=rank,
                                 temperature=temps, top_p=top_ps)
        assert np.array_equal(tgot.numpy(), want)
        np.testing.assert_allclose(tlp.numpy(), wlp, atol=1e-4)
    rows = np.zeros(4, np.int64)                         # one logits row, four settings: four groups
    rules = StepRules.given(row_sampling={"temperature": np.array([1.0, 0.0, 1.0, 1.0]),
                                          "top_p": np.array([0.9, 0.9, 0.5, 0.9])},
                            row_min_p=np.array([0.0, 0.0, 0.0, 0.1]))
    knobs = (rules.min_ps(4), rules.inv_temperatures(4), rules.top_ps(4), rules.temperatures(4) == 0)
    ptr_g, _ = kernels.row_groups(rows, kernels._guide(rules, 4, 10), kernels._history(rules, 4),
                                  np.full(4, -1, np.int64), *knobs)
    assert len(ptr_g) - 1 == 4
    ptr_g, _ = kernels.row_groups(np.zeros(3, np.int64), kernels._guide(rules, 3, 10), kernels._history(rules, 3),
                                  np.full(3, -1, np.int64), *(k[[0, 0, 0]] for k in knobs))
    assert len(ptr_g) - 1 == 1


def test_min_p_off_and_on():
    """min_p 0 draws what the kernel drew without it; a min_p that only the top token passes
    draws the top token whatever the uniform (no boosts)."""
    rng, logits, *_ = _case(22, scale=3.0)
    u = rng.random(len(logits))
    np.testing.assert_array_equal(sample(logits, u, min_p=0.0)[0], sample(logits, u)[0])
    top = np.argmax(logits, axis=1)
    second = np.sort(logits, axis=1)[:, -2]
    ratio = float(np.exp(second - logits.max(axis=1)).max())    # the runner-up's share, at most
    assert np.array_equal(sample(logits, u, top_p=1.0, min_p=min(0.99, ratio * 1.01))[0], top)


def _table(texts):
    from dbs_fast.text.occurrence import word_table

    return word_table(lambda i: texts[i], len(texts))


def _word_histories(rng, R, H=30):
    """Histories over words that repeat, loop, span tokens and follow punctuation, as texts."""
    texts = [" summer", " Summer", "summer", " sum", "mer", ",", "-", " and", " the", "one", " one", " 42", "ed"]
    weights = np.array([4, 2, 2, 3, 3, 2, 2, 3, 3, 2, 2, 1, 1], float)
    hist = np.zeros((R, H), np.int32)
    start = rng.integers(0, H // 2, R).astype(np.int32)
    for r in range(R):
        hist[r, start[r]:] = rng.choice(len(texts), H - start[r], p=weights / weights.sum())
        if r % 3 == 0:                                    # a loop of one word at the end
            hist[r, -3:] = 0
    return _table(texts), hist, start, [hist[r, start[r]:] for r in range(R)]


@pytest.mark.parametrize("window", [2, 3, 5, 8])
def test_word_loop_bans_match_reference(window):
    rng = np.random.default_rng(window)
    words, hist, start, rows = _word_histories(rng, 400)
    n_banned = 0
    for r, h in enumerate(rows):
        got = word_loop_tokens(hist[r].astype(np.int64), int(start[r]), hist.shape[1], *words, window)
        assert set(got.tolist()) == word_loop_ref(h, words, window) and len(set(got.tolist())) == len(got)
        n_banned += len(got)
    assert n_banned > 200                                        # the rule bans something here


def test_word_loop_rule_cases():
    texts = [" summer", " Summer", "summer", " sum", "mer", ",", "-", " and", " the", " sun", "one", " one"]
    w = _table(texts)

    def bans(*pieces, window=5):
        return {texts[t] for t in word_loop_ref([texts.index(p) for p in pieces], w, window)}

    assert bans(" summer") == {" summer", " Summer"}                 # not right after itself, in any case
    assert bans(" summer", ",") == {" summer", " Summer", "summer"}  # "summer," then "summer": still
    assert bans(" summer", " and") == {" and"}                       # a second "summer" is fine
    assert bans(" summer", " and", " Summer", " sun") >= {" summer", " Summer"}   # not a third within 5
    assert not bans(" summer", " and", " the", " Summer", " sun") & {" summer", " Summer"}   # 5 words back
    assert bans(" summer", " and", " the", " Summer", " sun", window=6) >= {" summer", " Summer"}
    assert bans(" sum", "mer") == set()                              # a word of two tokens is no one-token word
    assert bans(" one", "-", "one", "-") == {" one", "one"}          # "one-to-one": "-one" is a word
    assert bans(" summer", window=0) == set()


def test_word_loop_never_drawn_and_logp_is_the_models():
    texts = [" a", " b", " c", " d", " e", ",", " summer", " Summer"]
    w = _table(texts)
    logits = np.zeros((3, len(texts)), np.float32)
    logits[:, 6], logits[:, 7] = 50.0, 49.0                    # " summer", " Summer": all the mass; banned
    #                                                            " Summer" need not be in the history: its mass
    #                                                            still counts in the model's own log-prob
    hist = np.array([[0, 6, 1, 7, 2], [0, 1, 2, 3, 6], [6, 0, 1, 2, 3]], np.int32)
    u = np.array([0.0, 0.5, 0.999])
    ids, lp = sample(logits, u, top_p=0.9, history=hist, words=w, no_repeat_word_window=5)
    assert ids[0] not in (6, 7) and ids[1] not in (6, 7) and ids[2] in (6, 7)   # twice in 4 words; right
    #                                                            after itself; 5 words back
    plain, plp = sample(logits, u, top_p=0.9)
    assert np.isin(plain, [6, 7]).all()
    ref, rlp = sample_ref(logits, u, 1.0, 0.9, histories=list(hist), words=w, window=5)
    assert np.array_equal(ids, ref)
    np.testing.assert_allclose(lp, rlp, atol=1e-4)


def test_shaping_matches_transformers_processors():
    torch = pytest.importorskip("torch")
    from transformers import (
        NoRepeatNGramLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
    )

    rng = np.random.default_rng(6)
    logits = (rng.standard_normal((4, 300)) * 3).astype(np.float32)
    hist = rng.integers(0, 30, (4, 25))
    for penalty, n in ((1.3, 0), (1.0, 2), (1.5, 3)):
        t = torch.from_numpy(logits.copy())
        ids = torch.from_numpy(hist)
        if penalty != 1.0:
            t = RepetitionPenaltyLogitsProcessor(penalty)(ids, t)
        if n:
            t = NoRepeatNGramLogitsProcessor(n)(ids, t)
        for r in range(4):
            np.testing.assert_array_equal(shape_logits(logits[r], hist[r], penalty, n), t[r].numpy())


def test_ban_never_drawn_even_when_it_dominates():
    V = 100
    logits = np.zeros((3, V), np.float32)
    logits[:, 7] = 50.0                                        # token 7 has all the mass
    hist = np.array([[1, 7, 1, 7, 1]] * 3, np.int32)           # "1 7" seen, history ends in 1
    u = np.array([0.0, 0.5, 0.999])
    ids, lp = sample(logits, u, top_p=0.9, history=hist, no_repeat_ngram_size=2)
    assert 7 not in ids
    plain, _ = sample(logits, u, top_p=0.9)
    assert (plain == 7).all()                                  # the test bites: without the ban it is 7


def test_boost_order_per_row_matches_reference():
    rng, logits, boosts, row_word, dense = _case(7)
    ptr, ids, vals = csr_boosts(boosts)
    first = rng.random(len(logits)) < 0.5
    for _ in range(3):
        u = rng.random(len(logits))
        got, glp = sample(logits, u, top_p=0.9, row_word=row_word, boosts=(ptr, ids, vals),
                          boost_first=first)
        for r in range(len(logits)):
            want, wlp = sample_ref(logits[r:r + 1], u[r:r + 1], 1.0, 0.9, dense[r:r + 1], bool(first[r]))
            assert got[r] == want[0]
            np.testing.assert_allclose(glp[r], wlp[0], atol=1e-4)


def _ban_arrays(groups):
    """groups: list of lists of token sequences -> the kernel's (group_ptr, seq_ptr, seq_tok)."""
    gptr, sptr, toks = [0], [0], []
    for g in groups:
        for seq in g:
            toks += list(seq)
            sptr.append(len(toks))
        gptr.append(len(sptr) - 1)
    return np.array(gptr), np.array(sptr), np.array(toks, np.int32)


@pytest.mark.parametrize("boost_first", [False, True])
@pytest.mark.parametrize("penalty,ngram", [(1.0, 0), (1.2, 3)])
def test_bans_and_forcing_match_reference_exactly(boost_first, penalty, ngram):
    rng, logits, boosts, row_word, dense = _case(8)
    R, V = logits.shape
    hist, start, rows = _histories(rng, R, V)
    # one group per row: a one-token ban of its likeliest token, and two-token bans whose first
    # token is (row 0, 2, ...) or is not (odd rows) the history's last token
    groups = []
    for r in range(R):
        top = int(np.argmax(logits[r]))
        last = int(rows[r][-1]) if len(rows[r]) else 0
        prev = last if r % 2 == 0 else (last + 1) % V
        second = int(np.argsort(-logits[r])[1])
        groups.append([(top,), (prev, second)])
    bans = _ban_arrays(groups)
    row_ban = np.arange(R)
    row_ban[-1] = -1                                           # one row without bans
    force = np.full(R, -1)
    force[1] = 3
    ptr, ids, vals = csr_boosts(boosts)
    for _ in range(4):
        u = rng.random(R)
        got, glp = sample(logits, u, top_p=0.9, row_word=row_word, boosts=(ptr, ids, vals),
                          boost_first=boost_first, history=hist, history_start=start, repetition_penalty=penalty,
                          no_repeat_ngram_size=ngram, bans=bans, row_ban=row_ban, force=force)
        ref_bans = [groups[g] if g >= 0 else None for g in row_ban]
        want, wlp = sample_ref(logits, u, 1.0, 0.9, dense, boost_first, rows, penalty, ngram, ref_bans, force)
        assert np.array_equal(got, want)
        np.testing.assert_allclose(glp, wlp, atol=1e-4)         # the model's own log-prob, unbanned
        assert got[1] == 3
        for r in range(R - 1):
            assert got[r] not in banned_tokens(rows[r], groups[r])


@pytest.mark.parametrize("boost_first", [False, True])
def test_a_long_ban_list_in_any_order_draws_and_normalises_as_sorted(boost_first):
    """A row's one-token bans as two ascending runs joined (the glue ban, then the sentence ends:
    more than SHORT_BANS tokens, some twice) give the same tokens and the same log-probs, to the
    bit, as the same bans listed once each in ascending order, and the reference's tokens: the
    log-prob's normaliser takes each changed token once, in ascending order, either way."""
    rng, logits, boosts, row_word, dense = _case(11)
    R, V = logits.shape
    hist, start, rows = _histories(rng, R, V)
    runs = np.concatenate([np.arange(1, V, 2), np.arange(0, V, 5)]).astype(np.int32)   # 1,3,5,... then 0,5,10,...
    assert len(runs) > kernels.SHORT_BANS and np.any(np.diff(runs) < 0)
    joined, once = ([[(int(t),) for t in toks]] for toks in (runs, np.unique(runs)))
    row_ban = np.where(np.arange(R) % 3 == 0, 0, -1)
    ptr, ids, vals = csr_boosts(boosts)
    for _ in range(3):
        u = rng.random(R)
        got = [sample(logits, u, top_p=0.9, row_word=row_word, boosts=(ptr, ids, vals), boost_first=boost_first,
                      history=hist, history_start=start, repetition_penalty=1.2, no_repeat_ngram_size=3,
                      bans=_ban_arrays(groups), row_ban=row_ban) for groups in (joined, once)]
        assert np.array_equal(got[0][0], got[1][0]) and np.array_equal(got[0][1], got[1][1])
        ref_bans = [once[0] if g >= 0 else None for g in row_ban]
        want, wlp = sample_ref(logits, u, 1.0, 0.9, dense, boost_first, rows, 1.2, 3, ref_bans, np.full(R, -1))
        assert np.array_equal(got[0][0], want)
        np.testing.assert_allclose(got[0][1], wlp, atol=1e-4)


def test_banned_token_never_drawn_though_it_has_all_the_mass():
    V = 50
    logits = np.zeros((4, V), np.float32)
    logits[:, 9] = 40.0
    hist = np.array([[2, 5], [2, 4], [2, 5], [2, 4]], np.int32)
    bans = _ban_arrays([[(9,)], [(5, 9)]])
    u = np.array([0.0, 0.3, 0.6, 0.999])
    ids, _ = sample(logits, u, history=hist, bans=bans, row_ban=np.array([0, 1, 1, -1]))
    assert ids[0] != 9 and ids[2] != 9                          # always / after 5
    assert ids[1] == 9 and ids[3] == 9                          # 4 then 9 is allowed; no bans: 9


def test_vectorised_exp_is_as_accurate_as_float32_exp():
    """The kernel's branch-free exp (pass 2) against float64 exp over the whole range it sees,
    s - top in [-87, 0]; below that, and for a banned token's -inf, exactly 0 (never drawn).
    The same pass writes each token's histogram bucket: the floor of (top - s) * BUCKETS_PER_NAT
    in float64, the last bucket for anything further down (a ban's -inf included)."""
    from dbs_fast.kernels import BUCKETS_PER_NAT, N_BUCKETS, _exp_below

    top = np.float32(12.375)
    y = np.concatenate([np.linspace(-87, 0, 400001), [-np.inf, -87.01, -1000.0, -63.99, -64.0, -64.01]])
    s = (top + y).astype(np.float32)
    e = np.empty_like(s)
    bk = np.empty(len(s), np.int16)
    _exp_below(s, top, e, np.empty(len(s), np.int32), bk)
    d = (s - top).astype(np.float64)                    # the kernel's own float32 difference
    ok = d >= -87
    want = np.exp(d[ok])
    assert (np.abs(e[ok] - want) / want).max() < 3e-7  # np.exp in float32: 1.9e-7
    assert (e[~ok] == 0).all()
    np.testing.assert_array_equal(bk, np.minimum(np.floor(-d * BUCKETS_PER_NAT), N_BUCKETS - 1))
    assert bk[len(y) - 6] == N_BUCKETS - 1 and bk.min() == 0


def test_draw_picks_the_token_where_the_kept_mass_passes_u():
    """The draw (block sums, then one block) against NumPy's cumulative sum over the kept tokens
    in id order: flat and peaked rows, banned tokens (weight 0), u at 0, inside, and past the
    kept mass (rounding: the last kept token), a row whose kept tokens all lie in its first block."""
    from dbs_fast.kernels import DRAW_BLOCK, _block_masses, _walk

    rng = np.random.default_rng(5)
    V = 5 * DRAW_BLOCK + 37
    for x in (rng.standard_normal(V) * 0.7, rng.gumbel(size=V) * 2.5, np.r_[np.zeros(9), np.full(V - 9, -50.0)]):
        s = x.astype(np.float32)
        e = np.exp(s - s.max()).astype(np.float32)
        e[rng.choice(V, 20, replace=False)] = 0.0                       # bans
        cut = np.float32(np.quantile(s, 0.3)) if x[-1] != -50.0 else np.float32(-1.0)
        kept = (s >= cut) & (e > 0)
        csum = np.cumsum(np.where(kept, e.astype(np.float64), 0.0))
        bs = np.empty((V + DRAW_BLOCK - 1) // DRAW_BLOCK, np.float64)
        _block_masses(s, e, cut, bs)
        for u in np.r_[0.0, rng.random(50) * csum[-1], csum[-1] * 1.5]:
            want = int(np.searchsorted(csum, u, side="right")) if u < csum[-1] else int(np.flatnonzero(kept)[-1])
            assert kept[want]
            assert _walk(s, e, cut, bs, u) == want


@pytest.mark.parametrize("scale,ties", [(0.05, False), (0.3, False), (0.3, True)])
def test_flat_rows_with_ties_match_reference_exactly(scale, ties):
    """Flat rows (an untrained model, a high temperature) put thousands of tokens into the bucket
    that straddles top_p, and the cut is found in a finer bucket of it; with the logits rounded
    to a few hundred distinct values, ties straddle the cut too."""
    rng, logits, boosts, row_word, dense = _case(7, R=16, V=20000, scale=scale)
    if ties:
        logits = np.round(logits * 200) / 200
    ptr, ids, vals = csr_boosts(boosts)
    for top_p in (0.9, 0.5):
        u = rng.random(len(logits))
        got, glp = sample(logits, u, top_p=top_p, row_word=row_word, boosts=(ptr, ids, vals))
        want, wlp = sample_ref(logits, u, 1.0, top_p, dense, False)
        assert np.array_equal(got, want)
        np.testing.assert_allclose(glp, wlp, atol=1e-4)


@pytest.mark.parametrize("sleep", [True, False])
def test_numba_threads_sleep_when_idle_unless_asked_not_to(sleep):
    """`numba_runtime.start_threads`: Numba's OpenMP workers load with a brief spin (GOMP_SPINCOUNT=20000:
    they sleep soon after the kernel, while ORT's next step wants the cores), the variable is not
    left set, and `sleep_when_idle=False` (the PyTorch baseline) keeps libgomp's default
    spinning (300000)."""
    import os
    import subprocess
    import sys

    code = ("import os\nfrom dbs_fast.numba_runtime import start_threads\nstart_threads(%s)\n"
            "print('left', 'GOMP_SPINCOUNT' in os.environ)" % sleep)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**env, "OMP_DISPLAY_ENV": "VERBOSE"})
    assert out.returncode == 0, out.stderr
    text = out.stdout + out.stderr
    if "GOMP_SPINCOUNT" not in text:
        pytest.skip("Numba's threading layer here is not GNU OpenMP")
    assert "left False" in text
    assert ("GOMP_SPINCOUNT = '20000'" in text) == sleep
    assert ("GOMP_SPINCOUNT = '300000'" in text) == (not sleep)


def test_boost_kept_multiplies_only_kept_boosted_weights():
    """`_boost_kept` against NumPy: kept tokens' weights times exp(boost) (1.0 where none), the
    others untouched, and the weight it returns is what it added (bans' -inf never kept)."""
    from dbs_fast.kernels import _boost_kept, dense_boosts

    rng = np.random.default_rng(11)
    V = 5000
    s = (rng.standard_normal(V) * 0.5).astype(np.float32)
    s[rng.choice(V, 20, replace=False)] = -np.inf
    e = np.exp(s - s.max()).astype(np.float32)
    boosts = [SparseBoost(str(w), np.sort(rng.choice(V, 3000, replace=False)).astype(np.int32),
                          (20 * rng.beta(1, 3, 3000) ** 2).astype(np.float32)) for w in range(3)]
    ptr, ids, vals = csr_boosts(boosts)
    dense = dense_boosts(ptr, ids, vals, V, [0, 2])
    assert dense.shape == (2, V) and dense_boosts(ptr, ids, vals, V).shape == (3, V)
    want_f = np.ones(V, np.float32)
    want_f[boosts[2].ids] = np.exp(boosts[2].values)
    np.testing.assert_array_equal(dense[1], want_f)
    cut = np.float32(np.quantile(s[np.isfinite(s)], 0.4))
    got = e.copy()
    added = _boost_kept(s, got, cut, dense[1])
    want = np.where(s >= cut, (e * want_f).astype(np.float32), e)
    np.testing.assert_array_equal(got, want)
    assert added == pytest.approx(float(want.astype(np.float64).sum() - e.astype(np.float64).sum()), rel=1e-9)


@pytest.mark.parametrize("boost_first", [False, True])
@pytest.mark.parametrize("scale", [0.5, 3.0])
def test_dense_boost_tables_match_reference_exactly(scale, boost_first):
    """A real guide word boosts most of the vocabulary (GloVe similarity > 0 for ~60% of GPT-2's
    tokens, most of them slightly): both boost orders over such tables, flat and peaked rows, and
    the returned log-prob is the unguided one."""
    from dbs_fast.kernels import dense_boosts

    R, V = 16, 20000
    rng, logits, boosts, row_word, dense = _case(12, R, V, scale, n_boost=12000,
                                                 values=lambda rng, n: 20 * rng.beta(1, 3, n) ** 2)
    ptr, ids, vals = csr_boosts(boosts)
    for top_p in (0.9, 0.5, 1.0):
        u = rng.random(R)
        got, glp = sample(logits, u, top_p=top_p, row_word=row_word, boosts=(ptr, ids, vals),
                          boost_first=boost_first)
        want, wlp = sample_ref(logits, u, 1.0, top_p, dense, boost_first)
        assert np.array_equal(got, want)
        np.testing.assert_allclose(glp, wlp, atol=1e-4)
        kept, klp = sample(logits, u, top_p=top_p, row_word=row_word, boosts=(ptr, ids, vals),
                           boost_first=boost_first, boost_exp=dense_boosts(ptr, ids, vals, V))
        assert np.array_equal(kept, got) and np.array_equal(klp, glp)   # the whole table, built by the caller


@pytest.mark.parametrize("parallel_from", [0, 1 << 30])
def test_extend_prefix_equals_numpy_gather(parallel_from, monkeypatch):
    """`extend_prefix` (the chunk boundary: each new beam's parent prefix plus its row's first j
    chunk tokens) against its NumPy reference, with repeated and reordered sources, on the
    parallel kernel and on the one-thread one (small copies); with leading zero columns and the
    parent's first columns dropped (the width kept aligned)."""
    from naive import extend_prefix_ref

    from dbs_fast.kv import kv_copy
    from dbs_fast.kv.kv_copy import extend_prefix

    monkeypatch.setattr(kv_copy, "PARALLEL_FROM", parallel_from)

    rng = np.random.default_rng(14)
    b, kv, T, s, K, d, j = 3, 2, 7, 4, 5, 8, 3
    prefix = rng.standard_normal((b, kv, T, d)).astype(np.float32)
    chunk = rng.standard_normal((K, b, kv, s, d)).astype(np.float32)      # slot-major
    src = np.array([9, 0, 9, 5, 11])                       # rows: beam = row // s, candidate = row % s
    for lead, first in ((0, 0), (4, 0), (0, 5), (2, 3)):
        want = extend_prefix_ref(prefix, chunk, src, s, j, lead, first)
        got = np.full((len(src), kv, lead + T - first + j, d), np.nan, np.float32)
        extend_prefix(got, prefix, chunk, src, s, j, lead, first)
        np.testing.assert_array_equal(got, want)


def test_the_packages_ban_rule_equals_the_reference():
    """`constraints.banned_tokens` (what the PyTorch baseline applies, the kernel's `_ban` in
    plain Python) against the rule spelled out independently, on random histories and bans."""
    from dbs_fast.text.constraints import banned_tokens as package_rule

    rng = np.random.default_rng(0)
    for _ in range(2000):
        history = list(rng.integers(0, 6, rng.integers(0, 8)))
        bans = [tuple(rng.integers(0, 6, rng.integers(1, 4))) for _ in range(rng.integers(0, 5))]
        assert package_rule(history, bans) == banned_tokens(history, bans), (history, bans)
    assert banned_tokens([1, 2], [(2, 3), (1, 3, 4), (5,)]) == {3, 5}
    assert banned_tokens([], [(2, 3)]) == set() and banned_tokens(None, [(7,)]) == {7}


@pytest.mark.parametrize("boost_first", [False, True])
@pytest.mark.parametrize("penalty,min_p", [(1.0, 0.0), (1.2, 0.05)])
def test_rows_sharing_a_logits_row_draw_as_from_their_own_copies(boost_first, penalty, min_p):
    """Rows that read one row of a logits table (`rows`) draw exactly what each draws from its own
    copy, and the reference's tokens: those under the same rules are shaped once (one group), those
    whose guide word, history, ban group or min_p differ apart, and a forced row takes its token."""
    rng, table, boosts, _, _ = _case(11, R=6)
    V = table.shape[1]
    rows = np.repeat(np.arange(6), 5)                          # 30 rows, five a table row
    R = len(rows)
    word = np.where(np.arange(R) % 5 < 3, rows % 3, -1).astype(np.int32)   # three guided alike, two not
    word[4] = 2                                                # one that differs from its table row's others
    hist6, start6, _ = _histories(rng, 6, V)
    hist, start = hist6[rows].copy(), start6[rows].copy()
    hist[9, -1] = (hist[9, -1] + 1) % V                        # one history that differs
    seqs = [hist[r, start[r]:] for r in range(R)]
    row_ban = np.where(np.arange(R) == 12, 0, -1)
    groups = [[(int(np.argmax(table[rows[12]])),)]]
    force = np.full(R, -1)
    force[[1, 16]] = 3
    row_min_p = np.full(R, min_p)
    row_min_p[21] = 0.2
    ptr, ids, vals = csr_boosts(boosts)
    dense = [None if w < 0 else np.zeros(V) for w in word]
    for r, w in enumerate(word):
        if w >= 0:
            dense[r][boosts[w].ids] = boosts[w].values
    rules = StepRules.given(top_p=0.9, repetition_penalty=penalty, row_word=word, boosts=(ptr, ids, vals),
                            boost_first=boost_first, history=hist, history_start=start, bans=_ban_arrays(groups),
                            row_ban=row_ban, force=force, row_min_p=row_min_p)
    for _ in range(3):
        u = rng.random(R)
        got, glp = kernels.sample(table, u, rules, rows=rows)
        each, elp = kernels.sample(table[rows], u, rules)
        assert np.array_equal(got, each) and np.array_equal(glp, elp)
        ref_bans = [groups[g] if g >= 0 else None for g in row_ban]
        for r in range(R):
            want, wlp = sample_ref(table[rows[r]][None], u[r:r + 1], 1.0, 0.9, [dense[r]], boost_first, [seqs[r]],
                                   penalty, 0, [ref_bans[r]], force[r:r + 1], min_p=row_min_p[r])
            assert got[r] == want[0]
        assert got[1] == 3 and got[16] == 3
    ptr_g, members = kernels.row_groups(rows, kernels._guide(rules, R, V), kernels._history(rules, R),
                                        np.asarray(row_ban, np.int64), row_min_p)
    sizes = np.diff(ptr_g)
    assert sorted(members) == list(range(R)) and len(sizes) < R
    together = {tuple(members[ptr_g[g]:ptr_g[g + 1]]) for g in range(len(sizes))}
    assert (0, 1, 2) in together and (4,) in together           # forced row 1 with 0 and 2; row 4's word apart
    assert (12,) in together and (21,) in together
    assert ((9,) if penalty != 1.0 else (8, 9)) in together     # a history counts only where a rule reads it


def test_the_warm_up_compiles_what_a_generation_runs(exported):
    """`kernels.warm_up` and `kv_copy.warm_up` compile the specialisations that a generation calls,
    which a first generation would otherwise compile: a generation after them adds none."""
    from dbs_fast import DBSConfig, DirectedBeamSearch
    from dbs_fast.kv import kv_copy

    kernels.warm_up()
    kv_copy.warm_up()
    compiled = (kernels._sample_rows, kv_copy._extend_prefix_serial, kv_copy._extend_prefix)
    before = [set(f.signatures) for f in compiled]
    assert all(before)
    r = DirectedBeamSearch(exported["gpt2"]).generate("the cat", "cat,river",
                                                      config=DBSConfig(beams=3, candidates=4, max_new_tokens=12))
    assert r.new_tokens > 0 and [set(f.signatures) for f in compiled] == before


def test_the_kernels_compile_in_a_process_of_their_own_while_a_block_runs(tmp_path, monkeypatch):
    """`compiled_meanwhile`: the warm-up runs in a process of its own to its end (exit 0), on this
    process's dbs_fast (whose source files key Numba's cache) even where the working directory holds
    another, and is stopped when the block fails, the failure passed on."""
    from dbs_fast.numba_runtime import compiled_meanwhile

    (tmp_path / "dbs_fast").mkdir()
    (tmp_path / "dbs_fast" / "__init__.py").write_text("raise ImportError('another dbs_fast')\n")
    monkeypatch.chdir(tmp_path)
    with compiled_meanwhile() as proc:
        pass
    assert proc.returncode == 0
    with pytest.raises(KeyboardInterrupt), compiled_meanwhile() as proc:
        raise KeyboardInterrupt
    assert proc.returncode != 0
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))     # none can start: the block runs
    with compiled_meanwhile() as proc:
        ran = proc is None
    assert ran


@pytest.mark.parametrize("boost_first", [False, True])
@pytest.mark.parametrize("top_p,min_p", [(0.9, 0.0), (1.0, 0.0), (0.9, 0.1)])
def test_temperature_zero_takes_the_likeliest_kept_token(boost_first, top_p, min_p):
    """Temperature 0: the kernel, the reference and the PyTorch sampler take the kept token of the
    largest (boosted) weight at temperature 1, whatever the uniforms; an unguided row takes the
    argmax of its logits (greedy decoding); a guided row takes a boosted word where the boost lifts
    it above the top token; the log-prob returned is the model's own at temperature 1."""
    rng, logits, boosts, row_word, dense = _case(31, scale=2.0)
    ptr, ids, vals = csr_boosts(boosts)
    rules = dict(temperature=0.0, top_p=top_p, min_p=min_p, row_word=row_word, boosts=(ptr, ids, vals),
                 boost_first=boost_first)
    got, glp = sample(logits, rng.random(len(logits)), **rules)
    again, _ = sample(logits, rng.random(len(logits)), **rules)
    want, wlp = sample_ref(logits, np.zeros(len(logits)), 0.0, top_p, dense, boost_first, min_p=min_p)
    assert np.array_equal(got, want) and np.array_equal(got, again)
    np.testing.assert_allclose(glp, wlp, atol=1e-4)
    plain = row_word < 0
    assert np.array_equal(got[plain], logits[plain].argmax(1))
    assert (got[~plain] != logits[~plain].argmax(1)).any()           # a boost changed the pick
    logz = np.log(np.exp(logits.astype(np.float64) - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    np.testing.assert_allclose(glp, logits[np.arange(len(got)), got] - logz, atol=1e-4)
    torch = pytest.importorskip("torch")
    from dbs_fast.config import DBSConfig
    from dbs_fast.torch_backend import torch_sample

    table = torch.as_tensor(kernels.dense_boosts(ptr, ids, vals, logits.shape[1], exp=False))
    tgot, _ = torch_sample(torch.as_tensor(logits), rng.random(len(logits)), row_word, table,
                           DBSConfig(temperature=0.0, top_p=top_p, min_p=min_p), boost_first)
    assert np.array_equal(tgot.numpy(), want)


@pytest.mark.parametrize("boost_first", [False, True])
@pytest.mark.parametrize("top_p", [0.9, 1.0])
def test_temperature_zero_rows_of_one_distribution_take_its_likeliest_tokens_in_turn(boost_first, top_p):
    """Temperature 0 with ranks: rows that read one logits row take its kept tokens in the order of
    their weights, rank 0 the likeliest (as without ranks), counted round the kept tokens where
    there are fewer (a nucleus of a few tokens); the kernel, the reference and the PyTorch sampler
    agree, and a forced row takes its token whatever its rank."""
    rng, logits, boosts, row_word, dense = _case(47, R=6, scale=2.0)
    peaked = logits[1].copy()
    peaked[:3] = [40.2, 40.1, 40.0]                      # a nucleus of three tokens
    table = np.stack([logits[0], peaked, logits[2]])
    rows = np.repeat(np.arange(3), 5)                    # 5 rows on each logits row
    rank = np.tile(np.arange(5), 3)
    word = np.where(rows == 2, row_word[2], -1).astype(np.int32)
    force = np.full(len(rows), -1)
    force[3] = 7
    ptr, ids, vals = csr_boosts(boosts)
    rules = StepRules.given(temperature=0.0, top_p=top_p, row_word=word, boosts=(ptr, ids, vals),
                            boost_first=boost_first, force=force, rank=rank)
    got, glp = kernels.sample(table, rng.random(len(rows)), rules, rows=rows)
    assert got[3] == 7
    free = force < 0
    want, wlp = sample_ref(table[rows], np.zeros(len(rows)), 0.0, top_p, [dense[2] if w >= 0 else None for w in word],
                           boost_first, rank=rank)
    assert np.array_equal(got[free], want[free])
    np.testing.assert_allclose(glp[free], wlp[free], atol=1e-4)
    assert got[0] == table[0].argmax() and got[5] == 0                # rank 0, unguided: the argmax
    assert len(set(got[:3])) == 3 and len(set(got[10:])) == 5          # different tokens in turn
    if top_p < 1.0:                                      # three kept: ranks 3 and 4 take ranks 0 and 1's
        assert np.array_equal(got[5:10], [0, 1, 2, 0, 1])
    torch = pytest.importorskip("torch")
    from dbs_fast.config import DBSConfig
    from dbs_fast.torch_backend import torch_sample

    dense_t = torch.as_tensor(kernels.dense_boosts(ptr, ids, vals, logits.shape[1], exp=False))
    tgot, _ = torch_sample(torch.as_tensor(table[rows]), rng.random(len(rows)), word, dense_t,
                           DBSConfig(temperature=0.0, top_p=top_p), boost_first, rank=rank)
    assert np.array_equal(tgot.numpy()[free], want[free])


@pytest.mark.parametrize("temperature", [0.05, 0.01, 0.0])
@pytest.mark.parametrize("boost_first", [False, True])
def test_a_low_temperature_draws_an_allowed_token_when_the_top_one_is_banned(temperature, boost_first):
    """At a low temperature every allowed token's weight underflows below a banned top token's
    (30 nats at T 0.1 is a logit gap of 3): the kernel weighs from the best allowed token instead,
    so it draws the reference's tokens, never a banned one, never none."""
    rng, logits, boosts, row_word, dense = _case(41, scale=3.0)
    R = len(logits)
    ptr, ids, vals = csr_boosts(boosts)
    top = logits.argmax(1)
    seq_tok = top.astype(np.int32)                     # each row bans its own top token
    bans = (np.arange(R + 1, dtype=np.int64), np.arange(R + 1, dtype=np.int64), seq_tok)
    for _ in range(3):
        u = rng.random(R)
        got, glp = sample(logits, u, temperature=temperature, top_p=0.9, row_word=row_word, boosts=(ptr, ids, vals),
                          boost_first=boost_first, bans=bans, row_ban=np.arange(R))
        want, wlp = sample_ref(logits, u, temperature, 0.9, dense, boost_first, bans=[[[t]] for t in top])
        assert (got >= 0).all() and not (got == top).any()
        assert np.array_equal(got, want)
        np.testing.assert_allclose(glp, wlp, atol=1e-3)


def test_a_temperature_below_the_floor_draws_at_the_floor_and_perplexities_stay_finite():
    """A positive temperature under MIN_TEMPERATURE draws as at MIN_TEMPERATURE (1/T would overflow
    float32 logits), and the perplexity of tokens thousands of nats unlikely saturates instead of
    overflowing (a forced token at such a temperature)."""
    from dbs_fast.config import MIN_TEMPERATURE, DBSConfig
    from dbs_fast.search.quality import MAX_NATS, perplexity

    rng, logits, boosts, row_word, _ = _case(43)
    rules = dict(top_p=0.9, row_word=row_word, boosts=csr_boosts(boosts))
    u = rng.random(len(logits))
    tiny, tiny_lp = sample(logits, u, temperature=1e-30, **rules)
    floor, floor_lp = sample(logits, u, temperature=MIN_TEMPERATURE, **rules)
    assert np.array_equal(tiny, floor) and np.array_equal(tiny_lp, floor_lp) and np.isfinite(tiny_lp).all()
    assert DBSConfig(temperature=1e-30).inv_temperature == 1 / MIN_TEMPERATURE
    assert DBSConfig(temperature=0).inv_temperature == DBSConfig().inv_temperature == 1.0
    assert perplexity(np.array([-5000.0, -3.0], np.float32)) == np.exp(MAX_NATS)
    assert perplexity([-1.0, -3.0]) == pytest.approx(np.exp(2.0))


@pytest.mark.parametrize("boost_first", [False, True])
@pytest.mark.parametrize("presence,frequency,penalty", [(0.5, 0.0, 1.0), (0.0, 0.7, 1.0), (2.0, 1.0, 1.3),
                                                        (-1.5, -0.5, 1.0), (1.0, -2.0, 0.8)])
def test_presence_and_frequency_penalties_match_reference_exactly(boost_first, presence, frequency, penalty):
    """OpenAI's penalties on the tokens a row generated (after `generated_start`), the context's
    left alone: the kernel draws the reference's tokens with the model's own log-probs, beside the
    repetition penalty and in both boost orders, and negative penalties raise a logit past the top."""
    rng, logits, boosts, row_word, dense = _case(31)
    R, V = logits.shape
    hist, start, _ = _histories(rng, R, V)
    gen = (start + rng.integers(0, hist.shape[1] - start)).astype(np.int32)    # the context before, anywhere
    for r in range(R):
        logits[r, hist[r, start[r]:]] += 4.0                       # repeated tokens likely: the penalties decide
    ptr, ids, vals = csr_boosts(boosts)
    own = [hist[r, start[r]:] for r in range(R)]
    generated = [hist[r, gen[r]:] for r in range(R)]
    for _ in range(5):
        u = rng.random(R)
        got, glp = sample(logits, u, top_p=0.9, row_word=row_word, boosts=(ptr, ids, vals), boost_first=boost_first,
                          history=hist, history_start=start, generated_start=gen, repetition_penalty=penalty,
                          presence_penalty=presence, frequency_penalty=frequency)
        want, wlp = sample_ref(logits, u, 1.0, 0.9, dense, boost_first, own, penalty, presence=presence,
                               frequency=frequency, generated=generated)
        assert np.array_equal(got, want)
        np.testing.assert_allclose(glp, wlp, atol=1e-4)            # the model's own log-prob, unshaped


@pytest.mark.parametrize("boost_first", [False, True])
def test_each_row_is_penalised_at_its_own_penalties(boost_first):
    """`row_sampling`'s repetition, presence and frequency penalties: each row is shaped at its
    request's (neutral ones: not shaped at all), the kernel and the reference alike; a row draws,
    with the same log-prob, what a batch at its penalties alone draws; the PyTorch baseline shapes
    each row's logits as the reference does."""
    rng, logits, boosts, row_word, dense = _case(33)
    R, V = logits.shape
    hist, start, _ = _histories(rng, R, V)
    gen = (start + rng.integers(0, hist.shape[1] - start)).astype(np.int32)
    for r in range(R):
        logits[r, hist[r, start[r]:]] += 4.0                       # repeated tokens likely: the penalties decide
    settings = np.resize(np.array([(1.0, 0.0, 0.0), (1.3, 0.0, 0.0), (1.0, 0.8, 0.3), (0.8, -1.0, 0.0)]), (R, 3))
    own = dict(zip(("repetition_penalty", "presence_penalty", "frequency_penalty"), settings.T))
    ptr, ids, vals = csr_boosts(boosts)
    common = dict(top_p=0.9, row_word=row_word, boosts=(ptr, ids, vals), boost_first=boost_first, history=hist,
                  history_start=start, generated_start=gen)
    for _ in range(4):
        u = rng.random(R)
        got, glp = sample(logits, u, row_sampling=own, **common)
        assert StepRules.given(row_sampling=own).shaped(R).tolist() == (settings != (1, 0, 0)).any(1).tolist()
        for r in range(R):
            pen, pres, freq = settings[r]
            want, wlp = sample_ref(logits[r:r + 1], u[r:r + 1], 1.0, 0.9, dense[r:r + 1], boost_first,
                                   [hist[r, start[r]:]], pen, presence=pres, frequency=freq,
                                   generated=[hist[r, gen[r]:]])
            assert got[r] == want[0]
            np.testing.assert_allclose(glp[r], wlp[0], atol=1e-4)
        for k in np.unique(settings, axis=0):
            at = (settings == k).all(1)
            alone, alp = sample(logits, u, repetition_penalty=k[0], presence_penalty=k[1], frequency_penalty=k[2],
                                **common)
            assert np.array_equal(got[at], alone[at]) and np.array_equal(glp[at], alp[at])
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from dbs_fast.config import DBSConfig
    from dbs_fast.torch_backend import TorchBackend

    cfg = DBSConfig(no_repeat_ngram_size=0, no_repeat_word_window=0)
    shaped = TorchBackend.shape(SimpleNamespace(torch=torch, device="cpu"), torch.from_numpy(logits), cfg, hist, start,
                                None, gen, list(settings.T))
    for r in range(R):
        pen, pres, freq = settings[r]
        ref = shape_logits(logits[r], hist[r, start[r]:], pen, presence=pres, frequency=freq,
                           generated=hist[r, gen[r]:])
        np.testing.assert_allclose(shaped[r].numpy(), ref, rtol=1e-6)


@pytest.mark.parametrize("boost_first", [False, True])
@pytest.mark.parametrize("temperature,penalty,presence", [(1.0, 1.0, 0.0), (0.7, 1.3, 0.5), (1.0, 0.8, -1.0)])
def test_logit_bias_matches_reference_exactly(boost_first, temperature, penalty, presence):
    """OpenAI's logit bias on the raw logits, before the penalties and the temperature: the kernel
    draws the reference's tokens, whose returned log-probs stay the model's own; biases that bury
    each row's top tokens and lift others move the draws."""
    rng, logits, boosts, row_word, dense = _case(41)
    R, V = logits.shape
    hist, start, _ = _histories(rng, R, V)
    top = np.unique(np.argsort(-logits, axis=1)[:, :3])
    lifted = rng.choice(np.setdiff1d(np.arange(V), top), 40, replace=False)
    bias = {**{int(t): -100.0 for t in top}, **{int(t): float(rng.uniform(2, 8)) for t in lifted}}
    ptr, ids, vals = csr_boosts(boosts)
    own = [hist[r, start[r]:] for r in range(R)]
    moved = 0
    for _ in range(5):
        u = rng.random(R)
        rules = dict(top_p=0.9, temperature=temperature, row_word=row_word, boosts=(ptr, ids, vals),
                     boost_first=boost_first, history=hist, history_start=start, repetition_penalty=penalty,
                     presence_penalty=presence)
        got, glp = sample(logits, u, logit_bias=bias, **rules)
        want, wlp = sample_ref(logits, u, temperature, 0.9, dense, boost_first, own, penalty, presence=presence,
                               logit_bias=bias)
        assert np.array_equal(got, want)
        np.testing.assert_allclose(glp, wlp, atol=1e-4)            # the model's own log-prob, unbiased
        assert not np.isin(got, top).any()
        moved += int((got != sample(logits, u, **rules)[0]).sum())
    assert moved > 0


@pytest.mark.parametrize("boost_first", [False, True])
def test_each_row_is_biased_by_its_own_logit_bias(boost_first):
    """`bias_sets` and `row_bias`: each row's logits are biased by its request's set (-1: none),
    under a repetition penalty, the kernel and the reference alike; a row draws, with the same
    log-prob, what a batch at its set alone draws; the PyTorch sampler draws the reference's
    tokens."""
    from dbs_fast.config import bias_table, logit_bias_pairs

    rng, logits, boosts, row_word, dense = _case(45)
    R, V = logits.shape
    hist, start, _ = _histories(rng, R, V)
    top = np.argsort(-logits, axis=1)[:, :2]
    sets = [{int(t): -100.0 for t in np.unique(top[::2])},
            {int(t): float(rng.uniform(3, 9)) for t in rng.choice(V, 30, replace=False)}]
    table = bias_table([logit_bias_pairs(b) for b in sets])
    row_bias = np.resize([0, -1, 1], R)
    ptr, ids, vals = csr_boosts(boosts)
    common = dict(top_p=0.9, row_word=row_word, boosts=(ptr, ids, vals), boost_first=boost_first, history=hist,
                  history_start=start, repetition_penalty=1.2)
    own = [hist[r, start[r]:] for r in range(R)]
    for _ in range(4):
        u = rng.random(R)
        got, glp = sample(logits, u, bias_sets=table, row_bias=row_bias, **common)
        want, wlp = sample_ref(logits, u, 1.0, 0.9, dense, boost_first, own, 1.2,
                               logit_bias=[sets[b] if b >= 0 else None for b in row_bias])
        assert np.array_equal(got, want)
        np.testing.assert_allclose(glp, wlp, atol=1e-4)
        for b in (-1, 0, 1):
            at = row_bias == b
            alone, alp = sample(logits, u, logit_bias=sets[b] if b >= 0 else {}, **common)
            assert np.array_equal(got[at], alone[at]) and np.array_equal(glp[at], alp[at])
    assert not np.isin(got[row_bias == 0], list(sets[0])).any()
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from dbs_fast.torch_backend import TorchBackend

    base = SimpleNamespace(torch=torch, device="cpu", _dense=None, _dense_key=None, vocab_size=V,
                           shape=lambda *a: TorchBackend.shape(base, *a), ban=None)
    u = rng.random(R)
    tgot, _ = TorchBackend.sample(base, torch.as_tensor(logits), u, StepRules.given(
        top_p=0.9, bias_sets=table, row_bias=row_bias, history=hist, history_start=start, repetition_penalty=1.2))
    want, _ = sample_ref(logits, u, 1.0, 0.9, None, False, own, 1.2,
                         logit_bias=[sets[b] if b >= 0 else None for b in row_bias])
    assert np.array_equal(tgot, want)


def test_a_logit_bias_of_100_outweighs_the_guide_words_and_minus_100_bans():
    """+100 makes a token the draw whatever the boosts (lambda 20) and the nucleus; -100 keeps the
    likeliest token out; an unbiased row draws as before."""
    rng, logits, boosts, row_word, dense = _case(43)
    R, V = logits.shape
    ptr, ids, vals = csr_boosts(boosts)
    u = rng.random(R)
    got, _ = sample(logits, u, top_p=0.9, row_word=row_word, boosts=(ptr, ids, vals), logit_bias={7: 100.0})
    assert (got == 7).all()
    best = int(np.argmax(logits[0]))
    got, _ = sample(logits[:1], np.zeros(1), temperature=0, logit_bias={best: -100.0})
    assert got[0] != best and got[0] == np.argsort(-logits[0])[1]


def test_pytorch_baselines_logit_bias_draws_the_kernels_tokens():
    """The PyTorch baseline adds the logit bias to the raw logits as the kernel does, and returns
    the model's own log-probs."""
    from types import SimpleNamespace

    torch = pytest.importorskip("torch")
    from dbs_fast.torch_backend import TorchBackend

    rng, logits, boosts, row_word, _ = _case(44)
    R, V = logits.shape
    ptr, ids, vals = csr_boosts(boosts)
    bias = {int(t): float(rng.uniform(-100, 10)) for t in rng.choice(V, 300, replace=False)}
    base = SimpleNamespace(torch=torch, device="cpu", vocab_size=V, _dense_key=None, _dense=None)
    for _ in range(3):
        u = rng.random(R)
        rules = StepRules.given(top_p=0.9, row_word=row_word, boosts=(ptr, ids, vals), logit_bias=bias)
        want, wlp = kernels.sample(logits, u, rules)
        got, glp = TorchBackend.sample(base, torch.as_tensor(logits), u, rules)
        assert np.array_equal(got, want)
        np.testing.assert_allclose(glp, wlp, atol=1e-4)


@pytest.mark.parametrize("K", [1, 3, 20])
def test_top_tokens_are_numpys_largest_logits(K):
    """The `logprobs` alternatives: each row's K largest logits, largest first and ties by the
    lower id (NumPy's stable sort), read through a row table as the decode step shares rows."""
    rng, logits, *_ = _case(45)
    logits[0, [5, 9, 2]] = 50.0                                      # ties at the top
    logits[1, :] = -np.inf
    logits[1, 7] = 0.0
    rows = rng.integers(0, len(logits), 40)
    ids, vals = kernels.top_tokens(logits, K, rows)
    want = np.argsort(-logits[rows], axis=1, kind="stable")[:, :K]
    assert np.array_equal(ids, want)
    np.testing.assert_array_equal(vals, np.take_along_axis(logits[rows], want, 1))
    assert kernels.top_tokens(logits, 0)[0].shape == (len(logits), 0)


def test_alternatives_repeat_the_drawn_tokens_log_prob_to_the_bit():
    """The `logprobs` alternatives of a drawn token: the K likeliest at the draw's temperature,
    normalised as the drawn token's log-prob is, and the drawn token among them has that log-prob
    itself, not one recomputed through its logit (which differs in the last bits where the
    logits are large, as OpenAI's `top_logprobs` never do)."""
    from dbs_fast.search.beam import alternatives

    rng = np.random.default_rng(3)
    logits = (30 + rng.standard_normal((6, 50))).astype(np.float32)
    rows = np.array([0, 0, 2, 3, 4, 5])                               # two slots read one logits row
    inv_t = np.array([1.0, 1.0, 1 / 0.7, 1.0, 1 / 1.3, 1.0], np.float32)
    scaled = logits[rows] * inv_t[:, None]
    logp = scaled - scaled.max(1, keepdims=True)
    logp = (logp - np.log(np.exp(logp).sum(1, keepdims=True))).astype(np.float32)
    ids = np.array([np.argmax(logits[r]) if i % 2 else rng.integers(50) for i, r in enumerate(rows)])
    lp = logp[np.arange(6), ids]
    got_ids, got_lp = alternatives(logits, 4, rows, ids, lp, inv_t)
    assert np.array_equal(got_ids[:, 0], ids) and np.array_equal(got_lp[:, 0], lp)
    assert np.array_equal(got_ids[:, 1:], np.argsort(-logits[rows], axis=1, kind="stable")[:, :4])
    np.testing.assert_allclose(got_lp[:, 1:], np.take_along_axis(logp, got_ids[:, 1:], 1), atol=1e-5)
    drawn = got_ids[:, 1:] == ids[:, None]
    assert drawn.sum() >= 3
    assert np.array_equal(got_lp[:, 1:][drawn], np.broadcast_to(lp[:, None], drawn.shape)[drawn])


def test_presence_and_frequency_penalties_count_only_generated_tokens():
    """The reference's rule, which the kernel and the PyTorch baseline follow: a token the context
    holds is left alone, a generated one loses presence once and frequency per occurrence, after
    the repetition penalty (vLLM's order); the baseline's shaping gives the same logits."""
    from types import SimpleNamespace

    torch = pytest.importorskip("torch")
    from dbs_fast.config import DBSConfig
    from dbs_fast.torch_backend import TorchBackend

    x = np.array([2.0, -1.0, 3.0, 0.5, 1.0], np.float32)
    history = np.array([0, 3, 1, 2, 1, 1])                        # context [0, 3], generated [1, 2, 1, 1]
    got = shape_logits(x, history, 1.25, presence=0.5, frequency=0.25, generated=history[2:])
    np.testing.assert_allclose(got, [2.0 / 1.25, -1.25 - 0.5 - 0.75, 3.0 / 1.25 - 0.5 - 0.25, 0.5 / 1.25, 1.0],
                               rtol=1e-6)
    cfg = DBSConfig(repetition_penalty=1.25, presence_penalty=0.5, frequency_penalty=0.25, no_repeat_ngram_size=0,
                    no_repeat_word_window=0)
    base = SimpleNamespace(torch=torch, device="cpu")
    shaped = TorchBackend.shape(base, torch.from_numpy(x[None]), cfg, history[None], np.array([0]), None,
                                np.array([2]))
    np.testing.assert_allclose(shaped[0].numpy(), got, rtol=1e-6)
