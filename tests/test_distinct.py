"""Distinct rows: the grouping against its loop reference, a distinct step against the plain one
on the exported tiny models, and the scheduler's texts and row counts with the distinct schedule
(the chunk's last token for the kept beams only) and the plain one."""
import numpy as np
import pytest
from naive import distinct_rows_ref

from dbs_fast.kv.groups import distinct_rows


def test_distinct_rows_equals_its_loop_reference():
    rng = np.random.default_rng(0)
    for _ in range(500):
        n = int(rng.integers(1, 40))
        group = rng.integers(-1, 5, n)
        ids = rng.integers(0, 4, n)
        need = (rng.random(n) < rng.random()) & (group >= 0)
        got = distinct_rows(group, ids, need)
        for a, b in zip(got, distinct_rows_ref(group, ids, need)):
            assert list(a) == list(b)
    with pytest.raises(ValueError, match="no history group"):
        distinct_rows(np.array([-1]), np.array([3]), np.array([True]))


def _dbs(model_dir, schedule):
    from dbs_fast import DirectedBeamSearch

    return DirectedBeamSearch(model_dir, kv_layout="prefix", schedule=schedule, context_cache_mb=0)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_distinct_step_gives_each_row_the_logits_of_the_plain_step(kind, exported):
    """Three steps of 2 beams x 4 candidates whose tokens repeat: the distinct step computes one
    model row per (history, token) among the rows that read logits, and gives every such row the
    logits the plain step gives it (up to the last bits: ONNX Runtime's kernels round a row
    differently at different positions of a batch)."""
    from dbs_fast.backend import PrefixBackend

    dbs = _dbs(exported[kind], "distinct")
    m, dec = dbs.backend.model, dbs.decoder
    assert dec.distinct
    toks = [np.array([5, 5, 6, 7, 9, 9, 9, 8]), np.array([3, 4, 4, 3, 2, 2, 1, 1]), np.array([7, 7, 7, 7, 6, 6, 6, 6])]
    need = np.array([1, 1, 1, 1, 1, 1, 0, 1], bool)      # row 6 ended: its logits are not read
    out = {}
    for distinct in (True, False):
        be = PrefixBackend(m, dec, 4, 3, 12, distinct=distinct)
        _, lay = be.prefill([[11, 12, 13], [21, 22]])
        lay = be.select(lay, np.array([0, 1]))                      # one beam per context
        lay = be.select(lay, np.repeat([0, 1], 4))                   # 4 copies of each
        steps = []
        for t in toks:
            logits, lay = be.step(t, lay, need)
            steps.append((np.array(logits), None if be.computed is None else be.computed.copy()))
        out[distinct] = steps
    for j, ((got, computed), (want, _)) in enumerate(zip(out[True], out[False])):
        np.testing.assert_allclose(got[need], want[need], rtol=1e-5, atol=1e-5)
        keys = {(r // 4, tuple(t[r] for t in toks[: j + 1])) for r in np.flatnonzero(need)}
        assert len(computed) == len(keys) and need[computed].all()
    assert [len(c) for _, c in out[True]] == [5, 6, 6]        # of the 7 rows that read logits


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_the_distinct_schedule_writes_the_plain_schedules_texts_with_fewer_rows(kind, exported):
    """A batch of requests, stopping at the budget and at a sentence, with the guarantee: the same
    texts both ways, and the distinct schedule's model rows below the plain one's row-steps, which
    the plain schedule computes exactly (one request alone). `top_p` near 0 makes every draw the
    top token, so that no draw sits within a rounding of two tokens' boundary."""
    from dbs_fast import DBSConfig

    arms = {s: _dbs(exported[kind], s) for s in ("distinct", "plain")}
    reqs = [("It is", "colony,river"), ("The quick brown fox jumps over", "dog"), ("A", "mouth,speed,meet")]
    for cfg in (DBSConfig(beams=3, candidates=4, chunk=3, max_new_tokens=14, stop="max", top_p=1e-6),
                DBSConfig(beams=2, candidates=3, chunk=4, max_new_tokens=16, order="any", guarantee=True,
                          top_p=1e-6, stop="sentence")):
        got = {s: dbs.generate_batch(reqs, seeds=[1, 2, 3], config=cfg) for s, dbs in arms.items()}
        assert [r.generated for r in got["distinct"]] == [r.generated for r in got["plain"]]
        for r in got["distinct"]:
            assert 0 < r.timings["model_rows"] < r.timings["plain_row_steps"]
        alone = arms["plain"].generate(*reqs[0], seed=1, config=cfg)
        assert alone.timings["model_rows"] == alone.timings["plain_row_steps"]


def test_requests_joining_and_leaving_a_running_batch_keep_their_texts(exported):
    """The service's way: requests join between chunks and leave when done; each one's text is
    the one it gets alone, on the distinct schedule."""
    from dbs_fast import DBSConfig

    dbs = _dbs(exported["llama"], "distinct")
    cfg = DBSConfig(beams=2, candidates=3, chunk=3, max_new_tokens=12, stop="max", top_p=1e-6)
    reqs = [("It is", "colony"), ("The quick brown fox", "dog,river"), ("A", "speed"), ("Once", "meet,mouth")]
    alone = [dbs.generate(c, k, seed=i, config=cfg).generated for i, (c, k) in enumerate(reqs)]
    batch = dbs.batch(cfg)
    batch.admit([dbs.request(*reqs[0], None, 0, cfg)])
    out = batch.decode_chunk()
    batch.admit([dbs.request(*reqs[1], None, 1, cfg), dbs.request(*reqs[2], None, 2, cfg)])
    out += batch.decode_chunk() + batch.decode_chunk()
    batch.admit([dbs.request(*reqs[3], None, 3, cfg)])
    while batch.requests:
        out += batch.decode_chunk()
    texts = {r.context: g.generated for r, g in out}
    assert [texts[c] for c, _ in reqs] == alone


def test_on_the_device_cache_the_distinct_schedule_writes_the_plain_schedules_texts(exported):
    """The CUDA path's cache (ORT tensors on a device, here the CPU provider): the distinct rows'
    new K/V written into every slot of their group by pointer, the same texts as the plain
    schedule, with fewer rows."""
    from test_prefix import _on_device

    from dbs_fast import DBSConfig

    cfg = DBSConfig(beams=3, candidates=4, chunk=3, max_new_tokens=14, stop="max", top_p=1e-6)
    reqs = [("It is", "colony,river"), ("A", "mouth,speed,meet")]
    got = {}
    for schedule in ("distinct", "plain"):
        dbs = _on_device(_dbs(exported["llama"], schedule), exported["llama"])
        assert dbs.decoder.ops.device == "cpu"
        got[schedule] = dbs.generate_batch(reqs, seeds=[1, 2], config=cfg)
    assert [r.generated for r in got["distinct"]] == [r.generated for r in got["plain"]]
    assert all(r.timings["model_rows"] < r.timings["plain_row_steps"] for r in got["distinct"])


def test_the_shipped_row_probe_is_what_its_writer_writes_and_it_answers():
    """`data/row_probe.onnx` is `export.probe.probe_bytes()` byte for byte (rewrite it with
    `python -m dbs_fast.export.probe`), and the probe runs on this machine's CPU provider."""
    pytest.importorskip("onnx")
    from importlib.resources import files

    from dbs_fast.export.probe import probe_bytes
    from dbs_fast.kv.decoder import lone_row_rounds_apart

    assert files("dbs_fast.data").joinpath("row_probe.onnx").read_bytes() == probe_bytes()
    assert lone_row_rounds_apart() in (True, False)

