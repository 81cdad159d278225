"""Decode steps at bucket shapes with every input and output at a fixed address (the CUDA-graph
path, `dbs_fast/kv/buckets.py`), run here by the CPU provider: the same logits, new K/V and texts
as the dynamic step, buffers that never move, one session per bucket."""
from pathlib import Path

import numpy as np
import pytest

from dbs_fast.errors import DBSError
from dbs_fast.kv.buckets import (
    Buckets,
    control_flow,
    cuda_graph_providers,
    padded,
    round_up,
)

torch = pytest.importorskip("torch")


def _decoder(model_dir, buckets=None):
    from dbs_fast.kv.decoder import PrefixDecoder

    return PrefixDecoder(Path(model_dir) / "decode.onnx", "cpu", kv_device="cpu", buckets=buckets)


def test_sizes_round_up_to_their_bucket():
    b = Buckets(rows=4, prefix=8, context=16)
    cm, cb, pm, km = np.ones((2, 21)), np.zeros((2, 3)), np.ones((3, 9)), np.zeros((12, 5))
    assert b.dims(5, 12, cm, cb, pm, km, 4) == {"rows": 8, "new": 1, "slots": 12, "contexts": 2, "context": 32,
                                                 "blocks": 3, "beams": 3, "prefix": 16, "chunk": 5, "candidates": 4}
    assert b.dims(11, 12, np.ones((1, 1)), cb, pm, km, 4)["rows"] == 12      # never past the slots
    assert b.dims(11, 12, np.ones((1, 1)), cb, pm, km, 4)["context"] == 1    # a folded context stays one column
    assert Buckets().dims(3, 12, cm, cb, pm, km, 4)["rows"] == 12             # rows 0: every slot
    assert round_up(9, 8) == 16 and round_up(9, 0) == 9
    np.testing.assert_array_equal(padded(np.array([[1, 2]]), (2, 3), 7), [[1, 2, 7], [7, 7, 7]])
    for bad in ({"prefix": -1}, {"rows": -2}, {"sessions": 0}):
        with pytest.raises(DBSError, match="must be"):
            Buckets(**bad)


def test_the_cuda_graph_is_asked_of_the_provider_and_refused_where_it_cannot_run(exported, capsys):
    import onnx

    from dbs_fast.kv.buckets import StaticStep
    from dbs_fast.kv.device import DeviceOps

    assert cuda_graph_providers(1)[0] == ("CUDAExecutionProvider", {"device_id": "1", "enable_cuda_graph": "1"})
    split = onnx.load(str(Path(exported["llama"]) / "decode.onnx"), load_external_data=False)
    layers = sum(i.name.startswith("prefix.") for i in split.graph.input) // 2
    assert control_flow(split) == {"If": layers}          # the split form's context level: not capturable
    assert control_flow(onnx.helper.make_model(onnx.helper.make_graph([], "g", [], []))) == {}
    with pytest.raises(DBSError, match="CUDA graphs need the CUDA provider"):
        StaticStep(Path(exported["llama"]) / "decode.onnx", DeviceOps("cpu"), Buckets(), cuda_graph=True)
    with pytest.raises(DBSError, match="needs the CUDA provider"):
        from dbs_fast import DirectedBeamSearch

        DirectedBeamSearch(exported["llama"], cuda_graph=True)
    from dbs_fast.cli import main as cli
    from dbs_fast.serving.service import ServiceOptions

    assert cli(["generate", "--model", str(exported["llama"]), "--keywords", "river", "--cuda-graph"]) == 2
    assert "--cuda-graph needs the CUDA provider" in capsys.readouterr().err        # the door's word for it
    with pytest.raises(DBSError, match="`cuda_graph` needs `provider` cuda"):
        ServiceOptions(cuda_graph=True)
    with pytest.raises(DBSError, match="need the cache on a device"):
        from dbs_fast.kv.decoder import PrefixDecoder

        PrefixDecoder(Path(exported["llama"]) / "decode.onnx", "cpu", kv_device=None, buckets=Buckets())


def _steps(dec, ids, mask, s, k, rows_of=None):
    """Logits and the chunk's K/V after each step: a chunk, a keep, another chunk."""
    kv, d = next(i.shape for i in dec.session.get_inputs() if i.name == "prefix.0.key")[1::2]
    _, cache = dec.prefill(ids, mask, kv, d, s, k)
    rng, out = np.random.default_rng(0), []
    for keep in ([0, 2 * s - 1], None):
        for j in range(k):
            tok = rng.integers(1, 200, cache.chunk_mask.shape[0])
            rows = None
            if rows_of is not None:               # distinct rows: copies of one row share it
                uniq, slot_row = np.unique(tok, return_inverse=True)
                row_slot = np.array([int(np.argmax(tok == u)) for u in uniq])
                rows, tok = (slot_row.astype(np.int64), row_slot.astype(np.int64)), uniq
            logits = dec.step(tok, cache, rows=rows)
            out.append((logits[rows[0]] if rows else logits).copy())
            out.append(np.stack([c.numpy()[j] for c in cache.chunk[:4]]))
        if keep is not None:
            cache.keep(keep)
    return out, cache


