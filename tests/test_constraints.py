"""Constraints: parsing, unordered / phrase / alternative occurrence and credit, merged boosts,
guaranteed inclusion and bans in the engine (tiny random model), CommonGen coverage and eval."""

import numpy as np
import pytest
from conftest import GPT2_VOCAB

from dbs_fast import DBSConfig, DirectedBeamSearch
from dbs_fast.errors import DBSError
from dbs_fast.search import quality
from dbs_fast.search.tables import ban_table
from dbs_fast.text import occurrence
from dbs_fast.text.constraints import (
    BoostTable,
    merge_boosts,
    parse_keyword,
    parse_keywords,
)
from dbs_fast.text.embeddings import SparseBoost
from dbs_fast.text.words import words

KW = ["colony", "enemy", "mouth"]


# -- syntax and occurrence on hand-made texts ----------------------------------------------------
def test_parse_phrases_and_alternatives():
    k = parse_keyword(" ice   cream |gelato")
    assert k.text == "ice cream|gelato" and k.alternatives == (("ice", "cream"), ("gelato",))
    assert [x.text for x in parse_keywords("run|ran, New York")] == ["run|ran", "New York"]
    for bad, msg in (("run|", "empty alternative"), ("|ran", "empty alternative"), ("ice-cream!", "must be words")):
        with pytest.raises(DBSError, match=msg):
            parse_keyword(bad)


def test_phrase_and_alternative_occurrence():
    assert occurrence.count("I ate Ice creams. ice cold cream", parse_keyword("ice cream")) == 1   # words must follow one another
    assert occurrence.count("he ran; she runs", parse_keyword("run|ran")) == 2
    assert occurrence.count("he ran; she runs", parse_keyword("walk|stroll")) == 0
    # a phrase split across a chunk boundary counts once, for the chunk that completes it
    assert occurrence.count_new("We had ice", " cream today", parse_keyword("ice cream")) == 1
    assert occurrence.count_new("We had ice cream", " today", parse_keyword("ice cream")) == 0
    assert occurrence.count_new("We had ic", "e cream", parse_keyword("ice cream")) == 1
    assert occurrence.first_match("Off to New  York!", parse_keyword("new york")) == (7, 16)


def test_lemma_rule_is_commongens_coverage():
    """`match="lemma"` recognises a keyword exactly where CommonGen's coverage does: the paper's
    stems also count "performance" for "perform" (CommonGen dev set 86 under --guarantee wrote
    only "performance"), and miss "ran" for "run"."""
    from dbs_fast.evaluation.metrics import coverage

    cases = [("Rob dressed for his dance performance.", "perform"), ("The geese ran home.", "run"),
             ("He runs.", "run"), ("A standard field.", "stand"), ("Three colonies.", "colony"),
             ("We ate ice creams.", "ice cream"), ("The dancer bowed.", "dance")]
    for text, kw in cases:
        if " " not in kw:
            assert (occurrence.count(text, parse_keyword(kw), rule="lemma") > 0) == (coverage(text, [kw]) == 1.0), (text, kw)
    assert occurrence.count("Rob's dance performance.", parse_keyword("perform")) == 1                  # stem: counted
    assert occurrence.count("Rob's dance performance.", parse_keyword("perform"), rule="lemma") == 0
    assert occurrence.count("The geese ran home.", parse_keyword("run"), rule="lemma") == 1
    assert occurrence.count("We ate ice creams.", parse_keyword("ice cream"), rule="lemma") == 1
    assert occurrence.count_new("a dance perform", "ance.", parse_keyword("perform"), open_end=True, rule="lemma") == 0
    assert occurrence.count_new("a dance perform", "ance.", parse_keyword("perform"), open_end=True) == 1
    # the scheduler credits by the config's rule
    kws = parse_keywords("perform,dance")
    assert _credit("any")(kws, 0b11, "It is", " a dance performance.", True)[1] == 0b11
    assert _credit("any", match="lemma")(kws, 0b11, "It is", " a dance performance.", True)[1] == 0b10
    with pytest.raises(DBSError, match="`match`"):
        DBSConfig(match="prefix")


