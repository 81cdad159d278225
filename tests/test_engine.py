"""The DBS scheduler, API and CLI on tiny random models (real GPT-2 tokenizer when ../shared is there)."""
import json
from dataclasses import replace

import numpy as np
import pytest
from conftest import GPT2_VOCAB

from dbs_fast import DBSConfig, DirectedBeamSearch
from dbs_fast.cli import main as cli
from dbs_fast.scorer import token_logprobs
from dbs_fast.search.beam import BeamSearch
from dbs_fast.search.quality import select_best
from dbs_fast.text import occurrence
from dbs_fast.text.constraints import parse_keyword

SMALL = DBSConfig(beams=3, candidates=4, chunk=3, max_new_tokens=12)
KW = ["colony", "enemy", "speed"]


@pytest.fixture(scope="module")
def dbs(exported):
    return DirectedBeamSearch(exported["gpt2"], config=SMALL)


def test_fixed_seed_reproduces_and_results_are_consistent(dbs):
    a = dbs.generate("It is", KW, seed=3)
    b = dbs.generate("It is", KW, seed=3)
    assert a.text == b.text and a.beams == b.beams
    assert a.text == "It is" + a.generated and len(a.beams) == SMALL.beams
    assert [x["score"] for x in a.beams] == sorted((x["score"] for x in a.beams), reverse=True)
    assert a.success_rate == sum(v is not None for v in a.found.values()) / 3
    for kw, where in a.found.items():
        assert (where is not None) == (occurrence.count(a.generated, parse_keyword(kw)) > 0)
    assert 1 <= a.new_tokens <= 12 and a.perplexity > 1 and a.seconds > 0


def test_guidance_places_keywords_far_more_than_unguided(dbs):
    guided = [dbs.generate("It is", KW, seed=s).success_rate for s in range(3)]
    plain = [dbs.generate("It is", KW, seed=s, config=DBSConfig(beams=1, candidates=1, chunk=3, max_new_tokens=12,
                                                                guided=False)).success_rate for s in range(3)]
    assert np.mean(guided) >= 0.6 and np.mean(guided) > np.mean(plain) + 0.4


def test_every_batch_reads_the_models_word_table(dbs):
    """The vocabulary's words (the word-loop rule) are decoded once per model: the backend of each
    batch reads the engine's table, not a table of its own."""
    table = dbs.backend.words
    assert dbs.beam_search(dbs.config).be.words is table
    assert dbs.beam_search(dbs.config).be.words is table


def test_kv_reuse_gives_the_logprobs_of_a_full_recompute(dbs):
    """The self-scorer log-probs of the kept beam (KV caches gathered/repeated every chunk)
    equal a from-scratch forward over context + generated tokens."""

    be = dbs.backend
    ctx = be.encode("It is")
    boosts = [dbs.table.sparse(k, SMALL.lam, SMALL.boost_cutoff) for k in KW]
    from dbs_fast.search.beam import Request

    search = BeamSearch(be, dbs.scorer, SMALL, [Request(ctx, [parse_keyword(k) for k in KW], 5, boosts)])
    rows = search.run()[0].rows
    for i in range(len(rows.req)):
        toks = rows.tokens[i, : rows.n_tok[i]]
        full = np.array([ctx + list(toks)])
        logits, _ = be.model.forward(full, be.model.empty_cache(1))
        want = token_logprobs(logits[0, len(ctx) - 1:-1], toks)
        np.testing.assert_allclose(rows.logp[i, : rows.n_tok[i]], want, atol=2e-4)
        # the guide pointer advanced once per chunk that contained the current word, in order
        text = be.decode_batch([toks])[0]
        pos = [occurrence.first_match(text, parse_keyword(k)) for k in KW[: int(rows.found[i]).bit_count()]]
        assert all(p is not None for p in pos)


@pytest.mark.parametrize("temperature,second_scorer", [(1.0, False), (0.7, False), (0.7, True)])
def test_logprobs_are_the_models_own_with_its_likeliest_tokens(dbs, exported, temperature, second_scorer):
    """With `logprobs`, every token of the returned text (and of each beam) comes with the model's
    own log-probability at the sampling temperature and its likeliest tokens there, as a forward
    pass of the whole text computes them, whatever scores the chunks (a second LM reads them at
    temperature 1); the tokens' texts join into the text."""
    if second_scorer:
        dbs = DirectedBeamSearch(exported["gpt2"], config=SMALL, scorer=str(exported["gpt2"]))
    cfg = replace(SMALL, logprobs=3, temperature=temperature)
    result = dbs.generate("It is", KW, seed=5, config=cfg)
    assert dbs.generate("It is", KW, seed=5).logprobs is None
    request = dbs.request("It is", KW, None, 5, cfg)
    be = dbs.backend
    for tokens, text in [(result.logprobs, result.generated)] + [(b["logprobs"], None) for b in result.beams]:
        ids = [e["id"] for e in tokens]
        full = np.array([request.context_ids + ids])
        logits, _ = be.model.forward(full, be.model.empty_cache(1))
        scaled = logits[0, len(request.context_ids) - 1:-1] * np.float32(cfg.inv_temperature)
        np.testing.assert_allclose([e["logprob"] for e in tokens], token_logprobs(scaled, np.array(ids)), atol=2e-4)
        for e, row in zip(tokens, scaled):
            want = np.argsort(-row, kind="stable")[:3]
            assert [a["id"] for a in e["top"]] == list(want)
            np.testing.assert_allclose([a["logprob"] for a in e["top"]], token_logprobs(row[None].repeat(3, 0), want),
                                       atol=2e-4)
            assert [a["token"] for a in e["top"]] == [be.decode_one(int(t)) for t in want]
        if text is not None:
            assert "".join(e["token"] for e in tokens) == text


