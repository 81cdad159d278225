"""A GGUF file's quantized weights as they are, for the decode graph: each linear layer's blocks
become one `com.microsoft.MatMulNBits` (ONNX Runtime's block-quantized matmul, CPU and CUDA
kernels) instead of the fp32 copy transformers dequantizes.

llama.cpp's block types that MatMulNBits holds exactly, blocks of 32 along K:

    Q8_0   w = d * q,            q int8          -> 8-bit codes q + 128, scale d (zero point 128)
    Q4_0   w = d * (q - 8),      q in 0..15      -> 4-bit codes q, scale d (zero point 8)
    Q4_1   w = d * q + m,        q in 0..15      -> 4-bit codes q, scale d (zero point 8), and the
                                                    block's min m + 8 d as a term of its own

MatMulNBits takes integer zero points only on its fast path (a float zero point is exact but runs
a slow path), so Q4_1's mins are a term of their own: the activations summed per block of
32, times the mins, one small MatMul (K / 32 wide) added to the product. Other types stay fp32
(the manifest lists each tensor as stored and as run).

`quantized_linear` (`QuantizedLinear.apply`) traces as the fp32 product and exports as those nodes;
`quantize_linears` swaps a transformers model's linear layers for `QuantizedLinear` modules
holding their file's blocks, found by the GGUF names of the modules (gguf-py's name map) and
matched row by row to the model's own dequantized weights (transformers permutes Llama's q and k
rows; the blocks are permuted with them).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

# block type -> (bits of the codes MatMulNBits holds, bytes per block, weights per block)
TYPES = {"Q8_0": (8, 34, 32), "Q4_0": (4, 18, 32), "Q4_1": (4, 20, 32), "Q5_0": (8, 22, 32),
         "Q4_K": (4, 144, 256), "Q6_K": (8, 210, 256)}


class Blocks:
    """One weight (N, K) as MatMulNBits holds it: `codes` (N, K / B, B) uint8 (unpacked) in blocks
    of B = 32 or 16 along K, `scales` (N, K / B) float32, `mins` (N, K / B) float32 or None, `bits`
    4 or 8; the zero point is MatMulNBits' default, 2 ** (bits - 1)."""

    def __init__(self, codes, scales, mins, bits: int, qtype: str):
        self.codes, self.scales, self.mins, self.bits, self.qtype = codes, scales, mins, bits, qtype

    @property
    def block(self) -> int:
        return self.codes.shape[2]

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * self.block

    def dequantized(self) -> np.ndarray:
        """(N, K) float32: the NumPy reference of what MatMulNBits (and the min term) compute with."""
        zp = 1 << (self.bits - 1)
        w = self.scales[..., None] * (self.codes.astype(np.float32) - zp)
        if self.mins is not None:
            w = w + self.mins[..., None]
        return w.reshape(self.shape).astype(np.float32)

    def packed(self) -> np.ndarray:
        """(N, K / B, B * bits / 8) uint8: codes packed low-first along K, as MatMulNBits reads them."""
        if self.bits == 8:
            return np.ascontiguousarray(self.codes)
        return np.ascontiguousarray(self.codes[..., 0::2] | (self.codes[..., 1::2] << 4))

    def rows(self, order) -> "Blocks":
        return Blocks(self.codes[order], self.scales[order], None if self.mins is None else self.mins[order],
                      self.bits, self.qtype)

    @staticmethod
    def stack(parts: list["Blocks"]) -> "Blocks":
        """Several weights of the same K and type stacked along N (q, k and v as one)."""
        mins = [p.mins for p in parts]
        return Blocks(np.concatenate([p.codes for p in parts]), np.concatenate([p.scales for p in parts]),
                      None if mins[0] is None else np.concatenate(mins), parts[0].bits, parts[0].qtype)