def _credit(order, guarantee=False, match="stem"):
    """Q's keyword credit under a config: with `guarantee` the word-piece table is on (glue is
    banned), so a keyword at the very end counts at once (no open end)."""
    cfg = DBSConfig(order=order, guarantee=guarantee, match=match)
    return lambda kws, rem, prefix, text, final=False: quality.credit(cfg, kws, rem, prefix, text,
                                                                      open_end=not guarantee, final=final)


def test_credit_next_is_the_papers_pointer_and_any_counts_whichever_appears():
    kws = parse_keywords("colony,enemy,mouth")
    text = " the enemy met a colony at the mouth."
    # next: only the next keyword in order counts (c = its occurrences); later ones wait
    credit, new = _credit("next")(kws, 0b111, "It is", text)
    assert new == 0b001 and credit == pytest.approx(np.exp(-1))
    credit, new = _credit("next")(kws, 0b110, "It is", " the colony and the mouth")
    assert new == 0                                                   # "enemy" is next: mouth waits
    # any: every remaining keyword that appears, exp(-c) each
    credit, new = _credit("any")(kws, 0b111, "It is", text)
    assert new == 0b111 and credit == pytest.approx(3 * np.exp(-1))
    credit, new = _credit("any")(kws, 0b110, "It is", " the colony and the mouth, the mouth.")
    assert new == 0b100 and credit == pytest.approx(np.exp(-2))      # colony already placed: not counted
    # next under guarantee: consecutive keywords in order (forcing can place two in one chunk)
    credit, new = _credit("next", True)(kws, 0b111, "It is", " colony enemy")
    assert new == 0b011
    # without the word-piece table, a keyword at the very end of the chunk counts once the text
    # goes on without gluing onto it (or ends there); with it (guarantee, boost_word_starts) at
    # once, as the next token cannot glue
    assert _credit("any")(kws, 0b100, "It is", " the mouth", False)[1] == 0
    assert _credit("any")(kws, 0b100, "It is", " the mouth", True)[1] == 0b100
    assert _credit("any", True)(kws, 0b100, "It is", " the mouth", False)[1] == 0b100


def test_merged_boost_rows_are_the_per_token_max():
    a = SparseBoost("a", np.array([1, 3, 5], np.int32), np.array([1.0, 2.0, 3.0], np.float32))
    b = SparseBoost("b", np.array([3, 4], np.int32), np.array([5.0, 1.0], np.float32))
    c = SparseBoost("c", np.array([0, 5], np.int32), np.array([0.5, 4.0], np.float32))
    m = merge_boosts("abc", [a, b, c])
    assert m.ids.tolist() == [0, 1, 3, 4, 5] and m.values.tolist() == [0.5, 1.0, 5.0, 1.0, 4.0]
    t = BoostTable([a, b, c])
    assert t.row(0, 0b010) == 1 and t.row(0, 0) == -1               # one keyword: its own row
    r = t.row(0, 0b111)
    assert r == 3 and t.row(0, 0b111) == 3                            # merged once, then cached
    ptr, ids, vals = t.csr
    assert ids[ptr[r]:ptr[r + 1]].tolist() == m.ids.tolist()
    assert t.rows_for(np.array([0, 0]), np.array([0b101, 0b001])).tolist() == [4, 0]


# -- the engine on a tiny random model ----------------------------------------------------------
@pytest.fixture(scope="module")
def dbs(exported):
    return DirectedBeamSearch(exported["gpt2"], config=DBSConfig(beams=2, candidates=3, chunk=4, max_new_tokens=16))