def test_select_best_keeps_top_cumulative_scores_per_request():
    cum = np.array([0.1, 0.9, 0.5, 0.7, 0.3, 0.2, 0.8, 0.7])
    req = np.array([0, 0, 0, 0, 1, 1, 1, 0])
    assert list(select_best(req, cum, beams=2)) == [1, 3, 4, 6]          # rows 3 and 7 tie: the earlier kept
    assert list(select_best(req, cum, beams=1)) == [1, 6]
    assert list(select_best(req, cum, beams=9)) == list(range(8))          # fewer rows than beams: all


@pytest.mark.parametrize("layout", ["rows", "prefix"])
def test_onnx_scorer_equals_self_scorer_on_the_same_model(exported, dbs, layout):
    """A second LM as scorer, its cache in either layout (prefix: k decode steps per chunk over
    each beam's prefix stored once), gives the generator's own log-probs when it is the same model."""
    other = DirectedBeamSearch(exported["gpt2"], config=SMALL, scorer=str(exported["gpt2"]), kv_layout=layout)
    assert (other.scorer.decoder is not None) == (layout == "prefix")
    for seed in (2, 5):
        a, b = dbs.generate("It is", KW, seed=seed), other.generate("It is", KW, seed=seed)
        assert a.text == b.text and a.perplexity == pytest.approx(b.perplexity, rel=1e-3)


def test_onnx_scorer_follows_a_running_batch_that_empties_and_takes_new_requests(exported, dbs):
    """Continuous batching with a second-LM scorer: when every request has left, the next ones
    start with a scorer holding only their rows (results as if each ran alone)."""
    other = DirectedBeamSearch(exported["gpt2"], config=SMALL, scorer=str(exported["gpt2"]))
    batch = other.batch()
    for context, seed in (("It is", 0), ("The city", 1)):
        batch.admit([other.request(context, KW, seed=seed)])
        (got,) = batch.run()
        alone = dbs.generate(context, KW, seed=seed)
        assert got.text == alone.text and got.perplexity == pytest.approx(alone.perplexity, rel=1e-3)


def test_batch_equals_single_requests(dbs):
    single = [dbs.generate(c, k, seed=s) for c, k, s in [("It is", KW, 0), ("The city", ["meet", "mouth"], 1)]]
    batch = dbs.generate_batch([("It is", KW), ("The city", ["meet", "mouth"])], seeds=[0, 1])
    assert [r.text for r in batch] == [r.text for r in single]


def test_torch_backend_matches_onnx_for_the_same_seed(exported, dbs):
    """The PyTorch baseline runs the same search: its logits equal ONNX's to float rounding, and
    with the same seeds it writes the same texts. The texts are compared at temperature 0.1: the
    random tiny model's logits are nearly flat (std 0.1), so at temperature 1 a rounding
    difference of 1e-7 between two CPU matmul libraries (oneDNN with AMX, MLAS) can flip a draw."""
    pytest.importorskip("torch")

    tb = DirectedBeamSearch(exported["gpt2"], config=SMALL, backend="torch")
    ids = [dbs.backend.encode("It is a colony of")]
    (a, ca), (b, cb) = dbs.backend.prefill(ids), tb.backend.prefill(ids)
    np.testing.assert_allclose(np.asarray(a), b.cpu().numpy(), atol=1e-5)
    step = np.array([ids[0][-1]])
    np.testing.assert_allclose(np.asarray(dbs.backend.step(step, ca)[0]), tb.backend.step(step, cb)[0].cpu().numpy(),
                               atol=1e-5)
    sharp = replace(SMALL, temperature=0.1)
    for seed, cfg in ((0, sharp), (1, sharp), (2, sharp), (3, replace(sharp, min_p=0.05))):
        assert tb.generate("It is", KW, seed=seed, config=cfg).text == dbs.generate("It is", KW, seed=seed, config=cfg).text


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_the_pytorch_baseline_on_a_static_cache_writes_the_dynamic_caches_texts(exported, kind, monkeypatch):
    """The compiled baseline's static cache (`StaticSteps`): steps at bucket shapes, beams reordered
    in place, a full cache moved into the next length bucket. It writes the texts of transformers'
    dynamic cache through torch.compile (dynamo's capture, `backend="eager"`), which
    captures one graph per bucket: a generation past one bucket's length compiles once more, and
    the next generation at those buckets compiles nothing."""
    pytest.importorskip("torch")
    from torch._dynamo.utils import counters

    from dbs_fast import torch_backend

    monkeypatch.setattr(torch_backend, "LENGTH_GRANULE", 16)           # buckets of 16 columns: fewer steps
    cfg = replace(SMALL, beams=2, candidates=2, max_new_tokens=16 + 3, stop="max",   # past one bucket
                  no_repeat_word_window=0, no_repeat_ngram_size=0, repetition_penalty=1.0)
    dynamic, compiled = (DirectedBeamSearch(exported[kind], config=cfg, backend="torch") for _ in range(2))
    compiled.backend.compile(backend="eager")
    graphs = []
    for seed in (0, 1):
        assert compiled.generate("It is", KW, seed=seed).text == dynamic.generate("It is", KW, seed=seed).text
        graphs.append(counters["stats"]["unique_graphs"])
    assert compiled.backend.compile_stats()["buckets"] == [(torch_backend.ROWS_GRANULE, 16),
                                                           (torch_backend.ROWS_GRANULE, 32)]
    assert graphs[1] == graphs[0]                     # the second generation: no new graph