def read_blocks(qtype: str, raw: np.ndarray) -> Blocks:
    """A GGUF tensor's raw rows (N, K / per block * bytes per block) uint8 of type `qtype` as
    `Blocks`, dequantizing to the same float32 as gguf-py (llama.cpp's layouts):

        Q8_0   w = d * q, q int8                   -> 8-bit codes q + 128, scale d
        Q4_0   w = d * (q - 8), q in 0..15         -> 4-bit codes q, scale d
        Q4_1   w = d * q + m                       -> 4-bit codes q, scale d, min m + 8 d
        Q5_0   w = d * (q - 16), q in 0..31        -> 8-bit codes q + 112, scale d
        Q4_K   w = d sc_j * q - dmin m_j, per 32   -> 4-bit codes q, scale d sc_j, min 8 d sc_j - dmin m_j
        Q6_K   w = d sc_j * (q - 32), per 16       -> 8-bit codes q + 96, scale d sc_j (blocks of 16)
    """
    bits, size, per = TYPES[qtype]
    N = raw.shape[0]
    r = np.ascontiguousarray(raw).reshape(-1, size)                   # one row per block of `per`

    def f16(b):
        return b.copy().view(np.float16)[:, 0].astype(np.float32)

    def nibbles(q, width):                                            # low nibbles of `width` bytes, then high
        q = q.reshape(len(q), -1, 1, width) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        return (q & 15).reshape(len(q), -1)

    mins = None
    if qtype == "Q8_0":
        codes, scales = (r[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8), f16(r[:, :2])
    elif qtype in ("Q4_0", "Q4_1"):
        d, qs = f16(r[:, :2]), r[:, 4:] if qtype == "Q4_1" else r[:, 2:]
        codes, scales = nibbles(qs, 16), d
        mins = None if qtype == "Q4_0" else f16(r[:, 2:4]) + 8 * d
    elif qtype == "Q5_0":
        high = (r[:, 2:6].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
        codes, scales = (nibbles(r[:, 6:], 16) | (high.astype(np.uint8) << 4)) + 112, f16(r[:, :2])
    elif qtype == "Q4_K":
        from gguf.quants import Q4_K

        sc, m = Q4_K.get_scale_min(r[:, 4:16])
        scales = (f16(r[:, :2])[:, None] * sc.astype(np.float32)).reshape(-1)
        mins = 8 * scales - (f16(r[:, 2:4])[:, None] * m.astype(np.float32)).reshape(-1)
        codes = nibbles(r[:, 16:], 32)
    else:                                                             # Q6_K
        low = nibbles(r[:, :128], 64).reshape(len(r), -1, 32)
        q = r[:, 128:192].reshape(len(r), -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        codes = (low | ((q & 3).reshape(len(r), -1, 32) << 4)) + 96
        scales = (f16(r[:, 208:210])[:, None] * r[:, 192:208].view(np.int8).astype(np.float32)).reshape(-1)
    block = 16 if qtype == "Q6_K" else 32
    shaped = (N, -1)
    return Blocks(np.ascontiguousarray(codes, np.uint8).reshape(N, -1, block), np.asarray(scales, np.float32).reshape(shaped),
                  None if mins is None else np.asarray(mins, np.float32).reshape(shaped), bits, qtype)


def gguf_tensors(path: Path) -> dict:
    """{GGUF tensor name without ".weight": (type name, raw rows)} of the file's tensors."""
    from gguf import GGUFReader

    return {t.name.removesuffix(".weight"): (t.tensor_type.name, t.data) for t in GGUFReader(str(path)).tensors}


def quantized_linear(x, weight, bias, blocks: Blocks, accuracy: int):
    """x (M, K) @ weight.T (+ bias), exported as MatMulNBits on `blocks` (+ the min term)."""
    import torch

    (N, K), B = blocks.shape, blocks.block
    packed, scales = torch.from_numpy(blocks.packed()), torch.from_numpy(blocks.scales.reshape(-1).copy())
    mins = None if blocks.mins is None else torch.from_numpy(np.ascontiguousarray(blocks.mins.T))  # (K/32, N)

    class NBits(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, w):
            return a @ w.T

        @staticmethod
        def symbolic(g, a, w):
            y = g.op("com.microsoft::MatMulNBits", a, g.op("Constant", value_t=packed),
                     g.op("Constant", value_t=scales), K_i=K, N_i=N, bits_i=blocks.bits, block_size_i=B,
                     accuracy_level_i=accuracy)
            if mins is not None:            # sum over each block of 32 activations, times the block's min
                # (a Reshape and a ReduceSum, then one Gemm adding the product y: as fast as a MatMul and an
                # Add, a node fewer; a MatMul on ones in place of the Reshape and the ReduceSum was slower)
                sums = g.op("ReduceSum", g.op("Reshape", a, g.op("Constant", value_t=torch.tensor([-1, K // B, B]))),
                            g.op("Constant", value_t=torch.tensor([2])), keepdims_i=0)
                y = g.op("Gemm", sums, g.op("Constant", value_t=mins), y)
            return y.setType(a.type().with_sizes([None, N]))

    y = NBits.apply(x, weight)
    return y if bias is None else y + bias


def quantized_embedding(ids, weight, blocks: Blocks):
    """The rows `ids` (n,) of weight (V, D), exported as GatherBlockQuantized on `blocks` (+ the
    rows' mins): exact, whatever the accuracy level, and the same constant as a tied head's
    MatMulNBits (`prefix_graph.share_constants` keeps one copy)."""
    import torch

    V, D = blocks.shape
    packed = torch.from_numpy(blocks.packed())                                      # (V, D / 32, 32 * bits / 8)
    scales = torch.from_numpy(np.ascontiguousarray(blocks.scales[..., None]))         # (V, D / 32, 1)
    mins = None if blocks.mins is None else torch.from_numpy(np.ascontiguousarray(blocks.mins[..., None]))

    class Rows(torch.autograd.Function):
        @staticmethod
        def forward(ctx, i, w):
            return torch.nn.functional.embedding(i, w)

        @staticmethod
        def symbolic(g, i, w):
            y = g.op("com.microsoft::GatherBlockQuantized", g.op("Constant", value_t=packed), i,
                     g.op("Constant", value_t=scales), gather_axis_i=0, quantize_axis_i=2, block_size_i=blocks.block,
                     bits_i=blocks.bits)                                             # (n, D / 32, 32)
            if mins is not None:
                y = g.op("Add", y, g.op("Gather", g.op("Constant", value_t=mins), i, axis_i=0))
            y = g.op("Reshape", y, g.op("Constant", value_t=torch.tensor([-1, D])))
            return y.setType(w.type().with_sizes([None, D]))

    return Rows.apply(ids, weight)


def _embedding_module():
    import torch

    class QuantizedEmbedding(torch.nn.Module):
        """An embedding that holds its GGUF blocks: traces as a lookup in the blocks dequantized,
        exports as `quantized_embedding`; Gemma 3's `embed_scale` is kept."""

        def __init__(self, blocks: Blocks, embed_scale=None):
            super().__init__()
            self.blocks = blocks
            self.weight = torch.nn.Parameter(torch.from_numpy(blocks.dequantized()), requires_grad=False)
            if embed_scale is not None:
                self.register_buffer("embed_scale", embed_scale.clone(), persistent=False)

        def forward(self, ids):
            shape = ids.shape
            y = quantized_embedding(ids.reshape(-1), self.weight, self.blocks).reshape(*shape, self.blocks.shape[1])
            return y * self.embed_scale.to(y.dtype) if hasattr(self, "embed_scale") else y

    return QuantizedEmbedding


def _linear_module():
    import torch

    class QuantizedLinear(torch.nn.Module):
        """A linear layer that holds its GGUF blocks: traces as x @ weight.T (+ bias), with the
        weight the blocks dequantized, and exports as `quantized_linear`."""

        def __init__(self, blocks: Blocks, bias, accuracy: int):
            super().__init__()
            self.blocks, self.accuracy = blocks, accuracy
            self.weight = torch.nn.Parameter(torch.from_numpy(blocks.dequantized()), requires_grad=False)
            self.bias = bias

        def forward(self, x):
            if x.dim() == 2:                # the decode graph's hidden states: (rows, D), no reshape
                return quantized_linear(x, self.weight, self.bias, self.blocks, self.accuracy)
            shape = x.shape
            y = quantized_linear(x.reshape(-1, shape[-1]), self.weight, self.bias, self.blocks, self.accuracy)
            return y.reshape(*shape[:-1], y.shape[-1])

    return QuantizedLinear


def _match_rows(have: np.ndarray, want: np.ndarray) -> np.ndarray | None:
    """The rows of `have` in the order of `want`'s rows (each row found by its bytes), or None where
    some row of `want` is not a row of `have`."""
    index = {row.tobytes(): i for i, row in enumerate(have)}
    order = [index.get(row.tobytes()) for row in want]
    return None if any(i is None for i in order) else np.array(order)


# the types kept as blocks, by accuracy level: 8-bit MatMulNBits (Q8_0, and Q5_0 and Q6_K in 8-bit
# containers) has no fast kernel at level 0 on the CPU (one 576 x 49,152 head, one row: 84 ms
# against fp32's 2.4 ms; at level 4, 0.7 ms: benchmarks/matmulnbits.py), so at level 0 they run
# dequantized
KEPT = {0: ("Q4_0", "Q4_1", "Q4_K"), 4: ("Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q5_0", "Q6_K")}
ACCURACY_LEVELS = tuple(KEPT)
ACCURACY = 4                # the default level
# an embedding's lookup is exact at any level (GatherBlockQuantized dequantizes the rows it takes)
GATHERED = tuple(TYPES)


# transformers' model types whose GGUF architecture is named otherwise
ARCH_NAMES = {"gemma3_text": "gemma3"}


def quantize_linears(model, gguf_path: Path, accuracy: int = 0) -> dict:
    """Swap `model`'s linear layers (attention projections, MLP, the head) for `QuantizedLinear`
    modules holding the GGUF file's blocks, where the file stores them in a type MatMulNBits holds
    at `accuracy` and their dequantized rows are the model's own, and its input embedding for a
    `QuantizedEmbedding` (on the head's blocks where the two are tied); returns {module: (GGUF
    name, type stored, type run)} for the manifest, every linear layer and the embedding listed."""
    import gguf
    import torch

    tensors = gguf_tensors(gguf_path)
    archs = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    arch = archs.get(ARCH_NAMES.get(model.config.model_type, model.config.model_type))
    if arch is None:
        return {}
    names = gguf.get_tensor_name_map(arch, model.config.num_hidden_layers)
    QuantizedLinear = _linear_module()
    report = {}
    embedding = model.get_input_embeddings()
    embed_name = next(n for n, m in model.named_modules() if m is embedding)
    tied = None                                               # the head, where it is the embeddings
    for name, module in list(model.named_modules()):
        if not isinstance(module, torch.nn.Linear):
            continue
        key = names.get_name(name)
        if name == "lm_head" and key not in tensors:
            key, tied = names.get_name(embed_name), name
        blocks, report[name] = _blocks_for(tensors, key, module.weight, KEPT[accuracy], "MatMulNBits")
        if blocks is not None:
            _swap(model, name, QuantizedLinear(blocks, module.bias, accuracy))
    key = names.get_name(embed_name)
    head = None if tied is None else getattr(model.get_submodule(tied), "blocks", False)
    if head is False:                                         # a tied head in fp32: one copy for both
        blocks, report[embed_name] = None, (key, tensors.get(key, (None,))[0], "float32 (tied to the head)")
    elif head is not None:                                    # the head's blocks, read and matched once
        blocks, report[embed_name] = head, (key, head.qtype, _run_as("GatherBlockQuantized", head))
    else:
        blocks, report[embed_name] = _blocks_for(tensors, key, embedding.weight, GATHERED, "GatherBlockQuantized")
    if blocks is not None:
        _swap(model, embed_name, _embedding_module()(blocks, getattr(embedding, "embed_scale", None)))
    return report


def _blocks_for(tensors: dict, key: str, weight, kept, kind: str) -> tuple:
    """(the file's blocks of `key` in the rows' order of `weight`, or None; the manifest's entry)."""
    qtype, raw = tensors.get(key, (None, None))
    if qtype not in kept:
        return None, (key, qtype, "float32")
    blocks = read_blocks(qtype, raw)
    order = _match_rows(blocks.dequantized(), weight.detach().float().numpy())
    if order is None:
        return None, (key, qtype, "float32 (rows differ from the model's)")
    return blocks.rows(order), (key, qtype, _run_as(kind, blocks))


def _run_as(kind: str, blocks: Blocks) -> str:
    """The manifest's "run" of a tensor kept as blocks."""
    return f"{kind} {blocks.bits}-bit" + (" + min term" if blocks.mins is not None else "")


def _swap(model, name: str, module) -> None:
    parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    setattr(parent, name.rpartition(".")[2], module)