@pytest.mark.parametrize("order", ["next", "any"])
@pytest.mark.parametrize("lam", [0.0, 20.0])
def test_guarantee_places_every_keyword_at_any_lambda(dbs, order, lam):
    from dataclasses import replace

    cfg = replace(dbs.config, order=order, lam=lam, guarantee=True)
    free = replace(cfg, guarantee=False)
    plain = [dbs.generate("It is", KW, seed=s, config=free).success_rate for s in range(4)]
    for seed in range(4):
        r = dbs.generate("It is", KW, seed=seed, config=cfg)
        assert r.success_rate == 1.0, r.generated
        assert r.new_tokens <= cfg.max_new_tokens
    if lam == 0.0:
        assert min(plain) < 1.0          # the test bites: unguided by boosts, the random model misses


@GPT2_VOCAB
@pytest.mark.parametrize("order", ["next", "any"])
def test_sentence_deadline_puts_every_keyword_in_the_first_sentence(dbs, order):
    """With a sentence deadline under guarantee, no sentence ends while a keyword is missing and
    the keywords are forced in time for it: all of them are in the first sentence. Without it the
    random model ends sentences early (the test bites)."""
    from dataclasses import replace

    from dbs_fast.evaluation.runs import first_sentence

    cfg = replace(dbs.config, order=order, guarantee=True, stop="max", max_new_tokens=30, lam=0.0,
                  no_repeat_word_window=0)        # the deadline alone (texts of a fixed random model)
    deadline = replace(cfg, sentence_deadline=10)
    hits, before = [], []
    for seed in range(6):
        r = dbs.generate("It is", KW, seed=seed, config=deadline)
        s = first_sentence(r.generated)
        hits.append(all(occurrence.count(s, parse_keyword(k)) for k in KW))
        assert max(f["token"] for f in r.found.values()) <= 10 + 2, r.found    # forced in time
        s = first_sentence(dbs.generate("It is", KW, seed=seed, config=cfg).generated)
        before.append(all(occurrence.count(s, parse_keyword(k)) for k in KW))
    assert all(hits) and not all(before), (hits, before)


@GPT2_VOCAB
def test_a_keyword_deadline_places_the_words_by_it_and_the_text_goes_on_past_it(dbs):
    """With `keyword_deadline` under guarantee the keywords are forced in time for it, not for the
    budget's end, and the text runs on to the budget; without it the last ones wait for the budget
    (the test bites)."""
    from dataclasses import replace

    cfg = replace(dbs.config, order="any", guarantee=True, stop="max", max_new_tokens=30, lam=0.0,
                  no_repeat_word_window=0)        # the deadline alone (texts of a fixed random model)
    due, late = [], []
    for seed in range(4):
        r = dbs.generate("It is", KW, seed=seed, config=replace(cfg, keyword_deadline=10))
        due.append(max(f["token"] for f in r.found.values()))
        assert r.success_rate == 1.0 and r.new_tokens == 30, r
        late.append(max(f["token"] for f in dbs.generate("It is", KW, seed=seed, config=cfg).found.values()))
    assert max(due) <= 10 + 2 and max(late) > 12, (due, late)


def test_guarantee_with_phrases_alternatives_and_a_word_the_embeddings_lack(dbs):
    from dataclasses import replace

    cfg = replace(dbs.config, guarantee=True, order="any", max_new_tokens=20)
    kws = ["the colony", "enemy|enemies", "qwzxvbnmkj"]
    for seed in range(3):
        r = dbs.generate("It is", kws, seed=seed, config=cfg)
        assert r.success_rate == 1.0 and all(r.found[k] is not None for k in kws), r.generated
    with pytest.raises(DBSError, match="not in the embeddings") as e:   # without --guarantee: an error,
        dbs.generate("It is", kws, config=replace(cfg, guarantee=False))
    # suggesting the measured way round it, in the words of the door that asked
    assert "use `subword_fallback` with `guarantee`" in str(e.value) and "--" not in str(e.value)
    assert "--subword-fallback with --guarantee" in e.value.in_cli()
    from dbs_fast.api import DirectedBeamSearch

    taken = DirectedBeamSearch(dbs.model_dir, config=cfg, subword_fallback=True)   # the suggestion, taken
    r = taken.generate("It is", kws, seed=0, config=cfg)
    assert r.success_rate == 1.0, r.generated


