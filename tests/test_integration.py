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