def test_the_static_cache_refuses_sliding_layers(tmp_path):
    """A model whose cache has sliding-window layers keeps the dynamic cache, and says so."""
    pytest.importorskip("torch")
    from conftest import make_checkpoint

    from dbs_fast.errors import DBSError
    from dbs_fast.export.source import load_torch_model, resolve
    from dbs_fast.torch_backend import StaticSteps

    model, _ = load_torch_model(resolve(str(make_checkpoint("gemma3", tmp_path / "gemma3"))))
    with pytest.raises(DBSError, match="sliding attention layers keep transformers' dynamic cache"):
        StaticSteps(model, model.device)


def test_torch_backend_on_cuda_without_a_gpu_says_so(exported, capsys):
    """`--provider cuda` puts the PyTorch baseline on the GPU; a torch that sees none gets a clear
    message and exit code 2, not a traceback (CI has no GPU: the CUDA path is not run here)."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert cli(["generate", "--model", str(exported["gpt2"]), "--keywords", "colony", "--backend", "torch",
                "--provider", "cuda", "--max-new-tokens", "4"]) == 2
    assert "sees no GPU" in capsys.readouterr().err


def test_boost_then_filter_reaches_the_kernel_and_places_a_word_outside_the_nucleus(dbs, monkeypatch):
    """boost_then_filter: every draw boosts before the nucleus cut (the kernel's order is tested
    against its reference in test_kernel). With a nucleus of one token (top_p 1e-6) filtering
    first can only draw the model's top token, and boosting first draws the keyword."""
    from dbs_fast.backend import OnnxBackend

    orders, sample = [], OnnxBackend.sample

    def spy(self, logits, uniforms, rules):
        orders.append(rules.boost_first)
        return sample(self, logits, uniforms, rules)

    monkeypatch.setattr(OnnxBackend, "sample", spy)
    cfg = DBSConfig(beams=2, candidates=2, chunk=3, max_new_tokens=3, top_p=1e-6, stop="max", late_boost_first=False)
    boosted = dbs.generate("It is", ["colony"], seed=0, config=replace(cfg, boost_order="boost_then_filter"))
    assert orders and all(o is True for o in orders)
    orders.clear()
    filtered = dbs.generate("It is", ["colony"], seed=0, config=cfg)
    assert orders and all(o is False for o in orders)
    assert boosted.success_rate == 1.0 and filtered.success_rate == 0.0