def test_a_keyword_listed_twice_counts_each_time_it_is_placed(dbs):
    """The paper's set 9 lists "tie" twice: the success rate counts it twice (it was 0.8 with
    every word in the text, because `found` is keyed by word)."""
    from dataclasses import replace

    cfg = replace(dbs.config, guarantee=True, order="next")
    r = dbs.generate("It is", ["colony", "enemy", "enemy"], seed=0, config=cfg)
    assert r.found["enemy"] is not None and r.success_rate == 1.0, r.generated


def test_phrase_rest_is_forced_after_its_first_word(dbs):
    from dataclasses import replace

    cfg = replace(dbs.config, max_new_tokens=12)
    be = dbs.backend
    head = tuple(be.tokenizer.encode(" mouth", add_special_tokens=False).ids)
    r = dbs.request("It is", ["mouth of the river"], None, 0, cfg)
    assert r.phrases and any(h == head for _, h, _ in r.phrases)
    # the first word is forced by the deadline; the phrase's rest then follows token by token
    r = dbs.generate("It is", ["mouth of the river"], config=replace(cfg, guarantee=True))
    assert occurrence.count(r.generated, parse_keyword("mouth of the river")) == 1


def _several_token_word(dbs) -> tuple[str, list[int]]:
    """A word the embeddings know that the tokenizer writes in several tokens."""
    for word in ("rodeo", "frisbee", "surfboard", "goalie", "chisel", "bronco", "accordion", "trombone"):
        ids = dbs.builder.pieces(" " + word)
        if len(ids) > 1 and dbs.table.emb.vector(word) is not None:
            return word, ids
    pytest.skip("no several-token word in this tokenizer and embeddings")


def test_a_keyword_of_several_tokens_is_written_from_its_own_first_token(dbs):
    """complete_words: the keyword's own first token (" rode" of "rodeo") gets the full boost and
    the rest is forced once it is out. Without it the embedding boost alone rarely writes the word
    (the test bites)."""
    from dataclasses import replace

    word, ids = _several_token_word(dbs)
    cfg = replace(dbs.config, max_new_tokens=12, lam=20.0)
    on = dbs.request("It is", [word], None, 0, cfg)
    boost = dict(zip(on.boosts[0].ids.tolist(), on.boosts[0].values.tolist()))
    assert boost[ids[0]] == pytest.approx(cfg.lam)
    assert (tuple(ids[:1]), tuple(ids)) in [(h, w) for _, h, w in on.phrases]
    off = dbs.request("It is", [word], None, 0, replace(cfg, complete_words=False))
    assert dict(zip(off.boosts[0].ids.tolist(), off.boosts[0].values.tolist())).get(ids[0], 0.0) < cfg.lam
    assert not off.phrases
    seeds = range(6)
    placed = [dbs.generate("It is", [word], seed=s, config=cfg).success_rate for s in seeds]
    before = [dbs.generate("It is", [word], seed=s, config=replace(cfg, complete_words=False)).success_rate
              for s in seeds]
    assert np.mean(placed) >= 5 / 6 and np.mean(placed) > np.mean(before), (placed, before)
    r = dbs.generate("It is", [word], seed=0, config=cfg)
    assert occurrence.count(r.generated, parse_keyword(word)) >= 1, r.generated


def test_a_keyword_that_begins_another_is_not_glued_into_it(dbs):
    """CommonGen set 46 ("pile blow blower", --guarantee) wrote "blower" only: " blow" counted for
    "blow", then complete_words forced "er" for "blower" onto it. A keyword just completed stays."""
    from dataclasses import replace

    pairs = [(a, b) for a, b in (("blow", "blower"), ("rode", "rodeo"), ("cross", "crossbow"), ("arm", "armchair"))
             if len(dbs.builder.pieces(" " + a)) == 1 and dbs.builder.pieces(" " + b)[:1] == dbs.builder.pieces(" " + a)
             and len(dbs.builder.pieces(" " + b)) > 1 and dbs.table.emb.vector(b) is not None]
    if not pairs:
        pytest.skip("no word here that the tokenizer writes as another keyword's token + a piece")
    # chunk 1: every token ends a chunk, so the head is credited before its next token is drawn
    cfg = replace(dbs.config, guarantee=True, order="any", chunk=1, max_new_tokens=16, lam=20.0)
    for seed in range(4):
        r = dbs.generate("It is", list(pairs[0]), seed=seed, config=cfg)
        assert r.success_rate == 1.0, r.generated


