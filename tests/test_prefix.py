"""The prefix KV cache: the attention against a NumPy reference, and the exported
decode graph against the exported full model, over several chunks with keep/repeat and
left-padded contexts of different lengths, for a tiny GPT-2 and a tiny Llama."""
import json
from pathlib import Path

import numpy as np
import pytest
from naive import attention_ref

torch = pytest.importorskip("torch")
pytest.importorskip("optimum.exporters.onnx")


def _slot_major(x, b):
    """(N, kv, K, d) rows -> (K, b, kv, s, d), the chunk layout of the decode graph (and of its
    new K/V, K = L)."""
    return np.ascontiguousarray(x.reshape(b, -1, *x.shape[1:]).transpose(3, 0, 2, 1, 4))


def _attend(q, k, v, xk, xv, pk, pv, ck, cv, xmask, beam_context, pmask, cmask, seen, scale, attention="split"):
    """`attend` on NumPy inputs with the chunks given row-major and the masks as booleans; `attention`
    "gathered" or "fused": its biases for `attend_gathered` or `attend_fused`."""
    from dbs_fast.export.prefix_graph import (
        Biases,
        Dims,
        attend,
        block_biases,
        gathered_biases,
        joint_bias,
        mask_bias,
    )
    from dbs_fast.kv.prefix_cache import context_blocks

    t = torch.from_numpy
    (N, L, H, d), (b, kv, T, _), K, (R, C) = q.shape, pk.shape, ck.shape[2], xmask.shape
    beams, slot = context_blocks(beam_context, R)
    dims = Dims(N, L, b, N // b, T, K, R, beams.shape[1], C, H, kv, d)
    if attention != "split":
        biases = gathered_biases(Biases(None, None, None, None, t(beams), t(slot)), t(seen), None,
                                 *(t(m.astype(np.int64)) for m in (xmask, pmask, cmask)), dims,
                                 fused=attention == "fused")
    else:
        biases = joint_bias(Biases(mask_bias(t(xmask))[:, None, None, :], mask_bias(t(pmask))[:, None, None, :],
                                   *block_biases(t(cmask.astype(np.int64)), t(seen), dims), t(beams), t(slot)))
    o, kn, vn = attend(t(q), t(k), t(v), t(xk), t(xv), t(pk), t(pv), t(_slot_major(ck, b)), t(_slot_major(cv, b)),
                       biases, scale, dims)
    for new, x in ((kn, k), (vn, v)):         # the new K/V come back slot-major, (L, b, kv, s, d)
        np.testing.assert_array_equal(new.numpy(), _slot_major(x.transpose(0, 2, 1, 3), b))
    return o.numpy().reshape(len(q), q.shape[1], -1)     # (N * L, H * d) -> (N, L, H * d)


def _levels(rng, b, s, kv, d, T, K, C, beam_context):
    """Random contexts (R, kv, C, d) with left padding, prefixes (b, kv, T, d) with left padding,
    chunks (N, kv, K, d) row-major, and their masks."""
    R = int(max(beam_context)) + 1
    xk, xv = (rng.standard_normal((R, kv, C, d)).astype(np.float32) for _ in range(2))
    pk, pv = (rng.standard_normal((b, kv, T, d)).astype(np.float32) for _ in range(2))
    ck, cv = (rng.standard_normal((b * s, kv, K, d)).astype(np.float32) for _ in range(2))
    xmask = np.ones((R, C), bool)
    xmask[-1, :C - 2] = False                 # a shorter context, left-padded
    pmask = np.ones((b, T), bool)
    pmask[min(1, b - 1), :3] = False          # left padding
    pmask[-1, :] = False                      # a beam that has generated nothing yet
    return xk, xv, pk, pv, ck, cv, xmask, pmask


def _reference(q, keys_of, r, i, xmask, pmask, cmask, seen, beam_context, s):
    """Plain attention of row r's query i over [its context | its beam's prefix | its chunk | new]."""
    keys, values = keys_of(r)
    mask = np.concatenate([xmask[beam_context[r // s]], pmask[r // s], cmask[r], seen[r, i]])
    return attention_ref(q[r, i], keys, values, mask)


@pytest.mark.parametrize("attention", ["split", "gathered", "fused"])
@pytest.mark.parametrize("beam_context", [[0, 0, 1], [1, 0, 0, 2], [0]])
def test_attend_equals_full_attention_over_the_three_levels(beam_context, attention):
    """One new token per row: attention over the request's context (one copy for all its beams),
    the beam's prefix, the row's chunk and the token itself equals plain attention over their
    concatenation; contexts with different numbers of beams, in any order; in every form (the
    split one's merge of the context by its log-sum-exp, the gathered one's keys per slot, the
    fused one's Attention operator, here its torch reference)."""
    rng = np.random.default_rng(len(beam_context))
    b, s, H, kv, d, T, K, C = len(beam_context), 4, 6, 2, 8, 7, 5, 6
    N = b * s
    bc = np.array(beam_context)
    q, k, v = (rng.standard_normal(sh).astype(np.float32) for sh in ((N, H, d), (N, kv, d), (N, kv, d)))
    xk, xv, pk, pv, ck, cv, xmask, pmask = _levels(rng, b, s, kv, d, T, K, C, bc)
    cmask = np.zeros((N, K), bool)
    cmask[:, :2] = True                       # two chunk tokens decoded so far
    cmask[min(5, N - 1), 2] = True
    seen = np.ones((N, 1, 1), bool)
    got = _attend(q[:, None], k[:, None], v[:, None], xk, xv, pk, pv, ck, cv, xmask, bc, pmask, cmask, seen,
                  1 / np.sqrt(d), attention)[:, 0]

    def keys_of(r):
        return tuple(np.concatenate([x[bc[r // s]], p[r // s], c[r], n[r][:, None]], axis=1)
                     for x, p, c, n in ((xk, pk, ck, k), (xv, pv, cv, v)))
    for r in range(N):
        np.testing.assert_allclose(got[r], _reference(q[:, None], keys_of, r, 0, xmask, pmask, cmask, seen, bc, s),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attention", ["split", "gathered", "fused"])
def test_attend_of_several_new_tokens_is_causal_full_attention(attention):
    """L new tokens per row (a prefill): token i attends to the context, the beam's prefix, the
    row's chunk and the new tokens up to i that are not padding, as plain attention over the
    concatenation."""
    rng = np.random.default_rng(2)
    b, s, L, H, kv, d, T, K, C = 3, 3, 4, 6, 3, 8, 5, 3, 4
    N = b * s
    bc = np.array([0, 1, 1])
    q = rng.standard_normal((N, L, H, d)).astype(np.float32)
    k, v = (rng.standard_normal((N, L, kv, d)).astype(np.float32) for _ in range(2))
    xk, xv, pk, pv, ck, cv, xmask, pmask = _levels(rng, b, s, kv, d, T, K, C, bc)
    cmask = np.zeros((N, K), bool)
    cmask[:, 0] = True
    cmask[4, 1] = True
    nmask = np.ones((N, L), bool)
    nmask[4, :2] = False                       # a left-padded row of new tokens
    seen = np.tril(np.ones((L, L), bool))[None] & nmask[:, None, :]               # (N, L, L)
    got = _attend(q, k, v, xk, xv, pk, pv, ck, cv, xmask, bc, pmask, cmask, seen, 1 / np.sqrt(d), attention)
    assert got.shape == (N, L, H * d)

    def keys_of(r):
        return tuple(np.concatenate([x[bc[r // s]], p[r // s], c[r], n[r].transpose(1, 0, 2)], axis=1)
                     for x, p, c, n in ((xk, pk, ck, k), (xv, pv, cv, v)))
    for r in range(N):
        for i in range(L):
            if nmask[r, i]:                    # a padding query's output is never used
                np.testing.assert_allclose(got[r, i], _reference(q, keys_of, r, i, xmask, pmask, cmask, seen, bc, s),
                                           rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def decoders(checkpoints, exported, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from dbs_fast.export.prefix_graph import export_prefix_decoder

    root = tmp_path_factory.mktemp("prefix")
    out = {}
    for kind, ckpt in checkpoints.items():
        model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
        export_prefix_decoder(model, root / kind / "decode.onnx")
        out[kind] = root / kind / "decode.onnx"
    return out


@pytest.mark.parametrize("fold", [0, 5], ids=["context-level", "context-in-prefixes"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_prefix_decode_equals_full_recompute(kind, fold, decoders, exported):
    """b = 2 requests' contexts (lengths 5 and 2, left-padded) -> b beams x s candidates, three
    chunks of k tokens with keep (a beam kept twice, one dropped) between them: every step's
    logits equal the full model run over each row's whole sequence, with the contexts as their
    own level and with them starting the beams' prefixes (the graph then skips the level)."""
    from dbs_fast.kv.decoder import PrefixDecoder
    from dbs_fast.kv.prefix_cache import ALIGN, PrefixCache
    from dbs_fast.model import OnnxModel

    full = OnnxModel(exported[kind])
    dec = PrefixDecoder(decoders[kind])
    rng = np.random.default_rng(1)
    V, s, k = full.vocab_size, 3, 3
    ctx = np.array([[11, 12, 13, 14, 15], [0, 0, 0, 21, 22]])
    mask = np.array([[1, 1, 1, 1, 1], [0, 0, 0, 1, 1]])
    _, past = full.forward(ctx, full.empty_cache(2), mask)
    cache = PrefixCache.start(past.tensors, past.mask, s, k, fold=fold)
    seqs = [[int(x) for x, m in zip(ctx[r // s], mask[r // s]) if m] for r in range(2 * s)]
    for chunk in range(3):
        for _ in range(k):
            tok = rng.integers(1, V, len(seqs))
            logits = dec.step(tok, cache)
            for r, t in enumerate(tok):
                seqs[r].append(int(t))
            for r, seq in enumerate(seqs):
                ref, _ = full.forward(np.array([seq]), full.empty_cache(1))
                np.testing.assert_allclose(logits[r], ref[0, -1], rtol=1e-4, atol=1e-4)
        keep = [4, 4] if chunk == 0 else [1, 3]          # both beams from one candidate; then a swap
        cache.keep(keep)
        seqs = [list(seqs[keep[r // s]]) for r in range(len(keep) * s)]
    np.testing.assert_array_equal(cache.beam_context, [0, 0])
    assert cache.used == 0 and not cache.chunk_mask.any()
    if fold:       # each beam's prefix is its context's tokens, then what it generated, at the right
        assert cache.context_mask.shape == (1, 1) and not cache.context_mask.any()
        assert cache.mask.shape == (2, ALIGN) and cache.mask[:, -3 * k:].all()
        assert [list(m[m.argmax():]) for m in cache.mask] == [[1] * (len(q) - 0) for q in seqs[::s]]
        return
    # both beams descend from the second context now: the first is gone, the second is trimmed
    # to a width of ALIGN, its two tokens at the right, held once; each beam's prefix is what it
    # generated, at the right of ALIGN columns
    assert cache.context_mask.shape == (1, ALIGN) and cache.context[0].shape[0] == 1
    assert cache.context_mask[0, -2:].all() and not cache.context_mask[0, :-2].any()
    assert cache.mask.shape == (2, ALIGN) and cache.mask.sum(axis=1).tolist() == [3 * k] * 2


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_one_call_prefill_equals_column_by_column_and_the_full_model(kind, decoders, exported, monkeypatch):
    """Left-padded contexts of different lengths prefilled in one call of the decode graph give
    the full model's last logits and the same cache as the graph run one column per call;
    decoding on from either agrees; so does a prefill in slices (a long context), each slice over
    the ones before it."""
    from dbs_fast.kv import decoder as prefix
    from dbs_fast.kv import prefix_cache
    from dbs_fast.kv.decoder import PrefixDecoder
    from dbs_fast.model import OnnxModel

    full = OnnxModel(exported[kind])
    monkeypatch.setattr(prefix_cache, "FOLD_CONTEXT", 0)     # the contexts as their own level, compared
    one, per = PrefixDecoder(decoders[kind]), PrefixDecoder(decoders[kind])
    ctx = np.array([[0, 0, 0, 0, 31, 32], [41, 42, 43, 44, 45, 46], [0, 0, 0, 0, 0, 51]])
    mask = (np.arange(6)[None] >= np.array([4, 0, 5])[:, None]).astype(np.int64)
    ref, _ = full.forward(ctx, full.empty_cache(3), mask)
    a = one.prefill(ctx, mask, full.kv_heads, full.head_dim, s=2, k=3)
    monkeypatch.setattr(prefix, "PREFILL_SLICE", 1)    # one column per call
    b = per.prefill(ctx, mask, full.kv_heads, full.head_dim, s=2, k=3)
    np.testing.assert_allclose(a[0], ref[:, -1], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(a[0], b[0], rtol=1e-4, atol=1e-4)
    assert a[1].context_mask.shape == (3, prefix_cache.ALIGN) and not a[1].context_mask[:, :-6].any()
    np.testing.assert_array_equal(a[1].context_mask[:, -6:], mask)     # the tokens at the right of aligned columns
    for x, y in zip(a[1].context, b[1].context):
        np.testing.assert_allclose(x * a[1].context_mask[:, None, :, None], y * a[1].context_mask[:, None, :, None],
                                   rtol=1e-4, atol=1e-5)
    tok = np.arange(6) + 7
    np.testing.assert_allclose(one.step(tok, a[1]), per.step(tok, b[1]), rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(prefix, "PREFILL_SLICE", 4)    # a long context in slices: 4 columns, then 2
    c = one.prefill(ctx, mask, full.kv_heads, full.head_dim, s=2, k=3)
    np.testing.assert_allclose(c[0], ref[:, -1], rtol=1e-4, atol=1e-4)
    for x, y in zip(c[1].context, b[1].context):
        np.testing.assert_allclose(x * a[1].context_mask[:, None, :, None], y * a[1].context_mask[:, None, :, None],
                                   rtol=1e-4, atol=1e-5)


def _dbs(model_dir, layout):
    from dbs_fast import DirectedBeamSearch

    return DirectedBeamSearch(model_dir, kv_layout=layout)


def test_context_ifs_moves_the_nodes_only_each_branch_needs_into_an_if():
    """The marker `if_context((out, lse), (empty, floor), cond)` becomes an If of two outputs: the
    nodes that compute on the activations or K/V and feed only `out` and `lse` go into its
    then-branch, those only `empty` needs into its else-branch; a node also read elsewhere, and a
    constant, stay in the graph, and a value of the graph that a branch returns (`floor`, made once
    for all layers) is passed on by an Identity. It gives the first pair where cond holds, else the
    second."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from dbs_fast.export.prefix_graph import GRAPH_DOMAIN, context_ifs

    x = "context.0.key"
    nodes = [helper.make_node("Neg", [x], ["shared"]),
             helper.make_node("Constant", [], ["two"], value=helper.make_tensor("t", TensorProto.FLOAT, [], [2.0])),
             helper.make_node("Constant", [], ["floor"], value=helper.make_tensor("f", TensorProto.FLOAT, [], [-9.0])),
             helper.make_node("Exp", [x], ["a"]), helper.make_node("Mul", ["a", "two"], ["a2"]),
             helper.make_node("Add", ["a2", "shared"], ["out"]), helper.make_node("Sqrt", ["a"], ["lse"]),
             helper.make_node("Mul", [x, "two"], ["empty"]),
             helper.make_node("IfContext", ["out", "lse", "empty", "floor", "cond"], ["y", "m"], domain=GRAPH_DOMAIN),
             helper.make_node("Add", ["y", "shared"], ["z"]), helper.make_node("Add", ["z", "m"], ["w"])]
    g = helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(x, TensorProto.FLOAT, [3]),
                     helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("w", TensorProto.FLOAT, [3])]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(GRAPH_DOMAIN, 1)])
    assert context_ifs(g) == 1
    onnx.checker.check_model(g)
    assert [n.op_type for n in g.graph.node] == ["Neg", "Constant", "Constant", "If", "Add", "Add"]
    branch = {a.name: [n.op_type for n in a.g.node] for a in g.graph.node[3].attribute}
    assert branch == {"then_branch": ["Exp", "Mul", "Add", "Sqrt"], "else_branch": ["Mul", "Identity"]}
    assert GRAPH_DOMAIN not in {o.domain for o in g.opset_import}
    sess = ort.InferenceSession(g.SerializeToString(), providers=["CPUExecutionProvider"])
    v = np.array([0.5, -1.0, 2.0], np.float32)
    for cond, want in ((True, 2 * np.exp(v) - 2 * v + np.exp(v / 2)), (False, 2 * v - v - 9.0)):
        np.testing.assert_allclose(sess.run(None, {x: v, "cond": np.array(cond)})[0], want, rtol=1e-6)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_step_without_context_tokens_skips_the_level_to_the_bit(kind, decoders, tmp_path):
    """The decode graph holds its context level in one If a layer, taken where some context column
    is a token. A step whose context columns are all masked (a short context kept in the beams'
    prefixes) skips it, and gives the same logits and new K/V, to the bit, as the same step with
    the level run: a masked context's weight in the softmax is exactly 0."""
    import onnx
    import onnxruntime as ort
    from onnx import helper

    from dbs_fast.export.timing import feeds

    g = onnx.load(str(decoders[kind]))
    ifs = [n for n in g.graph.node if n.op_type == "If"]
    layers = sum(i.name.startswith("context.") for i in g.graph.input) // 2
    assert len(ifs) == layers
    g.graph.node.insert(0, helper.make_node("Constant", [], ["always"], value=helper.make_tensor("t", 9, [], [True])))
    for n in ifs:
        n.input[0] = "always"
    onnx.save(g, str(tmp_path / "always.onnx"))
    skip, run = (ort.InferenceSession(str(p), providers=["CPUExecutionProvider"])
                 for p in (decoders[kind], tmp_path / "always.onnx"))
    x = feeds(skip, 2, 3, 6, K=3, used=1, C=2)
    assert not x["context_mask"].any()
    for a, b in zip(skip.run(None, x), run.run(None, x)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_export_writes_the_decode_graph(kind, exported):
    import json

    from dbs_fast.manifest import MANIFEST

    m = json.loads((exported[kind] / MANIFEST).read_text())
    assert m["prefix_decode"]["written"] and m["prefix_decode"]["max_abs_logit_diff"] < 1e-3
    assert "decode.onnx" in m["files"]
    assert m["prefix_decode"]["shared_bytes"] > 0     # the tied head reads the embeddings, no copy
    if kind == "llama":      # RoPE as ORT's contrib op (angles from a table), within the parity above
        import onnx

        ops = {n.op_type for n in onnx.load(str(exported[kind] / "decode.onnx"), load_external_data=False).graph.node}
        assert m["prefix_decode"]["rope"] == "contrib" and "RotaryEmbedding" in ops and "Neg" not in ops


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_prefix_layout_generates_the_same_text(kind, exported):
    """The scheduler on the prefix cache writes token for token what it writes on the row layout, for
    fixed seeds: several requests of different context lengths in one batch, keep/repeat over
    many chunks, a short last chunk, requests that join a running batch and leave it early."""
    from dbs_fast import DBSConfig

    rows, prefix = _dbs(exported[kind], "rows"), _dbs(exported[kind], "prefix")
    reqs = [("It is", "colony,river"), ("The quick brown fox jumps over", "dog"), ("A", "mouth,speed,meet")]
    for cfg in (DBSConfig(beams=3, candidates=4, chunk=3, max_new_tokens=14, stop="max"),
                DBSConfig(beams=2, candidates=3, chunk=4, max_new_tokens=16, order="any", guarantee=True)):
        a = rows.generate_batch(reqs, seeds=[1, 2, 3], config=cfg)
        b = prefix.generate_batch(reqs, seeds=[1, 2, 3], config=cfg)
        assert [r.generated for r in a] == [r.generated for r in b]
        assert [r.found for r in a] == [r.found for r in b]
        np.testing.assert_allclose([r.perplexity for r in a], [r.perplexity for r in b], rtol=1e-4)
        # the cache it reports: s copies of each beam's prefix on the rows; on the prefix cache two buffers per
        # beam sized for the whole generation (the boundary writes one while reading the other)
        # plus the k-token chunks, so less from s = 4 on
        # (within the ALIGN columns a beam's aligned prefix may hold beyond its tokens)
        assert 0 < b[0].kv_cache_bytes and (b[0].kv_cache_bytes < 1.05 * a[0].kv_cache_bytes or cfg.candidates < 4)
        for dbs in (rows, prefix):                      # staggered: a request joins after two chunks
            batch = dbs.batch(cfg)
            batch.admit([dbs.request(*reqs[0], None, 1, cfg)])
            out = batch.decode_chunk() + batch.decode_chunk()
            batch.admit([dbs.request(*reqs[1], None, 2, cfg)])
            while batch.requests:
                out += batch.decode_chunk()
            texts = sorted(r.generated for _, r in out)
            if dbs is rows:
                want = texts
        assert texts == want
    assert prefix.backend.model._session is None          # model.onnx never opened: weights loaded once
    # once its batch is empty the decoder lets the cache go: nothing bound (an in-place step's
    # outputs are the cache's chunk slots)
    assert prefix.decoder._bound == {}
    assert _dbs(exported[kind], "auto").decoder is not None


def test_a_decode_graph_over_the_protobuf_limit_keeps_its_weights_in_one_data_file(checkpoints, tmp_path,
                                                                                   monkeypatch):
    """GPT-2 large's decode graph is over protobuf's 2 GB: torch writes one file per tensor and
    saving it whole fails. Here the threshold is lowered so a tiny model takes that path."""
    import json

    from dbs_fast.export import prefix_graph
    from dbs_fast.export.convert import export_model
    from dbs_fast.manifest import MANIFEST

    monkeypatch.setattr(prefix_graph, "LARGE", 0)
    out = tmp_path / "large"
    export_model(str(checkpoints["gpt2"]), out, quiet=True)
    m = json.loads((out / MANIFEST).read_text())
    assert m["prefix_decode"]["written"], m["prefix_decode"]
    assert {f.name for f in out.glob("decode.onnx*")} == {"decode.onnx", "decode.onnx_data"}
    assert (out / "decode.onnx_data").stat().st_size > (out / "decode.onnx").stat().st_size
    assert not (out / "_decode").exists()
    r = _dbs(out, "prefix").generate("It is", ["river"], seed=0)
    assert r.new_tokens > 0


def test_a_long_context_leaving_takes_its_columns_from_a_folded_one():
    """A request whose short context is in its beams' prefixes, merged with one whose long context
    is a level of its own, holds that level's width as padding; once the long one leaves, its
    context level is one masked column again, and its prefixes are what they were."""
    from dbs_fast.kv.prefix_cache import PrefixCache

    rng = np.random.default_rng(5)
    kv, d, s, k = 2, 3, 2, 2

    def past(C):
        return [rng.standard_normal((1, kv, C, d)).astype(np.float32) for _ in range(4)]

    long_, short = past(40), past(3)
    a = PrefixCache.start(long_, np.ones((1, 40), np.int64), s, k, fold=32)
    b = PrefixCache.start(short, np.ones((1, 3), np.int64), s, k, fold=32)
    assert a.context_mask.shape == (1, 48) and b.context_mask.shape == (1, 1) and b.mask.shape == (1, 16)
    both = PrefixCache.merge(a, b)
    assert both.context_mask.shape == (2, 48) and not both.context_mask[1].any()
    both.keep([s])                                       # the short request's beam only
    assert both.context_mask.shape == (1, 1) and not both.context_mask.any()
    for t in range(4):
        np.testing.assert_array_equal(both.prefix[t][0][:, -3:], short[t][0])


def test_boundaries_extend_each_beam_from_its_parent_through_the_reused_buffers():
    """Eight chunk boundaries (the prefix buffers are reused from the third on), with repeats, a
    trim and a regroup before any token in between: every beam's prefix is its parent's plus the
    kept row's chunk, as a plain list of token vectors says, and its context is its first
    ancestor's, held once (contexts no beam descends from any more are dropped)."""
    from dbs_fast.kv.prefix_cache import ALIGN, PrefixCache

    rng = np.random.default_rng(3)
    b, s, kv, d, k, layers = 3, 4, 2, 3, 2, 2
    T = 3
    past = [rng.standard_normal((b, kv, T, d)).astype(np.float32) for _ in range(2 * layers)]
    mask = np.ones((b, T), np.int64)
    mask[1, 0] = 0                                                  # left padding survives
    pc = PrefixCache.start(past, mask, s, k, fold=0)                # the contexts as their own level
    seq = [[np.zeros((kv, 0, d), np.float32) for _ in past] for i in range(b)]  # per beam: (kv, T, d) per tensor
    ctx = np.arange(b)                                              # per beam: the context it descends from
    bufs = set()
    for boundary in range(8):
        if boundary == 4:
            pc.regroup(np.arange(b * s)[::-1])                      # before any token: beams reversed
            seq, ctx = seq[::-1], ctx[::-1]
        new = [rng.standard_normal((b * s, kv, 1, d)).astype(np.float32) for _ in range(2 * layers)]
        for _ in range(k):                                          # a step writes in place, then counts
            for slot, x in zip(pc.next_slot(), new):
                slot[...] = _slot_major(x, b)
            pc.advance()
        rows = rng.integers(0, b * s, b)                            # repeats allowed
        pc.keep(rows)
        seq = [[np.concatenate([seq[r // s][t], np.repeat(new[t][r], k, axis=1)], axis=1) for t in range(2 * layers)]
               for r in rows]
        ctx = ctx[rows // s]
        bufs.update(id(o) for o in pc._own)
        W, C = pc.mask.shape[1], pc.context_mask.shape[1]
        assert W % ALIGN == 0 and C % ALIGN == 0 and W - ALIGN < seq[0][0].shape[1] <= W   # aligned, no more
        for i in range(b):
            n = seq[i][0].shape[1]
            assert not pc.mask[i, :W - n].any() and pc.mask[i, W - n:].all()
            for t in range(2 * layers):
                np.testing.assert_array_equal(pc.prefix[t][i][:, W - n:], seq[i][t])    # the tokens at the right
                np.testing.assert_array_equal(pc.context[t][pc.beam_context[i]][:, C - T:], past[t][ctx[i]])
        assert len(pc.context[0]) == len(set(ctx)) == pc.context_mask.shape[0]
        assert pc.mask.shape == (b, pc.prefix[0].shape[2]) and not pc.chunk_mask.any()
    assert len(bufs) < 8 * 2 * layers                               # buffers were reused, not reallocated
    pc.trim()
    assert pc.prefix[0].shape[2] == pc.mask.shape[1]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_padding_by_whole_aligns_leaves_a_steps_logits_to_the_bit(kind, decoders):
    """A beam's prefix left-padded by any multiple of ALIGN masked columns (what a longer batchmate
    does to it) gives the same logits to the bit, step after step: the padding moves its columns by
    whole vector lanes (why the cache keeps each level's width a multiple of ALIGN)."""
    from dbs_fast.kv.decoder import PrefixDecoder
    from dbs_fast.kv.prefix_cache import ALIGN

    dec = PrefixDecoder(decoders[kind])
    kv, d = next(i.shape for i in dec.session.get_inputs() if i.name == "prefix.0.key")[1::2]
    ids = np.array([[11, 12, 13, 14, 15]])

    def steps(extra):
        _, cache = dec.prefill(ids, np.ones_like(ids), kv, d, 3, 3)
        assert cache.mask.shape[1] == ALIGN
        cache.prefix = [np.ascontiguousarray(np.pad(p, [(0, 0), (0, 0), (extra, 0), (0, 0)])) for p in cache.prefix]
        cache.mask = np.pad(cache.mask, [(0, 0), (extra, 0)])
        return [dec.step(np.full(3, 7 + t), cache).copy() for t in range(3)]

    base = steps(0)
    for extra in (ALIGN, 2 * ALIGN, 4 * ALIGN, 32 * ALIGN):
        for a, b in zip(base, steps(extra)):
            np.testing.assert_array_equal(a, b)


def test_a_step_writes_its_new_kv_into_the_next_chunk_slot_in_place():
    """`next_slot` is a view of slot `used` of every chunk tensor (where an in-place step binds its
    new K/V); `advance` counts it; `slots` hands a step the decoded slots, contiguous."""
    from dbs_fast.kv.prefix_cache import PrefixCache

    rng = np.random.default_rng(5)
    b, s, kv, d, k, T = 2, 3, 2, 4, 4, 3
    past = [rng.standard_normal((b, kv, T, d)).astype(np.float32) for _ in range(2)]
    pc = PrefixCache.start(past, np.ones((b, T), np.int64), s, k)
    for j in range(2):
        slot = pc.next_slot()
        assert slot[0].shape == (1, b, kv, s, d) and np.shares_memory(slot[0], pc.chunk[0][j])
        new = rng.standard_normal(slot[1].shape).astype(np.float32)
        slot[1][...] = new
        pc.advance()
        np.testing.assert_array_equal(pc.chunk[1][j], new[0])
    assert pc.used == 2 and pc.chunk_mask[:, :2].all() and not pc.chunk_mask[:, 2:].any()
    assert not pc.chunk[0][2:].any()
    chunks, mask = pc.slots()
    assert chunks[0].shape == (k, b, kv, s, d) and chunks[0].flags.c_contiguous and mask.shape == (b * s, k)
    assert mask[:, :2].all() and not mask[:, 2:].any()
    # a step's new K/V of every tensor in one copy (one array), or tensor by tensor (a list)
    stack = rng.standard_normal((len(pc.chunk), 1, b, kv, s, d)).astype(np.float32)
    pc.put(stack)
    for c, x in zip(pc.chunk, stack):
        np.testing.assert_array_equal(c[2], x[0])
    pc.advance()
    pc.put(list(stack * 2))
    np.testing.assert_array_equal(pc.chunk[1][3], 2 * stack[1][0])


def _on_device(dbs, model_dir):
    """`dbs` with its decode graph's cache on a device: DeviceOps("cpu"), the CUDA code path run by
    the CPU provider (no GPU in CI)."""
    from dbs_fast.kv.decoder import PrefixDecoder

    dbs.decoder = PrefixDecoder(Path(model_dir) / "decode.onnx", "cpu", kv_device="cpu")
    return dbs


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_the_cache_on_the_device_generates_the_same_text(kind, exported):
    """The cache as ORT tensors on a device (the CUDA path: gather, extension, merge, trim as ORT
    graphs on that device, the chunk slots bound by pointer) writes token for token what the NumPy
    cache writes: several requests, keep/repeat, a request joining a running batch (a merge)."""
    from dbs_fast import DBSConfig
    from dbs_fast.kv.device import DeviceArray

    host, dev = _dbs(exported[kind], "prefix"), _on_device(_dbs(exported[kind], "prefix"), exported[kind])
    assert dev.decoder.ops.device == "cpu" and host.decoder.ops.device is None
    reqs = [("It is", "colony,river"), ("The quick brown fox jumps over", "dog"), ("A", "mouth,speed,meet")]
    cfg = DBSConfig(beams=3, candidates=4, chunk=3, max_new_tokens=14, stop="max")
    a = host.generate_batch(reqs, seeds=[1, 2, 3], config=cfg)
    b = dev.generate_batch(reqs, seeds=[1, 2, 3], config=cfg)
    assert [r.generated for r in a] == [r.generated for r in b]
    np.testing.assert_allclose([r.perplexity for r in a], [r.perplexity for r in b], rtol=1e-4)
    texts = {}
    for dbs in (host, dev):                              # staggered: a request joins after two chunks
        batch = dbs.batch(cfg)
        batch.admit([dbs.request(*reqs[0], None, 1, cfg)])
        out = batch.decode_chunk() + batch.decode_chunk()
        batch.admit([dbs.request(*reqs[1], None, 2, cfg)])
        out += batch.decode_chunk()
        cache = batch.search.cache.cache                 # after the merge: still all on the device
        assert all(isinstance(t, DeviceArray) for t in cache.prefix + cache.chunk) == (dbs is dev)
        while batch.requests:
            out += batch.decode_chunk()
        texts[dbs is dev] = sorted(r.generated for _, r in out)
    assert texts[True] == texts[False]
    # a second-LM scorer (here the same export) keeps its cache on the device the same way
    from dbs_fast import DirectedBeamSearch
    from dbs_fast.kv.decoder import PrefixDecoder

    scored = {}
    for where in (None, "cpu"):
        dbs = DirectedBeamSearch(exported[kind], kv_layout="prefix", scorer=str(exported[kind]))
        dbs.scorer.decoder = PrefixDecoder(Path(exported[kind]) / "decode.onnx", "cpu", kv_device=where)
        scored[where] = dbs.generate_batch(reqs[:2], seeds=[1, 2], config=cfg)
        assert dbs.scorer.decoder.calls > 0                       # the scorer ran on that cache
    assert [r.generated for r in scored[None]] == [r.generated for r in scored["cpu"]]
    np.testing.assert_allclose([r.perplexity for r in scored[None]], [r.perplexity for r in scored["cpu"]], rtol=1e-4)


def test_a_step_on_the_device_moves_only_ids_masks_and_logits(decoders):
    """`host_bytes`: with the cache on the device a decode step binds from host memory the token
    ids, positions and masks, and takes the logits back; the NumPy cache takes its new K/V back
    too at each step (and binds its chunk and prefix once a chunk), which on a GPU would all be
    copied."""
    from dbs_fast.kv.decoder import PrefixDecoder

    ids = np.array([[11, 12, 13, 14, 15], [0, 0, 0, 21, 22]])
    mask = (ids > 0).astype(np.int64)
    s, k, moved, caches = 3, 3, {}, {}
    for where in (None, "cpu"):
        dec = PrefixDecoder(decoders["gpt2"], "cpu", kv_device=where)
        kv, d = next(i.shape for i in dec.session.get_inputs() if i.name == "prefix.0.key")[1::2]
        _, cache = dec.prefill(ids, mask, kv, d, s, k)
        steps = []
        for _ in range(k):
            logits = dec.step(np.full(2 * s, 7), cache)
            steps.append(dec.host_bytes)
        cache.keep([0, 4])
        dec.step(np.full(2 * s, 7), cache)
        moved[where], caches[where] = steps + [dec.host_bytes], cache
    N, T = 2 * s, caches["cpu"].mask.shape[1]           # (aligned widths)
    C = max(caches["cpu"].context_mask.shape[1], ids.shape[1])
    # ids, positions, new mask, slot_row, row_slot; the prefix and chunk masks; context blocks at most
    small = 8 * (5 * N + 2 * T + N * k + 2 * (C + s + 1))
    assert all(logits.nbytes <= m <= logits.nbytes + small for m in moved["cpu"]), (moved["cpu"], logits.nbytes, small)
    slot = 2 * dec.layers * 2 * kv * s * d * 4           # one chunk slot of every tensor (2 beams)
    assert moved[None][1] >= logits.nbytes + slot         # the NumPy cache: the new K/V
    prefixes = sum(p.nbytes for p in caches[None].prefix)
    assert moved[None][-1] >= logits.nbytes + prefixes    # and after a boundary, every prefix


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_device_ops_equal_their_numpy_references(dtype):
    """`DeviceOps` (the cache's operations as ORT graphs on a device; here the CPU provider) against
    NumPy and the host's Numba extension: extension of several tensors in one run, gather, concat,
    left padding, trim, zeros, a prefill's new slots appended as columns, and the views (leading
    slots, one slot) bound by pointer; float32 and
    an fp16 export's float16."""
    from dbs_fast.kv.device import DeviceOps
    from dbs_fast.kv.kv_copy import extend_prefix

    ops = DeviceOps("cpu", dtype=dtype)
    rng = np.random.default_rng(5)
    b, kv, T, d, K, s = 3, 2, 5, 4, 4, 2
    ps = [rng.standard_normal((b, kv, T, d)).astype(dtype) for _ in range(3)]
    cs = [rng.standard_normal((K, b, kv, s, d)).astype(dtype) for _ in range(3)]
    P, C = [ops.upload(p) for p in ps], [ops.upload(c) for c in cs]
    assert all(x.dtype == dtype and x.nbytes == x.size * np.dtype(dtype).itemsize for x in P)
    src, j = np.array([5, 0, 3, 3]), 3                     # rows; a repeat; more beams than before
    for lead, first in ((0, 0), (3, 0), (0, 2)):           # zero columns in front, the parent's first dropped
        for p, c, got in zip(ps, cs, ops.extend(P, C, src, s, j, lead, first)):
            want = np.empty((len(src), kv, lead + T - first + j, d), dtype)
            if dtype == np.float32:                        # the host's kernel
                extend_prefix(want, p, c, src, s, j, lead, first)
            else:
                want[:] = [np.concatenate([np.zeros((kv, lead, d), dtype), p[r // s][:, first:],
                                           c[:j, r // s, :, r % s].transpose(1, 0, 2)], 1) for r in src]
            np.testing.assert_array_equal(got.numpy(), want)
    p, c = ps[0], cs[0]
    np.testing.assert_array_equal(ops.take(P[0], [2, 2, 0]).numpy(), p[[2, 2, 0]])
    np.testing.assert_array_equal(ops.concat(P[0], P[1], 0).numpy(), np.concatenate([p, ps[1]], 0))
    np.testing.assert_array_equal(ops.concat(C[0], C[1], 1).numpy(), np.concatenate([c, cs[1]], 1))
    np.testing.assert_array_equal(ops.pad_cols(P[0], 2).numpy(), np.pad(p, [(0, 0), (0, 0), (2, 0), (0, 0)]))
    np.testing.assert_array_equal(ops.cols(P[0], 2).numpy(), p[:, :, 2:])
    np.testing.assert_array_equal(ops.zeros((2, 3)).numpy(), np.zeros((2, 3), dtype))
    np.testing.assert_array_equal(ops.at(C[0], 1, (1, b, kv, s, d)).numpy(), c[None, 1])
    # a prefill's L new slots (L, Q, kv, 1, d) as the context's next columns, on the device and the host
    from dbs_fast.kv.prefix_cache import HOST

    slots = c[:3, :, :, :1]                                 # (3, b, kv, 1, d)
    want = np.concatenate([p, slots[:, :, :, 0].transpose(1, 2, 0, 3)], axis=2)
    assert want.shape == (b, kv, T + 3, d) and np.array_equal(want[:, :, T + 1], slots[1, :, :, 0])
    np.testing.assert_array_equal(ops.append_slots(P[0], ops.upload(slots)).numpy(), want)
    np.testing.assert_array_equal(HOST.append_slots(p, slots), want)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_the_context_store_reuses_a_shared_prefix_to_the_bit(kind, decoders, exported, monkeypatch):
    """A context prefilled before, token for token, takes its K/V and logits and computes nothing;
    one that starts with one prefilled before takes that one's K/V for the whole slices they share
    and prefills the rest: logits and cache equal to the bit to the same prefill without a hit (the
    slices start where they would), and close to the full model; contexts of
    different lengths in one batch come out left-padded as the batched prefill's; the store stays
    within its bytes, dropping the least recently used."""
    from dbs_fast.kv import decoder as prefix
    from dbs_fast.kv.decoder import ContextStore, PrefixDecoder
    from dbs_fast.model import OnnxModel

    monkeypatch.setattr(prefix, "PREFILL_SLICE", 4)
    full = OnnxModel(exported[kind])
    dec, cold = PrefixDecoder(decoders[kind]), PrefixDecoder(decoders[kind])
    dec.store = ContextStore(10**9, granule=4)
    shared = list(range(30, 41))                                           # 11 tokens: two whole slices
    ctx = [shared + [50, 51, 52], shared[:9] + [60], list(range(70, 76))]
    T = max(map(len, ctx))
    ids = np.array([[0] * (T - len(c)) + c for c in ctx])
    mask = (ids > 0).astype(np.int64)
    kv = (full.kv_heads, full.head_dim)
    dec.prefill(ids[:1], mask[:1], *kv, s=2, k=3)                          # the first: a miss, stored
    assert (dec.store.hits, dec.store.lookups) == (0, 1) and len(dec.store.entries) == 1
    calls = dec.calls
    hot = dec.prefill(ids, mask, *kv, s=2, k=3)
    assert dec.store.hits == 2 and dec.store.reused_tokens == 14 + 8       # all 14 (stored whole), 2 slices of 10
    assert dec.calls - calls == 1 + 2                                     # none for the first; 1 + 2 slices of the rest
    again = dec.prefill(ids[2:], mask[2:], *kv, s=2, k=3)
    assert dec.calls - calls == 3 and dec.store.reused_tokens == 14 + 8 + 6   # the third, now whole in the store
    np.testing.assert_array_equal(again[0][0], hot[0][2])
    cold.store = ContextStore(10**9, granule=4)                            # the same, every context a miss
    ref = [cold.prefill(ids[i:i + 1], mask[i:i + 1], *kv, s=2, k=3) for i in range(3)]
    cold.store = None
    batched = cold.prefill(ids, mask, *kv, s=2, k=3)
    full_ref, _ = full.forward(ids, full.empty_cache(3), mask)
    for i, (lg, cache) in enumerate(ref):
        np.testing.assert_array_equal(hot[0][i], lg[0])
        for x, y in zip(hot[1].context, cache.context):                     # both left-padded to T
            np.testing.assert_array_equal(x[i:i + 1], y)
    np.testing.assert_allclose(hot[0], full_ref[:, -1], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(hot[0], batched[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(hot[1].context_mask, batched[1].context_mask)
    tok = np.arange(6) + 7
    np.testing.assert_allclose(dec.step(tok, hot[1]), cold.step(tok, batched[1]), rtol=1e-4, atol=1e-4)

    one = sum(p.nbytes for p in dec.store.entries[next(iter(dec.store.entries))][1])
    small = ContextStore(int(one * 1.5), granule=4)
    small.put(np.array(ctx[0]), dec.store.entries[next(iter(dec.store.entries))][1])
    small.put(np.array(ctx[0][:-1] + [99]), dec.store.entries[next(iter(dec.store.entries))][1])
    assert len(small.entries) == 1 and small.nbytes <= small.max_bytes     # the older one dropped
    assert small.lookup(np.array(ctx[0]))[0] == 12                          # 13 tokens shared -> 3 slices


def test_the_context_store_drops_what_a_new_context_makes_redundant_and_keeps_its_indexes():
    """A part of a context goes when a context that extends it is kept; the same whole context
    is replaced; a whole context that another extends stays (its logits are its own). The
    indexes that spare `put` and `peek` a scan over every entry agree with the entries, through
    evictions too."""
    from dbs_fast.kv.decoder import ContextStore

    def past(n):
        return [np.zeros((1, 1, n, 2), np.float32)]

    st = ContextStore(max_bytes=10 * 8 * 40, granule=4)
    st.put(np.arange(8), past(8))                                  # a part (prefilled ahead)
    st.put(np.arange(3), past(3), np.zeros(5, np.float32))         # a short whole context
    st.put(np.arange(12), past(12), np.zeros(5, np.float32))       # extends both
    kept = {tuple(t) for t, _, _ in st.entries.values()}
    assert kept == {tuple(range(3)), tuple(range(12))}              # the part went, the whole stayed
    st.put(np.arange(12), past(12), np.ones(5, np.float32))        # the same context again: replaced
    assert len(st.entries) == 2 and st.lookup(np.arange(12))[2][0] == 1.0
    assert st.peek(np.arange(20))[0] == 12                           # 3 whole slices of 4 shared
    for i in range(40):                                             # evictions: the oldest go
        st.put(np.arange(i, i + 6 + i % 5), past(6 + i % 5), None if i % 3 else np.zeros(5, np.float32))
    for key, (toks, _, lg) in st.entries.items():
        assert (key in st.parts) == (lg is None) and (key in st.long) == (len(toks) >= st.granule)
        assert lg is None or st.whole[toks.tobytes()] == key
    assert set(st.long) <= set(st.entries) and st.parts <= set(st.entries)
    assert set(st.whole.values()) == {k for k, (_, _, lg) in st.entries.items() if lg is not None}
    assert st.nbytes == sum(sum(p.nbytes for p in e[1]) + (0 if e[2] is None else e[2].nbytes)
                            for e in st.entries.values()) <= st.max_bytes


@pytest.mark.integration
@pytest.mark.parametrize("kind, family", [("qwen3", "llama"), ("phi3", "llama"), ("phi4", "llama"), ("opt", "opt"),
                                          ("gemma3", "gemma"), ("gemma2", "gemma"), ("neox", "neox"),
                                          ("smollm3", "llama")])
def test_a_family_exports_onto_the_shared_context_graph_and_generates(kind, family, tmp_path):
    """Qwen3 (the Llama layer with q/k norms), Phi-3 (fused q/k/v and gate/up), OPT (learned
    positions), Gemma 3 (norms around each block, q/k norms, local and global RoPE), Gemma 2
    (attention and final logit soft-capping), Phi-4-mini's half-head rotary and GPT-NeoX (per-head
    fused q/k/v, a partial rotary, parallel residual) and SmolLM3 (layers without RoPE) through `export`: its decode graph passes the export's
    parity check against model.onnx, decodes each row as the transformers model does over the
    whole sequence (two left-padded contexts, a chunk, a keep, another chunk), and generates."""
    from conftest import make_checkpoint

    from dbs_fast import DBSConfig, DirectedBeamSearch
    from dbs_fast.export.convert import export_model
    from dbs_fast.kv.decoder import PrefixDecoder

    ckpt = make_checkpoint(kind, tmp_path / kind)
    out = tmp_path / "onnx"
    export_model(str(ckpt), out, quiet=True)
    m = json.loads((out / "dbs_fast_model.json").read_text())
    assert m["model_type"] == {"gemma3": "gemma3_text", "phi4": "phi3", "neox": "gpt_neox"}.get(kind, kind) and m["prefix_decode"]["family"] == family, \
        m["prefix_decode"]
    _decodes_as_the_model_does(PrefixDecoder(out / "decode.onnx"), ckpt, m, s=3, keep=[4, 1], seed=0, tol=1e-3)
    r = DirectedBeamSearch(out).generate("It is", "river", config=DBSConfig(beams=2, candidates=2, max_new_tokens=8))
    assert r.new_tokens > 0
    if kind in ("gemma2", "gemma3"):    # its local layers' window (4) slides: a longer text runs on the graph
        assert m["prefix_decode"]["sliding_window"] == 4 and m["prefix_decode"]["window_masked"]
        long = DBSConfig(beams=2, candidates=2, max_new_tokens=12, stop="max")
        assert DirectedBeamSearch(out).generate("It is a", "river", config=long).new_tokens == 12


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["gpt2", "llama", "gemma3"])
def test_an_fp16_export_decodes_on_the_gathered_graph_as_the_model_does(kind, tmp_path):
    """`export --dtype fp16`: the decode graph with the gathered attention, checked in fp32 against
    model.onnx and then converted to float16 (its K/V float16, its logits float32); its cache goes
    through `DeviceOps` (here on the CPU provider), and each row decodes as the transformers model
    does over the whole sequence to fp16's precision, over a chunk, a keep and another chunk
    (Gemma 3's local layers with their window of 4 slid past); the export generates."""
    from conftest import make_checkpoint

    from dbs_fast import DBSConfig, DirectedBeamSearch
    from dbs_fast.export.convert import export_model
    from dbs_fast.kv.decoder import PrefixDecoder

    ckpt = make_checkpoint(kind, tmp_path / kind)
    out = tmp_path / "fp16"
    export_model(str(ckpt), out, quiet=True, dtype="fp16")
    pd = json.loads((out / "dbs_fast_model.json").read_text())["prefix_decode"]
    assert pd["written"] and pd["attention"] == "gathered" and pd["dtype"] == "float16", pd
    assert pd["float32"]["max_abs_logit_diff"] < 1e-3 and pd["top1_agreement"] == 1.0
    m = json.loads((out / "dbs_fast_model.json").read_text())
    dec = PrefixDecoder(out / "decode.onnx")
    assert dec.dtype == np.float16 and dec.ops.device == "cpu"
    _decodes_as_the_model_does(dec, ckpt, m, s=2, keep=[3, 0], seed=1, tol=2e-2, float32_logits=True)
    r = DirectedBeamSearch(out).generate("It is", "river", config=DBSConfig(beams=2, candidates=2, max_new_tokens=8))
    assert r.new_tokens > 0


@pytest.mark.integration
@pytest.mark.parametrize("kind, attention", [("llama", "gathered"), ("llama", "fused"), ("gpt2", "fused"),
                                             ("gemma3", "fused"), ("phi4", "fused"), ("neox", "fused"), ("opt", "fused"),
                                             ("gemma2", "fused")])
def test_export_attention_makes_an_fp32_graph_of_that_form(kind, attention, tmp_path):
    """`export --attention gathered|fused` in fp32: that form on the host cache (the fused one as
    one ONNX Attention node a layer, run by ONNX Runtime's own kernel), decoding each row as the
    transformers model does (to fp32's precision; Gemma 3's local window slid past); Gemma 2's
    soft-capped scores are written gathered, and the manifest says so; an unknown form is refused."""
    import onnx
    from conftest import make_checkpoint

    from dbs_fast.errors import DBSError
    from dbs_fast.export.convert import export_model
    from dbs_fast.kv.decoder import PrefixDecoder

    ckpt = make_checkpoint(kind, tmp_path / kind)
    with pytest.raises(DBSError, match="`attention` must be one of"):
        export_model(str(ckpt), tmp_path / "bad", quiet=True, attention="cascade")
    out = tmp_path / attention
    export_model(str(ckpt), out, quiet=True, attention=attention)
    m = json.loads((out / "dbs_fast_model.json").read_text())
    attention = "gathered" if kind == "gemma2" else attention
    assert m["prefix_decode"]["written"] and m["prefix_decode"]["attention"] == attention, m["prefix_decode"]
    graph = onnx.load(str(out / "decode.onnx"), load_external_data=False)
    ops = [n.op_type for n in graph.graph.node if n.domain in ("", "ai.onnx")]
    assert ops.count("Attention") == (m["num_layers"] if attention == "fused" else 0)
    assert ops.count("Softmax") == (0 if attention == "fused" else m["num_layers"])
    dec = PrefixDecoder(out / "decode.onnx")
    assert dec.dtype == np.float32 and dec.ops.device is None               # the host cache
    _decodes_as_the_model_does(dec, ckpt, m, s=2, keep=[3, 0], seed=1, tol=1e-3)


def _decodes_as_the_model_does(dec, ckpt, m, s: int, keep: list, seed: int, tol: float, float32_logits=False):
    """`dec` (a PrefixDecoder of an export of `ckpt`, manifest `m`) decodes each row as the
    transformers model does over the whole sequence, within `tol`: two left-padded contexts, s
    candidates each, a chunk of 3 random tokens, a keep of rows `keep`, another chunk."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    rng, k = np.random.default_rng(seed), 3
    ctx = np.array([[11, 12, 13, 14, 15], [0, 0, 0, 21, 22]])
    mask = np.array([[1, 1, 1, 1, 1], [0, 0, 0, 1, 1]])
    _, cache = dec.prefill(ctx, mask, m["num_kv_heads"], m["head_dim"], s, k)
    seqs = [[int(x) for x, mk in zip(ctx[r // s], mask[r // s]) if mk] for r in range(2 * s)]
    for chunk in range(2):
        for _ in range(k):
            tok = rng.integers(1, 200, len(seqs))
            logits = dec.step(tok, cache)
            if float32_logits:
                assert logits.dtype == np.float32
            for r, t in enumerate(tok):
                seqs[r].append(int(t))
            with torch.no_grad():
                for r, seq in enumerate(seqs):
                    ref = model(torch.tensor([seq])).logits[0, -1].numpy()
                    np.testing.assert_allclose(logits[r], ref, rtol=tol, atol=tol)
        cache.keep(keep)
        seqs = [list(seqs[keep[r // s]]) for r in range(2 * s)]