@pytest.mark.parametrize("rows", [0, 2])
@pytest.mark.parametrize("context", [5, 40], ids=["context-in-prefixes", "context-level"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_bucketed_step_gives_the_dynamic_steps_logits_and_new_kv(kind, context, rows, exported):
    """Padded rows, masked prefix and context columns, the chunk adopted into the bucket's buffers
    and each step's new K/V written into its slot there: the logits and the chunk's K/V are the
    dynamic step's (to fp32's last bits: the softmax sums over more, masked, columns)."""
    rng = np.random.default_rng(1)
    ids = rng.integers(1, 200, (2, context))
    ids[1, :3] = 0                                   # left padding
    mask = (ids > 0).astype(np.int64)
    distinct = True if rows else None
    ref, _ = _steps(_decoder(exported[kind]), ids, mask, s=3, k=3, rows_of=distinct)
    dec = _decoder(exported[kind], Buckets(rows=rows, prefix=4, context=16))
    got, cache = _steps(dec, ids, mask, s=3, k=3, rows_of=distinct)
    for a, b in zip(ref, got):
        np.testing.assert_allclose(b, a, atol=2e-5, rtol=1e-5)
    st = dec.static
    assert {id(c) for c in cache.chunk} <= {id(x) for x in st._pool.values()}    # the bucket's own buffers
    assert dec.host_bytes == st.moved > 0


def test_buffers_never_move_and_a_bucket_binds_once_per_slot(exported):
    """Every buffer a bucket binds is allocated once and stays where it is across steps, chunks and
    generations; a bucket's IO bindings are made once per chunk slot (what a captured CUDA graph
    replays), and a generation at the same sizes makes no new session."""
    from dbs_fast import DBSConfig, DirectedBeamSearch

    dbs = DirectedBeamSearch(exported["llama"], kv_layout="prefix", context_cache_mb=0)
    dbs.decoder = _decoder(exported["llama"], Buckets(prefix=8))
    cfg = DBSConfig(beams=2, candidates=3, chunk=3, max_new_tokens=9, stop="max")
    dbs.generate("It is", "river", seed=1, config=cfg)
    st = dbs.decoder.static
    ptrs = {k: v.ptr for k, v in st._pool.items()}
    ios = {key: dict(b.ios) for key, b in st._sessions.items()}
    made = st.created
    assert made >= 2 and all(set(io) <= {0, 1, 2} for io in ios.values())
    assert st.captured == sum(len(io) for io in ios.values())
    dbs.generate("It is", "meet", seed=2, config=cfg)             # the same sizes: the same buckets
    assert st.created == made and {k: v.ptr for k, v in st._pool.items()} == ptrs
    assert all(b.ios[j] is ios[key][j] for key, b in st._sessions.items() for j in ios[key])
    assert st.setup_seconds > 0
    stats = st.stats()
    assert stats["sessions_created"] == made and stats["slot_graphs"] == st.captured and not stats["cuda_graph"]
    assert stats["buffer_bytes"] == sum(a.nbytes for a in st._pool.values()) > 0 and stats["shared_weight_bytes"] > 0


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_bucketed_steps_generate_the_same_text(kind, exported):
    """Generation with bucketed steps writes what the dynamic step writes on the same device cache:
    several requests, distinct rows, and a request joining a running batch (a merge, whose new
    chunk the bucket adopts)."""
    from dbs_fast import DBSConfig, DirectedBeamSearch

    reqs = [("It is", "colony,river"), ("The quick brown fox jumps over the lazy dog " * 4, "dog"),
            ("A", "mouth,speed,meet")]
    cfg = DBSConfig(beams=3, candidates=4, chunk=3, max_new_tokens=12, stop="max")
    texts = {}
    for buckets in (None, Buckets(rows=4, prefix=8, context=32), Buckets(prefix=16)):
        dbs = DirectedBeamSearch(exported[kind], kv_layout="prefix", context_cache_mb=0)
        dbs.decoder = _decoder(exported[kind], buckets)
        out = [r.generated for r in dbs.generate_batch(reqs, seeds=[1, 2, 3], config=cfg)]
        batch = dbs.batch(cfg)
        batch.admit([dbs.request(*reqs[0], None, 1, cfg)])
        done = batch.decode_chunk() + batch.decode_chunk()
        batch.admit([dbs.request(*reqs[2], None, 3, cfg)])
        while batch.requests:
            done += batch.decode_chunk()
        texts[buckets] = (out, sorted(r.generated for _, r in done))
        if buckets is not None:
            assert dbs.decoder.static.created >= 2
    first = texts.pop(None)
    assert all(t == first for t in texts.values())


def test_sessions_given_the_shared_weights_compute_what_the_file_does(exported):
    """`shared_weights` (one copy of the weights, given to every bucket's session and on the GPU to the
    decoder's own) in place of the file's: the same outputs."""
    from dbs_fast.export.timing import feeds
    from dbs_fast.kv.buckets import shared_weights
    from dbs_fast.runtime import make_session

    path = Path(exported["llama"]) / "decode.onnx"
    weights = shared_weights(path, "cpu")
    assert weights and all(v.device_name() == "cpu" for v in weights.values())
    plain, shared = make_session(path), make_session(path, initializers=weights)
    x = feeds(plain, 2, 3, 5)
    for a, b in zip(plain.run(None, x), shared.run(None, x)):
        np.testing.assert_array_equal(a, b)