def test_a_keyword_inside_another_forced_keyword_is_not_counted_until_the_word_ends(dbs):
    """CommonGen set 941 ("sharpener" and "sharpen", --guarantee): the forced " sharpen" of
    " sharpen"+"er" was counted as "sharpen" mid-word, so "sharpen" was never forced; the chunk's
    credit then (rightly) found only "sharpener". Lambda 0 and a budget of just the two keywords'
    tokens: everything is forced, the longer keyword first (any order forces the lowest bit)."""
    from dataclasses import replace

    pairs = [(b, a) for a, b in (("sharpen", "sharpener"), ("blow", "blower"), ("rode", "rodeo"), ("arm", "armchair"))
             if len(dbs.builder.pieces(" " + a)) == 1 and dbs.builder.pieces(" " + b)[:1] == dbs.builder.pieces(" " + a)
             and len(dbs.builder.pieces(" " + b)) > 1]
    if not pairs:
        pytest.skip("no word here that the tokenizer writes as another keyword's token + a piece")
    long_, short = pairs[0]
    budget = len(dbs.builder.pieces(" " + long_)) + len(dbs.builder.pieces(" " + short))
    for chunk in (budget, 1):
        cfg = replace(dbs.config, guarantee=True, order="any", chunk=chunk, max_new_tokens=budget, lam=0.0,
                      stop="max")
        for seed in range(2):
            r = dbs.generate("It is", [long_, short], seed=seed, config=cfg)
            assert r.success_rate == 1.0, (chunk, r.generated)


def test_banned_word_never_appears_and_the_test_bites(dbs):
    from collections import Counter
    from dataclasses import replace

    cfg = replace(dbs.config, guided=False, max_new_tokens=16)
    # words of the whole text: token healing may finish the context's last word ("It isolate")
    texts = [dbs.generate("It is", ["colony"], seed=s, config=cfg).text for s in range(8)]
    common = [w for w, _ in Counter(w for t in texts for w in words(t) if w.isalpha() and w not in ("it", "is"))
              .most_common(3)]
    assert common, texts
    before = sum(words(t).count(w) for t in texts for w in common)
    assert before > 0                                                 # the words do appear unbanned
    for s in range(8):
        t = dbs.generate("It is", ["colony"], seed=s, config=cfg, ban=common).text
        assert not set(words(t)) & set(common), (common, t)


def test_bad_constraint_input_is_a_clear_error(dbs):
    from dataclasses import replace

    with pytest.raises(DBSError, match="also banned"):
        dbs.generate("It is", ["colony", "enemy"], ban="Colonies")   # same stem
    longest = max(len(dbs.builder.pieces(" " + k)) for k in KW)        # each keyword fits, all of them do not
    with pytest.raises(DBSError, match="can hold"):
        dbs.generate("It is", KW, config=replace(dbs.config, guarantee=True, max_new_tokens=longest))
    with pytest.raises(DBSError, match="`order`"):
        DBSConfig(order="sideways")