def test_cli_json_contract(exported, capsys):
    assert cli(["generate", "--model", str(exported["llama"]), "--keywords", "colony,enemy", "--beams", "2",
                "--candidates", "2", "--chunk", "2", "--max-new-tokens", "6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("text", "keywords", "found", "success_rate", "success_length", "perplexity", "seconds",
                "tokens_per_second"):
        assert key in out
    assert out["keywords"] == ["colony", "enemy"]


def test_cli_text_output_highlights(exported, capsys):
    assert cli(["generate", "--model", str(exported["gpt2"]), "--keywords", "colony", "--beams", "2",
                "--candidates", "2", "--chunk", "2", "--max-new-tokens", "6"]) == 0
    assert "success rate" in capsys.readouterr().out


def test_generate_without_keywords_writes_the_models_own_text(exported, capsys):
    """No --keywords: the same search with no guide words (nothing to find, nothing missed)."""
    assert cli(["generate", "--model", str(exported["gpt2"]), "--beams", "2", "--candidates", "2", "--chunk", "2",
                "--max-new-tokens", "6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["keywords"] == [] and out["found"] == {} and out["success_rate"] == 1.0 and out["new_tokens"] > 0


@pytest.mark.parametrize("args,message", [
    (["--keywords", " , "], "empty keyword"),
    (["--keywords", "colony,,enemy"], "empty keyword"),
    (["--keywords", "colony!"], "must be words"),
    (["--keywords", "run|"], "empty alternative"),
    (["--keywords", "|run"], "empty alternative"),
    (["--keywords", "war,colony", "--ban", "gun,War"], "also banned"),
    (["--keywords", "colony", "--order", "sideways"], "--order: invalid choice"),
    (["--keywords", "colony,enemy,mouth,speed,river", "--guarantee", "--max-new-tokens", "4"], "can hold"),
    (["--keywords", "the colony of the enemy at the mouth"], "more than --max-new-tokens"),
    (["--keywords", "qwzxvbnmkj", "--max-new-tokens", "20"], "not in the embeddings"),
    (["--keywords", "colony", "--max-new-tokens", "400"], "context window"),
    (["--keywords", "colony", "--beams", "0"], "--beams must be"),
    (["--keywords", "colony", "--candidates", "0"], "--candidates must be"),
    (["--keywords", "colony", "--chunk", "0"], "--chunk must be"),
    (["--keywords", "colony", "--top-p", "1.5"], "--top-p must be a float in (0, 1]"),
    (["--keywords", "colony", "--top-p", "0"], "--top-p"),
    (["--keywords", "colony", "--lambda", "-1"], "--lambda must be in [0, 80]"),
    (["--keywords", "colony", "--model", "/nonexistent"], "not found"),
])
def test_cli_errors_exit_2(exported, capsys, args, message):
    argv = ["generate", "--model", str(exported["gpt2"]), "--max-new-tokens", "4"] + args
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("keywords,cfg,says", [
    (["the colony of the enemy at the mouth"], {}, "more than `max_new_tokens`"),
    (["colony"], {"max_new_tokens": 400}, "`max_new_tokens` (400) exceeds"),
    (["qwzxvbnmkj"], {"max_new_tokens": 20}, "use `subword_fallback` with `guarantee`"),
    (["colony"], {"lam": -1}, "`lam` must be in [0, 80]"),
])
def test_the_python_api_names_its_own_arguments_not_the_clis_flags(dbs, keywords, cfg, says):
    """The same faults as the CLI's above, met through the Python API: its message names the
    DBSConfig field or argument a Python caller sets, where the CLI's names the flag."""
    from dbs_fast.errors import DBSError

    with pytest.raises(DBSError) as e:
        dbs.generate("It is", keywords, config=replace(dbs.config, **{"max_new_tokens": 4, **cfg}))
    assert says in str(e.value) and "--" not in str(e.value), str(e.value)


def test_a_config_that_is_not_a_dbsconfig_is_named_not_a_traceback_from_inside(dbs, exported):
    from dbs_fast.errors import DBSError

    with pytest.raises(DBSError, match=r"`config` must be a DBSConfig, got a dict: DBSConfig\(\*\*\{'beams': 2\}\)"):
        dbs.generate("It is", KW, config={"beams": 2})
    with pytest.raises(DBSError, match="`config` must be a DBSConfig, got a str"):
        DirectedBeamSearch(exported["gpt2"], config="paper")
    for bad, says in (({"threads": 0}, "`threads` must be an integer >= 1 or None, got 0"),
                      ({"threads": "2"}, "`threads` must be an integer >= 1 or None, got '2'"),
                      ({"context_cache_mb": -1}, "`context_cache_mb` must be an integer >= 0, got -1")):
        with pytest.raises(DBSError) as e:                       # not ORT's default, a TypeError, a negative store
            DirectedBeamSearch(exported["gpt2"], **bad)
        assert says in str(e.value), str(e.value)


@pytest.mark.parametrize("requests,kw,says", [
    ([("It is", KW), ("The city", KW)], {"seeds": [0]}, "`seeds` must hold one per request: 1 for 2"),
    ([("It is", KW), ("The city", KW)], {"bans": [None]}, "`bans` must hold one per request: 1 for 2"),
    ([("It is", KW)], {"seeds": [0, 1]}, "`seeds` must hold one per request: 2 for 1"),
    ([("It is",)], {}, "`requests` must be a list of (context, keywords) pairs"),
    ("It is", {}, "`requests` must be a list of (context, keywords) pairs"),
])
def test_a_batch_whose_seeds_or_bans_do_not_match_its_requests_is_refused_not_cut(dbs, requests, kw, says):
    """Before, zip dropped the requests past the shorter list: two requests and one seed gave one result."""
    from dbs_fast.errors import DBSError

    with pytest.raises(DBSError) as e:
        dbs.generate_batch(requests, **kw)
    assert says in str(e.value), str(e.value)


def test_a_stream_yields_its_text_as_it_becomes_certain_and_ends_with_generates_text(dbs):
    """`stream`: pieces arrive before the end, are never revised, and join into the result's
    text, which is `generate`'s with the same lag (the service's STREAM_LAG where none is set)."""
    from dbs_fast.config import STREAM_LAG

    cfg = replace(dbs.config, max_new_tokens=15, stop="max")
    s = dbs.stream("It is", KW, seed=2, config=cfg)
    pieces = []
    for piece in s:
        pieces.append(piece)
        if len(pieces) == 1:
            assert s.result is None                                     # the first piece came before the end
    assert len(pieces) >= 2 and all(pieces), pieces
    assert "".join(pieces) == s.result.generated
    assert s.result.generated == dbs.generate("It is", KW, seed=2, config=replace(cfg, stream_lag=STREAM_LAG)).generated
    again = dbs.stream("It is", KW, seed=2, config=replace(cfg, stream_lag=1))
    assert "".join(again) == again.result.generated                     # a lag of its own, honoured


def test_scorer_with_other_vocabulary_is_rejected(exported, tmp_path, capsys):
    from conftest import _trained_bpe
    from transformers import GPT2Config, GPT2LMHeadModel

    from dbs_fast.export.convert import export_model

    tok = _trained_bpe(tmp_path, vocab_size=300)  # differs from the fixtures (GPT-2 or a 400-token BPE)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=16, n_layer=1, n_head=2)).save_pretrained(tmp_path / "c")
    tok.save_pretrained(tmp_path / "c")
    export_model(str(tmp_path / "c"), tmp_path / "o", quiet=True)
    assert cli(["generate", "--model", str(exported["gpt2"]), "--keywords", "colony", "--scorer",
                str(tmp_path / "o"), "--max-new-tokens", "4"]) == 2
    assert "different vocabulary" in capsys.readouterr().err


def test_a_keyword_just_completed_is_never_glued_onto(dbs, monkeypatch):
    """Without --guarantee too: the token after a keyword that was just counted is never a word
    piece ("pet" + "rified"), so the word the engine counted is the word in the text."""
    from dbs_fast.backend import OnnxBackend
    from dbs_fast.search import guidance

    glue, drawn = [], []
    sample, groups = OnnxBackend.sample, guidance.ban_groups

    def spy(*args, **kw):
        ids, lp = sample(*args, **kw)
        drawn.append(ids.copy())
        return ids, lp

    def spy_groups(cfg, tb, rows, *args):
        glue.append(rows.glue.copy())                                 # rows right after a keyword
        out = groups(cfg, tb, rows, *args)
        assert out is not None                                        # the glue bans are on
        return out

    monkeypatch.setattr(OnnxBackend, "sample", spy)                   # a method now: self passes through
    monkeypatch.setattr(guidance, "ban_groups", spy_groups)
    cfg = DBSConfig(beams=3, candidates=4, chunk=3, max_new_tokens=24, stop="max")
    for seed in range(3):
        dbs.generate("It is", KW, seed=seed, config=cfg)
    assert len(glue) == len(drawn)
    after = np.concatenate([ids[g] for g, ids in zip(glue, drawn)])   # tokens right after a keyword
    assert len(after) > 0 and not dbs.word_piece[after].any()


def test_a_results_beams_are_different_texts(dbs):
    """Near-greedy sampling makes candidates alike; the result lists each different text once."""
    r = dbs.generate("It is", ["colony"], seed=0, config=DBSConfig(beams=5, candidates=3, chunk=2, max_new_tokens=6,
                                                                    temperature=0.05, stop="max"))
    texts = [b["text"] for b in r.beams]
    assert texts and len(set(texts)) == len(texts)
    assert [b["score"] for b in r.beams] == sorted((b["score"] for b in r.beams), reverse=True)


def test_greedy_ranks_number_the_free_rows_of_one_history():
    """Temperature 0's ranks: rows of one request with the same tokens so far are numbered in row
    order; a forced row, another request's row and a row of another history start their own."""
    from dbs_fast.search.beam import greedy_ranks
    from dbs_fast.search.rows import Rows

    tokens = np.array([[5, 1], [5, 1], [5, 2], [5, 1], [5, 1], [5, 1], [5, 1]])
    rows = Rows.new(np.array([0, 0, 0, 0, 0, 1, 1]), 2, 0, tokens=tokens, col0=np.zeros(7, np.int64))
    force = np.array([-1, -1, -1, 9, -1, -1, -1])
    assert greedy_ranks(rows, 2, force).tolist() == [0, 1, 0, 0, 2, 0, 1]
    assert greedy_ranks(rows, 1, force).tolist() == [0, 1, 2, 0, 3, 0, 1]


def test_temperature_zero_searches_different_beams_whatever_the_seed(dbs):
    """At temperature 0 a request's beams open with its likeliest tokens in turn and each beam's
    candidates with theirs, so the result's beams are different texts; the seed changes nothing."""
    cfg = replace(SMALL, temperature=0.0, stop="max")
    a, b = (dbs.generate("It is", KW, seed=s, config=cfg) for s in (0, 5))
    assert a.text == b.text and a.beams == b.beams
    texts = [x["text"] for x in a.beams]
    assert len(texts) == SMALL.beams and len(set(texts)) == len(texts)


@pytest.mark.parametrize("context", ["The", "It is", "Yesterday I", "The teach", "It is "])
def test_token_healing_first_token_rewrites_the_contexts_end(dbs, context):
    """The context's last token is taken back; every beam's first token re-writes its text (ONNX
    kernel and the PyTorch baseline alike), and the result continues the context as given."""
    req = dbs.request(context, KW, seed=1)
    assert req.heal is not None and dbs.backend.decode_batch([req.context_ids])[0] + req.heal.tail == context
    search = dbs.beam_search(SMALL)
    search.admit([req])
    fin = search.run()[0]
    firsts = dbs.backend.decode_batch([[t] for t in fin.rows.tokens[:, 0]])
    assert all(f.startswith(req.heal.tail) for f in firsts), firsts
    r = dbs.generate(context, KW, seed=1)
    assert r.text.startswith(context) and r.text == context + r.generated
    off = dbs.generate(context, KW, seed=1, config=DBSConfig(**{**SMALL.to_dict(), "heal": False}))
    assert off.text.startswith(context)


def test_token_healing_is_the_same_in_the_pytorch_baseline(exported, dbs):
    tb = DirectedBeamSearch(exported["gpt2"], config=SMALL, backend="torch")
    for context in ("The teach", "It is "):
        a, b = dbs.generate(context, KW, seed=2), tb.generate(context, KW, seed=2)
        assert a.text == b.text and [x["text"] for x in a.beams] == [x["text"] for x in b.beams]


@GPT2_VOCAB
def test_a_context_reads_as_a_document_and_a_chat_frames_itself(dbs):
    """A plain context starts with the model's document-start token (never a chat-turn marker
    the tokenizer would add); a context that starts with a special token is taken as it is and
    not healed; with --heal false or guarantee's budget all taken, no healing either."""
    start = dbs.backend.tokenizer.token_to_id("<|endoftext|>")
    ids, plain = dbs.builder.context_ids("It is")
    assert plain and ids[0] == start and ids[1:] == dbs.builder.pieces("It is")
    chat = "<|endoftext|>It is"
    ids, plain = dbs.builder.context_ids(chat)
    assert not plain and ids == dbs.builder.pieces(chat)
    assert dbs.request(chat, KW).heal is None
    assert dbs.request("It is", KW, config=DBSConfig(**{**SMALL.to_dict(), "heal": False})).heal is None
    tight = DBSConfig(**{**SMALL.to_dict(), "guarantee": True, "max_new_tokens": 3})
    assert dbs.request("It is", KW, config=tight).heal is None
    empty = dbs.request("", KW)                    # the document start, its first token one a text starts with
    assert empty.context_ids == [start] and empty.heal.tail == "" and start in empty.heal.ban


def test_no_healing_where_the_bans_leave_no_token_to_rewrite_the_end(dbs):
    """A context ending in a word whose every completion is banned is read as given."""
    req = dbs.request("It is", KW, seed=1)
    allowed = sorted(set(range(dbs.backend.vocab_size)) - set(req.heal.ban.tolist()))
    words = sorted({dbs.backend.decode_one(t).strip() for t in allowed})
    assert all(w.isalpha() for w in words), words
    blocked = dbs.request("It is", KW, seed=1, ban=words)
    assert blocked.heal is None and blocked.context_ids == req.context_ids + [dbs.builder.pieces(" is")[0]]
    assert dbs.request("It is", KW, seed=1, ban=words[:1]).heal is not None
    r = dbs.generate("It is", KW, seed=1, ban=words)
    assert r.text.startswith("It is")


def _marked_sentence_ends(exported):
    """The tiny GPT-2 with a third of its vocabulary marked as sentence ends; the stop tokens
    (those and EOS); and each row's generated tokens for a config, three seeds in one batch."""
    d = DirectedBeamSearch(exported["gpt2"], config=SMALL)
    d._sentence_end = np.arange(d.backend.vocab_size) % 3 == 0
    stop = d._sentence_end.copy()
    stop[list(d.backend.eos_ids)] = True

    def tokens(cfg):
        search = d.beam_search(cfg)
        search.admit([d.request("It is", KW, seed=s, config=cfg) for s in range(3)])
        return np.concatenate([f.rows.tokens for f in search.run()])
    return stop, tokens


def test_min_sentence_keeps_sentence_ends_and_eos_out_of_the_first_tokens(exported):
    """No token that ends a sentence and no EOS among a row's first `min_sentence` tokens;
    without it they come at once (the test bites)."""
    stop, tokens = _marked_sentence_ends(exported)
    base = DBSConfig(**{**SMALL.to_dict(), "lam": 0.0, "heal": False})
    assert stop[tokens(base)[:, :6]].any()
    assert not stop[tokens(DBSConfig(**{**base.to_dict(), "min_sentence": 6}))[:, :6]].any()


def test_sentence_deadline_keeps_sentence_ends_out_while_a_keyword_is_missing(exported):
    """Without --guarantee, a sentence deadline bans sentence ends and EOS while a keyword is
    missing, up to the deadline (the random model finds none at lambda 0); after the deadline they
    are allowed again; without it they come at once (the test bites)."""
    stop, tokens = _marked_sentence_ends(exported)
    base = DBSConfig(**{**SMALL.to_dict(), "lam": 0.0, "heal": False, "stop": "max", "max_new_tokens": 12})
    assert stop[tokens(base)[:, :6]].any()
    held = tokens(DBSConfig(**{**base.to_dict(), "sentence_deadline": 6}))
    assert not stop[held[:, :6]].any()
    assert stop[held[:, 6:]].any()


def test_certain_text_is_the_beams_common_prefix_up_to_a_sentence_end():
    from dbs_fast.search.beam import certain_length

    seqs = [np.array([1, 2, 3, 4]), np.array([1, 2, 3, 5, 6]), np.array([1, 2, 3])]
    assert certain_length(seqs) == 3
    assert certain_length([np.array([1, 2]), np.array([7, 2])]) == 0
    end = np.zeros(10, bool)
    end[2] = True                                           # token 2 ends a sentence
    assert certain_length(seqs, end) == 2                   # stop="sentence": a result may be trimmed to it
    assert certain_length([np.array([1, 3])], end) == 0
    assert certain_length([]) == 0


def test_next_order_guides_to_one_keyword_and_any_to_all_remaining():
    from dbs_fast.search import guidance

    rem, seen = np.array([0b110, 0b101, 0b100]), np.array([0, 0b1, 0])
    assert list(guidance.candidates(DBSConfig(order="next"), rem, seen)) == [0b010, 0, 0b100]   # none after a hit
    assert list(guidance.candidates(DBSConfig(order="any"), rem, seen)) == [0b110, 0b101, 0b100]


def test_the_size_check_before_loading_and_the_model_read_the_tokenizer_once(exported):
    """The CLI checks a request's size before the model loads (`preflight`); the model then takes
    the same tokenizer instead of reading it again."""
    from dbs_fast.model import OnnxModel, load_tokenizer
    from dbs_fast.preflight import preflight

    load_tokenizer.cache_clear()
    preflight(exported["gpt2"], SMALL, "It is")
    model = OnnxModel(exported["gpt2"], lazy=True)
    assert load_tokenizer.cache_info().misses == 1
    assert model.tokenizer is load_tokenizer(str(exported["gpt2"] / "tokenizer.json"))


def test_a_tasks_text_output_is_the_answer_without_its_context(exported, capsys):
    """`generate --task commongen` prints the sentence it wrote, not the task's context before it;
    a context the user gives is printed with the text, as without a task."""
    from dbs_fast.config import COMMONGEN_CONTEXT

    args = ["generate", "--model", str(exported["gpt2"]), "--keywords", "colony,enemy", "--beams", "2",
            "--candidates", "2", "--chunk", "3", "--max-new-tokens", "9", "--format", "text"]
    assert cli(args + ["--task", "commongen"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first and COMMONGEN_CONTEXT.strip() not in first and first == first.strip()
    assert cli(args + ["--task", "commongen", "--context", "Yesterday"]) == 0
    assert capsys.readouterr().out.startswith("Yesterday")


def test_pick_rules_on_hand_made_beams():
    from dbs_fast.search.result import pick

    def beam(text, score, finished, logprob):
        return {"text": text, "score": score, "finished": finished, "logprob": logprob}

    beams = [beam("a dog runs after a frisbee in the", 3.0, False, -1.0),      # the best Q, unfinished
             beam("a dog catches the frisbee.", 2.0, True, -2.5),
             beam("the dog catches a frisbee.", 1.5, True, -2.0),
             beam("a dog catches the frisbee in a park.", 1.0, True, -3.0)]
    assert pick("q", beams) == 0
    assert pick("likelihood", beams) == 2                    # the best mean log-prob among the finished
    assert pick("consensus", beams) == 1                     # the finished text most like the other two
    none = [dict(b, finished=False) for b in beams]
    assert pick("likelihood", none) == 0                     # nothing finished: among the scored ones
    dropped = [dict(b, score=-np.inf) if i else b for i, b in enumerate(none)]
    assert pick("consensus", dropped) == 0 and pick("likelihood", [beams[1]]) == 0
    assert pick("blend", beams) == 1                         # places by Q 0, 1, 2 and by likelihood 1, 0, 2
    fused = [beam(t, 4.0 - n, True, lp) for n, (t, lp) in enumerate([("a", -3.0), ("b", -1.0), ("c", -2.0),
                                                                         ("d", -2.5)])]
    assert pick("blend", fused) == 1                         # 1 + 0 beats 0 + 3/2: the likeliest, second by Q
    assert pick("blend", fused[:1] + fused[2:]) == 0         # 0 + 1 (a) against 1 + 0 (c): the tie to Q
    sized = [dict(b, tokens=n) for b, n in zip(beams, (9, 6, 12, 20))]     # sums -15, -24, -60 when finished
    assert pick("likelihood", sized) == pick("likelihood", sized, 1.0) == 2  # 1: the mean, the tokens unread
    assert pick("likelihood", sized, 0.0) == 1               # 0: the best sum, the shortest here
    assert pick("likelihood", sized, 0.5) == 1               # -15/6**0.5 = -6.1 beats -2*12**0.5 = -6.9
    assert pick("likelihood", sized, 2.0) == 3               # -60/400 = -0.15 beats -24/144: the longest wins


@pytest.mark.parametrize("rule", ["likelihood", "consensus", "blend"])
def test_a_picked_result_is_a_finished_beam_returned_first(dbs, rule):
    """The returned text is the picked beam (first in `beams`), and under q it is the best score;
    a pick changes the returned beam only, never the search. (The random model finishes one beam
    at a time; the rules themselves are tested on hand-made beams above.)"""
    cfg = replace(SMALL, max_new_tokens=30, guarantee=True, pick="q")
    for seed in range(6):
        q = dbs.generate("It is", KW[:2], seed=seed, config=cfg)
        r = dbs.generate("It is", KW[:2], seed=seed, config=replace(cfg, pick=rule))
        assert sorted(map(str, q.beams)) == sorted(map(str, r.beams))      # the same search
        assert q.beams[0]["score"] == max(b["score"] for b in q.beams)
        assert [b["text"] for b in sorted(r.beams, key=lambda b: b["rank"])] == [b["text"] for b in q.beams]
        assert r.beams[0]["text"].startswith(r.generated)
        finished = [b for b in r.beams if b["finished"]]
        if finished:
            assert r.beams[0]["finished"]
            if rule == "likelihood":
                assert r.beams[0]["logprob"] == max(b["logprob"] for b in finished)


def test_openings_begin_the_first_chunks_candidates(dbs):
    """With openings, a request's first chunk has b*s rows: one begun with each subject phrase (the
    context and the phrase tokenised together, from the token the healing re-writes), at least b
    drawing freely; the quality score then keeps b, and the text continues the context."""
    from dbs_fast.text.openings import opening_text, subject_phrases

    cfg = replace(SMALL, openings="subjects")
    context = "Here is one scene:\n"
    req = dbs.request(context, KW, seed=2, config=cfg)
    phrases = subject_phrases(KW, cfg.beams * (cfg.candidates - 1))
    assert len(req.openings) == len(phrases) > 0
    healed = dbs.backend.decode_batch([req.context_ids])[0]
    assert [healed + dbs.backend.decode_batch([list(s)])[0] for s in req.openings] == \
        [opening_text(context, p) for p in phrases]
    search = dbs.beam_search(cfg)
    search.admit([req])
    rows, n = search.rows, cfg.beams * cfg.candidates
    seeded = min(len(req.openings), n - cfg.beams)
    assert len(rows.req) == n and (rows.fseq[:seeded] >= 0).all() and (rows.fseq[seeded:] < 0).all()
    rows, _ = search._sample_chunk(rows, search._texts(rows), cfg.chunk, False)
    for i, seq in enumerate(req.openings[:seeded]):
        m = min(len(seq), cfg.chunk)
        assert list(rows.tokens[i, :m]) == list(seq[:m])
    r = dbs.generate(context, KW, seed=2, config=cfg)
    assert r.text == context + r.generated and r.text == dbs.generate(context, KW, seed=2, config=cfg).text
    assert dbs.request("It is", KW, seed=2).openings == []                    # off by default


def test_a_chat_answer_opens_with_a_word_its_message_leaves_out(chat_model_dir):
    """After a chat, the openings are the words the user's message leaves out ("The enemy", not
    people in general); a message that names every word opens as the model means to, with b rows
    (not b*s) in its first chunk, alone or beside a request with openings."""
    from dbs_fast.text.openings import opening_text

    dbs = DirectedBeamSearch(chat_model_dir, config=SMALL)
    cfg = replace(SMALL, openings="subjects", lam_named=1.0)
    said = dbs.chat_template.render([{"role": "user", "content": "Tell me about the colony."}])
    named = dbs.chat_template.render([{"role": "user", "content": "The colony, the enemy and its speed."}])
    req, all_named = dbs.request(said, KW, seed=2, config=cfg), dbs.request(named, KW, seed=2, config=cfg)
    healed = dbs.backend.decode_batch([req.context_ids])[0]
    assert [healed + dbs.backend.decode_batch([list(s)])[0] for s in req.openings] == \
        [opening_text(said, p) for p in ("The enemy", "An enemy", "The speed", "A speed")]
    assert all_named.openings == []
    search = dbs.beam_search(cfg)
    search.admit([all_named, req])
    b, n = cfg.beams, cfg.beams * cfg.candidates
    assert list(search.rows.req) == [0] * b + [1] * n
    assert (search.rows.fseq[:b] < 0).all() and (search.rows.fseq[b:b + 4] >= 0).all() and (search.rows.fseq[b + 4:] < 0).all()
    alone = dbs.beam_search(cfg)
    alone.admit([all_named])
    assert len(alone.rows.req) == b
    assert dbs.generate(named, KW, seed=2, config=cfg).text == dbs.generate(named, KW, seed=2, config=replace(cfg, openings="none")).text


def test_a_repick_reads_the_beams_order_by_q():
    """`benchmarks.pick` re-picks stored beams in their order by Q: by `rank` where stored, the
    stored order where the run picked by Q, and only the rules that read no order otherwise."""
    from benchmarks.pick import repick

    def row(pick, beams):
        return {"generated": beams[0]["text"], "config": {"pick": pick}, "beams": beams}

    a, b, c = ({"text": t, "score": sc, "finished": True, "logprob": lp} for t, sc, lp in
               [("a.", 3.0, -3.0), ("b.", 2.0, -1.0), ("c.", 1.0, -2.0)])
    ranked = row("likelihood", [dict(b, rank=1), dict(a, rank=0), dict(c, rank=2)])   # the likeliest first
    assert [r["generated"] for r in repick([ranked], "q")] == ["a."]
    assert [r["generated"] for r in repick([ranked], "likelihood")] == ["b."]
    assert [r["generated"] for r in repick([ranked], "blend")] == ["a."]     # 0 + 2/2 ties b's 1 + 0: to Q
    assert [r["generated"] for r in repick([row("q", [a, b, c])], "q")] == ["a."]
    unranked = row("blend", [b, a, c])
    assert repick([unranked], "q") is None and [r["generated"] for r in repick([unranked], "blend")] == ["b."]
    assert [r["generated"] for r in repick([unranked], "likelihood")] == ["b."]


def test_a_pick_passes_over_a_word_loop():
    """Every rule but q returns a finished candidate without a word loop where one has none: the
    kernel bans loops of one-token words, not of words of several tokens."""
    from dbs_fast.search.result import pick

    beams = [{"text": t, "score": sc, "finished": True, "logprob": lp} for t, sc, lp in
             [("The birdie hit a racket at the racket racket.", 3.0, -1.0), ("The birdie hit the racket.", 2.0, -1.1)]]
    assert [pick(rule, beams) for rule in ("q", "likelihood", "blend", "consensus")] == [0, 1, 1, 1]
    looped = [dict(b, text="a racket racket racket.") for b in beams]
    assert pick("likelihood", looped) == 0                               # all loop: the rule as it was


def test_an_empty_context_starts_a_text_as_a_document_starts(dbs):
    """Given no context, the first token is one a text starts with (a capital, a digit, a quote or
    an opening bracket), never a space or a word piece: no leading space, no fragment."""
    for seed in range(4):
        r = dbs.generate("", KW, seed=seed)
        first = r.generated[:1]
        assert first and (first.isupper() or first.isdigit() or first in "\"\u201c(["), repr(r.generated)


def test_presence_and_frequency_penalties_read_only_the_tokens_a_row_generated(dbs, monkeypatch):
    """The draw's rules mark where each row's generated tokens start in its history: after the
    context (the same tokens for every row), one more at every column."""
    from dbs_fast.backend import OnnxBackend

    seen, sample = [], OnnxBackend.sample

    def spy(self, logits, uniforms, rules):
        seen.append((rules.history.copy(), *rules.starts(len(uniforms))))
        return sample(self, logits, uniforms, rules)

    monkeypatch.setattr(OnnxBackend, "sample", spy)
    cfg = replace(SMALL, presence_penalty=1.5, frequency_penalty=0.5, no_repeat_ngram_size=0, no_repeat_word_window=0,
                  stop="max")
    result = dbs.generate("It is a", KW, seed=1, config=cfg)
    assert len(seen) == cfg.max_new_tokens and result.new_tokens == cfg.max_new_tokens
    contexts = {h[r, s:g].tobytes() for h, start, gen in seen for r, (s, g) in enumerate(zip(start, gen)) if s < g}
    assert len(contexts) == 1
    for col, (h, start, gen) in enumerate(seen):
        assert (h.shape[1] - gen == col).all() and (gen >= start).all()
