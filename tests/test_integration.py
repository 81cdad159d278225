"""The real embedded default (SmolLM2-135M-Instruct GGUF + GloVe 6B 50-d): export once, then
guidance must raise the success rate far above the unguided run."""
import json

import numpy as np
import pytest

pytest.importorskip("optimum.exporters.onnx")
pytestmark = pytest.mark.integration

SETS = [["enemy", "speed", "meet", "colony", "mouth"], ["river", "doctor", "garden"], ["music", "winter", "bread"]]


@pytest.fixture(scope="module")
def default_dir():
    from dbs_fast.api import resolve_model_dir

    return resolve_model_dir("default")      # exported into $DBS_FAST_HOME on first use


def test_default_export_manifest(default_dir):
    m = json.loads((default_dir / "dbs_fast_model.json").read_text())
    assert m["source"] == "default" and m["architecture"] == "LlamaForCausalLM"
    assert m["parity"]["passed"] and m["parity"]["max_abs_logit_diff"] < 1e-2
    assert m["vocab_size"] == 49152 and m["num_layers"] == 30
    # the GGUF file's blocks kept in the decode graph (`--weights gguf`, a GGUF file's default, at
    # accuracy level 4): the Q4_1 projections, the Q8_0 head and the embeddings on the head's blocks
    assert m["gguf_quantization"].startswith("MOSTLY_Q") and m["gguf_file"].endswith(".gguf")
    assert (default_dir / "decode.onnx").is_file() and (default_dir / "tokenizer.json").is_file()
    pd = m["prefix_decode"]
    assert pd["weights"]["stored_as_run"] == {"Q4_1 -> MatMulNBits 4-bit + min term": 210,
                                              "Q8_0 -> MatMulNBits 8-bit": 1, "Q8_0 -> GatherBlockQuantized 8-bit": 1}
    assert pd["weights"]["tensors"]["model.layers.0.self_attn.q_proj"]["gguf"] == "blk.0.attn_q"
    assert pd["mean_kl"] < 0.1 and pd["shared_bytes"] > 0


def test_guidance_beats_unguided_on_the_default(default_dir):
    from dbs_fast import DBSConfig, DirectedBeamSearch

    cfg = DBSConfig(beams=3, candidates=5, chunk=5, max_new_tokens=40)
    dbs = DirectedBeamSearch(default_dir, config=cfg)
    guided = dbs.generate_batch([("It is", k) for k in SETS], seeds=[0, 1, 2])
    plain = dbs.generate_batch([("It is", k) for k in SETS], seeds=[0, 1, 2],
                               config=DBSConfig(beams=1, candidates=1, max_new_tokens=40, guided=False))
    g = np.mean([r.success_rate for r in guided])
    p = np.mean([r.success_rate for r in plain])
    assert g >= 0.7 and g >= p + 0.5, (g, p)
    assert all(np.isfinite(r.perplexity) for r in guided)


def test_no_word_glued_onto_the_context_on_the_default(default_dir):
    """Token healing and the document-start token: the word at the context's end, as the model
    finished it, is a word the embeddings know ("The teach" -> "teacher"/"teaching", "The" never
    -> "TheBella"), for every seed of four contexts."""
    import re

    from dbs_fast import DBSConfig, DirectedBeamSearch
    from dbs_fast.text.embeddings import Embeddings

    glove = Embeddings.load("default")
    dbs = DirectedBeamSearch(default_dir, config=DBSConfig(beams=3, candidates=4, max_new_tokens=15))
    contexts = ["The", "It is", "Yesterday I", "The teach"]
    res = dbs.generate_batch([(c, "teacher,apple,lesson") for c in contexts for _ in range(3)], seeds=range(12))
    for r in res:
        start = len(r.context.rsplit(" ", 1)[0]) if " " in r.context else 0
        word = re.match(r"\s*([A-Za-z]+?)(?:n't)?\b", r.text[start:]).group(1)
        assert word.lower() in glove, (r.context, r.text)


LONG = ("The old man walked slowly down the long dusty road to the village market, where the traders had already "
        "set out their fruit, their bread and their cloth for the morning crowd to see")


def test_a_request_writes_the_same_text_in_a_batch_as_alone_on_the_default(default_dir):
    """On the 4-bit default (its matmuls quantize their activations to int8, so that a last-bit
    difference in the attention becomes another token), requests with short contexts (in their
    beams' prefixes) and a long one (a level of its own), batched together and joining a running
    batch, each write what they write alone: a batchmate's padding moves a row's columns by
    whole multiples of the kernels' lanes (`prefix_cache.ALIGN`)."""
    from dbs_fast import DBSConfig, DirectedBeamSearch

    cfg = DBSConfig(max_new_tokens=20)
    dbs = DirectedBeamSearch(default_dir, config=cfg)
    jobs = [("It is", "enemy,speed,meet"), ("A quiet morning", "river,bread"), (LONG, "colony,mouth")]
    alone = [dbs.generate(c, k, seed=i).generated for i, (c, k) in enumerate(jobs)]
    assert [r.generated for r in dbs.generate_batch(jobs, seeds=[0, 1, 2])] == alone
    batch = dbs.batch(cfg)
    reqs = [dbs.request(*jobs[i], None, i, cfg) for i in (0, 2)]
    batch.admit([reqs[0]])
    done = batch.decode_chunk()
    batch.admit([reqs[1]])                                  # joins after a chunk: a merge, padded
    while batch.requests:
        done += batch.decode_chunk()
    got = {id(r): res.generated for r, res in done}
    assert [got[id(reqs[0])], got[id(reqs[1])]] == [alone[0], alone[2]]