def test_ban_table_groups_are_bans_then_heal_glue_eos_per_request_each_distinct_group_once():
    """The ban groups of a batch (rebuilt with NumPy whenever a request joins or leaves) are the
    plain construction: request q's group for 4 * heal + 2 * glue + eos = its own bans, then
    (heal, token healing's first token) every token that does not re-write the context's end,
    then (glue) every word-piece token, then (eos) every EOS token, each a sequence of its own; a
    group the same as another request's (same bans, same healing) is the same group, kept once."""
    from types import SimpleNamespace

    from dbs_fast.text.constraints import Healing

    word_piece = np.zeros(50, bool)
    word_piece[[3, 17, 41]] = True
    heal = Healing([1], " x", np.array([20, 21], np.int32))
    requests = [SimpleNamespace(bans=[(5,), (9, 10)], heal=None), SimpleNamespace(bans=[], heal=heal),
                SimpleNamespace(bans=[(1, 2, 3)], heal=None), SimpleNamespace(bans=[], heal=heal),
                SimpleNamespace(bans=[(5,), (9, 10)], heal=None)]
    (group_ptr, seq_ptr, seq_tok), group_of = ban_table(requests, DBSConfig(), np.array([7, -1]), None, word_piece)
    assert group_ptr.dtype == seq_ptr.dtype == np.int64 and seq_tok.dtype == np.int32

    glue, eos = [(3,), (17,), (41,)], [(7,)]
    for q, r in enumerate(requests):
        healed = [(20,), (21,)] if r.heal else []
        for h, g, e in np.ndindex(2, 2, 2):
            want = list(r.bans) + healed * h + glue * g + eos * e
            grp = group_of[q, 4 * h + 2 * g + e]
            got = [tuple(seq_tok[seq_ptr[i]:seq_ptr[i + 1]]) for i in range(group_ptr[grp], group_ptr[grp + 1])]
            assert got == want, (q, h, g, e)
    assert (group_of[3] == group_of[1]).all() and (group_of[4] == group_of[0]).all()
    assert (group_of[0, :4] == group_of[0, 4:]).all()                    # no healing: heal groups are the plain ones
    assert len(group_ptr) - 1 == len(np.unique(group_of)) == 4 + 8 + 4     # the distinct groups only


def test_token_texts_heal_bans_every_token_that_does_not_rewrite_the_tail():
    from dbs_fast.text.constraints import TokenTexts

    vocab = [" teach", " teacher", " te", "teach", " teaching", "<s>", " tea", "\ufffd", " teachers"]
    tt = TokenTexts(lambda i: vocab[i], len(vocab), special={5})
    assert tt.starting_with(" teach").tolist() == [0, 1, 4, 8]
    h = tt.heal([5, 2, 0], " teach")
    assert h.context_ids == [5, 2] and h.tail == " teach"
    assert h.ban.tolist() == [i for i in range(len(vocab)) if not vocab[i].startswith(" teach") or i == 5]
    assert h.ban.dtype == np.int32                         # sorted int32, as the kernel reads it
    assert tt.heal([0], " teach") is None                  # nothing left to read
    assert tt.heal([5, 7], "\ufffd") is None               # a partial character


def test_a_keyword_the_context_names_is_boosted_at_lam_named(dbs):
    """lam_named: a keyword the context already names (by the match rule: "colonies" names
    "colony") gets that strength, the others lambda's; unset, every keyword gets lambda."""
    from dataclasses import replace

    def strongest(req):
        return [float(b.values.max()) for b in req.boosts]

    cfg = replace(dbs.config, lam=20.0, lam_named=1.0, lam_ahead=None, match="stem")
    assert strongest(dbs.request("Two colonies met.", "colony,enemy", None, 0, cfg)) == pytest.approx([1.0, 20.0])
    assert strongest(dbs.request("It is", "colony,enemy", None, 0, cfg)) == pytest.approx([20.0, 20.0])
    assert strongest(dbs.request("Two colonies met.", "colony,enemy", None, 0,
                                 replace(cfg, lam_named=None))) == pytest.approx([20.0, 20.0])


