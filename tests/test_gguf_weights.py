"""A GGUF file's blocks in the decode graph (`export/gguf_weights.py`): llama.cpp's block types read
as gguf-py dequantizes them, and MatMulNBits (and Q4_1's min term) computing the product ONNX
Runtime runs. The embedded default exported with its file's blocks: tests/test_export.py."""
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")


def _raw(qtype: str, N: int = 6, K: int = 96, seed: int = 0):
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32)
    return quantize(w, GGMLQuantizationType[qtype])


def _random_blocks(qtype: str, N: int = 4, K: int = 512, seed: int = 0):
    """Raw rows of `qtype` with random codes and scales (gguf-py quantizes no K-quant): any bytes
    are blocks, once their fp16 scales are finite."""
    from dbs_fast.export.gguf_weights import TYPES

    _, size, per = TYPES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (N, K // per * size)).astype(np.uint8)
    r = raw.reshape(-1, size)
    for at in {"Q4_K": (0, 2), "Q6_K": (208,), "Q4_1": (0, 2)}.get(qtype, (0,)):
        r[:, at:at + 2] = (rng.random(len(r)) * 0.01 + 1e-3).astype(np.float16)[:, None].view(np.uint8)
    return raw


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K"])
def test_every_block_type_reads_as_gguf_py_dequantizes_it_bit_for_bit(qtype):
    """`read_blocks` on random blocks of each type gives gguf-py's (and so transformers') float32
    weights exactly, so the rows match the model's by their bytes; Q6_K in blocks of 16."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from dbs_fast.export.gguf_weights import read_blocks

    raw = _random_blocks(qtype)
    b = read_blocks(qtype, raw)
    np.testing.assert_array_equal(b.dequantized(), dequantize(raw, GGMLQuantizationType[qtype]))
    assert b.block == (16 if qtype == "Q6_K" else 32) and b.shape == (4, 512)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_blocks_read_as_gguf_py_dequantizes_them(qtype):
    """`read_blocks` against gguf-py's own dequantization: codes, scales and the min term give the
    same weights; the packed codes hold two 4-bit codes a byte, low first along K."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from dbs_fast.export.gguf_weights import read_blocks

    raw = _raw(qtype)
    b = read_blocks(qtype, raw)
    np.testing.assert_allclose(b.dequantized(), dequantize(raw, GGMLQuantizationType[qtype]), rtol=0, atol=1e-6)
    assert b.shape == (6, 96) and (b.mins is not None) == (qtype == "Q4_1")
    packed = b.packed()
    if b.bits == 4:
        assert packed.shape == (6, 3, 16)
        np.testing.assert_array_equal(packed & 15, b.codes[..., 0::2])
        np.testing.assert_array_equal(packed >> 4, b.codes[..., 1::2])
    else:
        assert packed.shape == (6, 3, 32)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K"])
def test_a_quantized_linear_exports_as_matmulnbits_and_runs_the_product(qtype, tmp_path):
    """A linear layer holding its blocks, traced and exported: ONNX Runtime's MatMulNBits (plus, for
    Q4_1, the activations summed per block times the mins) computes x @ w.T of the dequantized
    weights, with stacked blocks (q, k and v as one) the same as each on its own."""
    import onnx
    import onnxruntime as ort

    from dbs_fast.export.gguf_weights import Blocks, quantized_linear, read_blocks

    parts = [read_blocks(qtype, _random_blocks(qtype, N=n, K=256, seed=n)) for n in (6, 4)]
    blocks = Blocks.stack(parts)
    w = torch.from_numpy(blocks.dequantized())

    class Layer(torch.nn.Module):
        def forward(self, x):
            return quantized_linear(x, w, None, blocks, 0)

    x = torch.randn(5, 256)
    path = tmp_path / "layer.onnx"
    torch.onnx.export(Layer(), (x,), str(path), input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "rows"}}, opset_version=17, dynamo=False)
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert "MatMulNBits" in ops and ("Gemm" in ops) == (qtype in ("Q4_1", "Q4_K"))     # the min term, added by a Gemm
    assert "Add" not in ops
    y = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0]
    ref = x.numpy() @ np.concatenate([p.dequantized() for p in parts]).T
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)



@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K"])
def test_a_quantized_embedding_exports_as_gather_block_quantized_and_takes_exact_rows(qtype, tmp_path):
    """An embedding holding its blocks, exported: GatherBlockQuantized (plus, for Q4_1, the rows'
    mins) gives exactly the dequantized rows asked for, repeated and in any order."""
    import onnx
    import onnxruntime as ort

    from dbs_fast.export.gguf_weights import quantized_embedding, read_blocks

    blocks = read_blocks(qtype, _random_blocks(qtype, N=10, K=256))
    w = torch.from_numpy(blocks.dequantized())

    class Lookup(torch.nn.Module):
        def forward(self, ids):
            return quantized_embedding(ids, w, blocks)

    ids = torch.tensor([7, 0, 9, 7])
    path = tmp_path / "embedding.onnx"
    torch.onnx.export(Lookup(), (ids,), str(path), input_names=["ids"], output_names=["y"],
                      dynamic_axes={"ids": {0: "n"}}, opset_version=17, dynamo=False)
    assert "GatherBlockQuantized" in [n.op_type for n in onnx.load(str(path)).graph.node]
    y = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"ids": ids.numpy()})[0]
    np.testing.assert_allclose(y, blocks.dequantized()[ids.numpy()], rtol=0, atol=1e-6)