def test_similarity_power_keeps_the_words_own_boost_and_shrinks_its_neighbours(dbs):
    """similarity_power p: a token's boost is lambda * cos^p (the paper's p = 2); the keyword's own
    first tokens keep lambda, and every related token's boost is lambda * (boost_2 / lambda)^(p/2),
    those under the cutoff dropped; a power outside 0.5..32 is refused naming the field."""
    from dataclasses import replace

    from dbs_fast.errors import DBSError

    cfg = replace(dbs.config, lam=20.0, boost_word_starts=False)
    two, six = (dbs.request("It is", "colony", None, 0, replace(cfg, similarity_power=p)).boosts[0] for p in (2, 6))
    at2 = dict(zip(two.ids.tolist(), two.values.tolist()))
    at6 = dict(zip(six.ids.tolist(), six.values.tolist()))
    assert max(at6.values()) == pytest.approx(20.0) and set(at6) < set(at2)
    for t, v in at6.items():
        assert v == pytest.approx(20.0 * (at2[t] / 20.0) ** 3, rel=1e-4)
    assert all(20.0 * (v / 20.0) ** 3 < cfg.boost_cutoff for t, v in at2.items() if t not in at6)
    for bad in (0.0, 40, True):
        with pytest.raises(DBSError) as e:
            replace(cfg, similarity_power=bad)
        assert e.value.field == "similarity_power"


@GPT2_VOCAB
def test_inflect_guides_towards_every_form_the_lemma_rule_counts(dbs):
    """inflect (with match lemma): a keyword's inflections join its alternatives, its text the same;
    those written in one token get the keyword's own boost, lambda, where without inflect GloVe's
    similarity gives them less; the lemma rule counts them as before; under the stem rule it is
    refused, naming the field."""
    from dataclasses import replace

    from dbs_fast.errors import DBSError
    from dbs_fast.text.constraints import inflected

    kw = inflected(parse_keyword("send"), lambda w: w != "sends")
    assert kw.text == "send" and kw.alternatives[0] == ("send",)
    assert {("sent",), ("sending",)} <= set(kw.alternatives) and ("sends",) not in kw.alternatives
    assert inflected(parse_keyword("ice cream"), lambda w: True).alternatives == (("ice", "cream"),)
    text = "She was sending letters."
    assert occurrence.count(text, kw, rule="lemma") == occurrence.count(text, parse_keyword("send"), rule="lemma") == 1
    cfg = replace(dbs.config, lam=20.0, match="lemma")
    enc = dbs.backend.tokenizer.encode
    forms = [enc(f" {w}", add_special_tokens=False).ids for w in ("sending", "sent")]
    assert all(len(ids) == 1 for ids in forms)
    plain, inflect = (dict(zip(r.boosts[0].ids.tolist(), r.boosts[0].values.tolist()))
                      for r in (dbs.request("It is", "send", None, 0, replace(cfg, inflect=i)) for i in (False, True)))
    assert dbs.request("It is", "send", None, 0, replace(cfg, inflect=True)).keywords[0].text == "send"
    for (t,) in forms:
        assert plain.get(t, 0.0) < 20.0 and inflect[t] == pytest.approx(20.0)
    with pytest.raises(DBSError) as e:
        replace(cfg, match="stem", inflect=True)
    assert e.value.field == "inflect"


def test_a_row_ahead_of_its_deadline_reads_its_keywords_at_lam_ahead(dbs):
    """lam_ahead: a request holds its keywords' boosts at lambda, then at lam_ahead (a keyword the
    context names keeps lam_named in both); a row ahead of its deadline is guided by the second
    set, one behind by the first, alone or merged (order any); unset, one set."""
    from dataclasses import replace

    from dbs_fast.search import guidance
    from dbs_fast.search.rows import Rows
    from dbs_fast.search.tables import BatchTables

    cfg = replace(dbs.config, lam=20.0, lam_named=1.0, lam_ahead=4.0, match="stem", order="any")
    plain = dbs.request("It is", "colony,enemy", None, 0, replace(cfg, lam_ahead=None))
    req = dbs.request("Two colonies met.", "colony,enemy", None, 0, cfg)
    assert [float(b.values.max()) for b in plain.boosts] == pytest.approx([20.0, 20.0])
    assert [float(b.values.max()) for b in req.boosts] == pytest.approx([1.0, 20.0, 1.0, 4.0])
    tables = BatchTables.build([plain, req], cfg, 0, np.array([0]), None, None)
    assert tables.word_base.tolist() == [0, 2] and tables.ahead_at.tolist() == [0, 2]
    rows = Rows.new(np.array([0, 0, 1, 1, 1]), 0, 0)
    ahead = np.array([True, False, True, False, True])
    words = guidance.guide_words(cfg, tables, rows, np.array([2, 2, 2, 2, 3]), ahead)
    assert words[:4].tolist() == [1, 1, 2 + 2 + 1, 2 + 1]           # enemy: plain's either way; req's at 4, at 20
    assert float(tables.boosts.rows[words[4]].values.max()) == pytest.approx(4.0)   # both, merged at lam_ahead


def test_the_default_boosts_lightly_ahead_of_the_deadline_and_the_papers_and_commongens_do_not(dbs):
    """The default preset guides a word at lam_ahead 5 while the text is ahead of its deadline, then
    at lambda's 20; the paper's protocol and the CommonGen task guide at lambda throughout (their
    figures were measured so). The chat door's preset keeps its own 5."""
    from dbs_fast.config import DBSConfig

    assert DBSConfig().lam_ahead == 5.0 and DBSConfig.chat().lam_ahead == 5.0
    assert DBSConfig.paper().lam_ahead is None and DBSConfig.commongen().lam_ahead is None
    strengths = [float(b.values.max()) for b in dbs.request("It is", "colony", None, 0, DBSConfig()).boosts]
    assert strengths == pytest.approx([20.0, 5.0])                   # behind the deadline, then ahead of it
    paper = [float(b.values.max()) for b in dbs.request("It is", "colony", None, 0, DBSConfig.paper()).boosts]
    assert paper == pytest.approx([20.0])


def test_a_request_whose_context_names_every_keyword_draws_at_min_p_named(dbs):
    """min_p_named: a request whose context names all its keywords gets that min_p; one that
    leaves any out, or has none, gets min_p; unset, every request gets min_p. The search reads
    the request's own (each row of a batch at its request's)."""
    from dataclasses import replace

    from dbs_fast.search.tables import BatchTables

    cfg = replace(dbs.config, min_p=0.0, min_p_named=0.1, match="stem")
    both = dbs.request("Two colonies met an enemy.", "colony,enemy", None, 0, cfg)
    one = dbs.request("Two colonies met.", "colony,enemy", None, 0, cfg)
    assert (both.min_p, one.min_p, dbs.request("Two colonies met.", None, None, 0, cfg).min_p) == (0.1, 0.0, 0.0)
    assert dbs.request("Two colonies met an enemy.", "colony,enemy", None, 0,
                       replace(cfg, min_p_named=None)).min_p == 0.0
    tables = BatchTables.build([both, one], cfg, 0, np.array([0]), None, None)
    assert tables.min_p.tolist() == [0.1, 0.0]


def test_a_chat_templates_own_text_does_not_name_a_keyword(exported, tmp_path):
    """A keyword that only the chat template's default system prompt names ("colony" here) is not
    one the user asked for: it keeps lambda's strength; one the message names gets lam_named."""
    import shutil
    from dataclasses import replace

    d = tmp_path / "gpt2"
    shutil.copytree(exported["gpt2"], d)
    (d / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'system' %}System: you serve the colony.\n{% endif %}"
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    dbs = DirectedBeamSearch(d, config=DBSConfig(beams=2, candidates=3, chunk=4, max_new_tokens=16))
    cfg = replace(dbs.config, lam=20.0, lam_named=1.0, lam_ahead=None, match="stem")
    chat = dbs.chat_template.render([{"role": "user", "content": "Tell me about an enemy."}])
    assert "colony" in chat
    assert [float(b.values.max()) for b in dbs.request(chat, "colony,enemy", None, 0, cfg).boosts] == \
        pytest.approx([20.0, 1.0])
