"""Engine v2's decode graph: each beam's prefix K/V stored once, each candidate's chunk on its own.

Today's graph takes one past per row, so the s candidates of a beam carry s copies of the same
prefix, gathered every chunk and re-copied (past + new -> present) every step. This graph takes

    input_ids, position_ids   (N, 1)          N = b * s rows, row r a candidate of beam r // s
    prefix_mask               (b, T)  int64   0 = left padding
    chunk_mask                (N, K)  int64   1 = a token of this chunk already decoded
    prefix.L.key/value        (b, kv_heads, T, head_dim)   shared by the s candidates of a beam
    chunk.L.key/value         (N, kv_heads, K, head_dim)   the row's own chunk so far

and returns `logits` (N, vocab) and only the new token's `new.L.key/value` (N, kv_heads, 1,
head_dim): the host writes those into its preallocated chunk buffer and appends the kept rows'
chunks to the prefixes once per chunk (`dbs_fast.prefix.PrefixCache`). Nothing per step copies
the prefix.

Attention of a decode step (Hydragen's decomposition): the s candidates of a beam and the g
query heads of a kv head are extra query rows of one batched matmul over the beam's prefix,
(b, kv, s*g, d) x (b, kv, d, T); the row's chunk and its own new key are scored separately;
one softmax over [prefix | chunk | self]; the weighted sums are added. RoPE (Llama family) is
applied before anything is cached, so cached keys are position-final, as in Hugging Face's
cache. Plain ONNX ops (MatMul, Softmax, ...), no contrib ops: `benchmarks/attention.py` measured
ORT's DecoderMaskedMultiHeadAttention (cache indirection) at 11.8x and MultiHeadAttention on the
row layout at 3.4x this attention's time, with 9.5x and 5x its cache (README, Speed).
"""
from __future__ import annotations

import math
from pathlib import Path

MASKED = -1e4     # additive bias of a masked key (finite, see export/fuse.py)
LLAMA_FAMILY = ("llama", "mistral", "qwen2")


def family(config) -> str:
    if config.model_type == "gpt2":
        return "gpt2"
    if config.model_type in LLAMA_FAMILY:
        return "llama"
    raise ValueError(f"no prefix-shared decode graph for model type {config.model_type!r} "
                     f"(supported: gpt2, {', '.join(LLAMA_FAMILY)})")


def attend(q, k, v, pk, pv, ck, cv, prefix_bias, chunk_bias, scale: float):
    """One decode step's attention. q (N, H, d); k, v (N, kv, d): the new token's; pk, pv
    (b, kv, T, d); ck, cv (N, kv, K, d); prefix_bias (b, T), chunk_bias (N, K) additive.
    Returns (N, H * d)."""
    import torch

    N, H, d = q.shape
    b, kv = pk.shape[0], pk.shape[1]
    g = H // kv
    qg = q.reshape(b, -1, kv, g, d).permute(0, 2, 1, 3, 4).reshape(b, kv, -1, d)        # (b, kv, s*g, d)
    sp = torch.matmul(qg, pk.transpose(2, 3)) * scale + prefix_bias[:, None, None, :]   # (b, kv, s*g, T)
    T = sp.shape[-1]
    sp = sp.reshape(b, kv, -1, g, T).permute(0, 2, 1, 3, 4).reshape(N, kv, g, T)
    qc = q.reshape(N, kv, g, d)
    sc = torch.matmul(qc, ck.transpose(2, 3)) * scale + chunk_bias[:, None, None, :]   # (N, kv, g, K)
    ss = (qc * k[:, :, None, :]).sum(-1, keepdim=True) * scale                          # (N, kv, g, 1)
    w = torch.softmax(torch.cat([sp, sc, ss], dim=-1), dim=-1)
    K = sc.shape[-1]
    wp = w[..., :T].reshape(b, -1, kv, g, T).permute(0, 2, 1, 3, 4).reshape(b, kv, -1, T)
    op = torch.matmul(wp, pv).reshape(b, kv, -1, g, d).permute(0, 2, 1, 3, 4).reshape(N, kv, g, d)
    oc = torch.matmul(w[..., T:T + K], cv)
    os_ = w[..., T + K:] * v[:, :, None, :]
    return (op + oc + os_).reshape(N, H * d)


def _decoder(model):
    import torch

    fam = family(model.config)

    class PrefixDecoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, position_ids, prefix_mask, chunk_mask, *kv):
            pbias = (1.0 - prefix_mask.to(torch.float32)) * MASKED
            cbias = (1.0 - chunk_mask.to(torch.float32)) * MASKED
            return (_gpt2 if fam == "gpt2" else _llama)(self.model, input_ids, position_ids, pbias, cbias, kv)

    return PrefixDecoder().eval()


def _llama(model, ids, pos, pbias, cbias, kv):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    m, cfg = model.model, model.config
    N = ids.shape[0]
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    h = m.embed_tokens(ids)                                            # (N, 1, D)
    cos, sin = m.rotary_emb(h, pos)
    new = []
    for i, layer in enumerate(m.layers):
        x = layer.input_layernorm(h)
        a = layer.self_attn
        q = a.q_proj(x).reshape(N, 1, H, d).transpose(1, 2)            # (N, H, 1, d)
        k = a.k_proj(x).reshape(N, 1, KV, d).transpose(1, 2)
        v = a.v_proj(x).reshape(N, KV, d)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k = k.reshape(N, KV, d)
        o = attend(q.reshape(N, H, d), k, v, *kv[4 * i:4 * i + 4], pbias, cbias, a.scaling)
        h = h + a.o_proj(o[:, None, :])
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        new += [k[:, :, None, :], v[:, :, None, :]]
    return (_logits(model, m.norm(h)), *new)


def _gpt2(model, ids, pos, pbias, cbias, kv):
    t, cfg = model.transformer, model.config
    N, H = ids.shape[0], cfg.n_head
    d = cfg.n_embd // H
    h = t.wte(ids) + t.wpe(pos)
    new = []
    for i, block in enumerate(t.h):
        q, k, v = block.attn.c_attn(block.ln_1(h)).split(cfg.n_embd, dim=2)
        q, k, v = (x.reshape(N, H, d) for x in (q, k, v))
        o = attend(q, k, v, *kv[4 * i:4 * i + 4], pbias, cbias, 1.0 / math.sqrt(d))
        h = h + block.attn.c_proj(o[:, None, :])
        h = h + block.mlp(block.ln_2(h))
        new += [k[:, :, None, :], v[:, :, None, :]]
    return (_logits(model, t.ln_f(h)), *new)


def _logits(model, h):
    """(N, vocab) from the last hidden states (N, 1, D)."""
    import torch

    head = model.lm_head
    return torch.nn.functional.linear(h[:, -1, :], head.weight, head.bias)


def share_tied_head(path: Path) -> int:
    """The exporter writes a head tied to the embeddings as MatMul on a transposed copy of them
    (113 MB more on the default, 257 MB on GPT-2 large): make it Gemm(transB=1) on the
    embeddings themselves. Returns the bytes saved (0: nothing tied). A graph over protobuf's
    2 GB (GPT-2 large: torch wrote one file per tensor) is saved with its weights in one
    external file, `<name>_data`, as model.onnx's are."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    g = onnx.load(str(path))
    inits = {i.name: i for i in g.graph.initializer}
    large = sum(len(t.raw_data) for t in inits.values()) > LARGE
    saved = 0
    big = {n: t for n, t in inits.items() if len(t.dims) == 2 and t.dims[0] * t.dims[1] >= 1 << 16}
    for k, node in enumerate(g.graph.node):
        if node.op_type != "MatMul" or node.input[1] not in big:
            continue
        w = numpy_helper.to_array(big[node.input[1]])
        same = [n for n, t in big.items() if n != node.input[1] and list(t.dims) == [w.shape[1], w.shape[0]]
                and np.array_equal(numpy_helper.to_array(t), w.T)]
        if not same:
            continue
        copy = node.input[1]
        g.graph.node[k].CopyFrom(helper.make_node("Gemm", [node.input[0], same[0]], list(node.output),
                                                  name=node.name or "tied_head", transB=1))
        if not any(copy in n.input for n in g.graph.node):
            g.graph.initializer.remove(big[copy])
        saved = w.nbytes
        break
    if saved or large:
        onnx.save(g, str(path), save_as_external_data=large, all_tensors_to_one_file=True,
                  location=path.name + "_data")
    return saved


LARGE = 1_800_000_000   # bytes of weights above which a graph keeps them in an external file


def io_names(num_layers: int) -> tuple[list[str], list[str]]:
    ins = ["input_ids", "position_ids", "prefix_mask", "chunk_mask"]
    outs = ["logits"]
    for i in range(num_layers):
        ins += [f"prefix.{i}.key", f"prefix.{i}.value", f"chunk.{i}.key", f"chunk.{i}.value"]
        outs += [f"new.{i}.key", f"new.{i}.value"]
    return ins, outs


def export_prefix_decoder(model, path: Path, opset: int = 17) -> dict:
    """Write the decode graph of `model` (a transformers causal LM, fp32, eval) to `path`."""
    import torch

    cfg = model.config
    dec = _decoder(model)
    L = cfg.num_hidden_layers
    H = cfg.num_attention_heads
    KV = getattr(cfg, "num_key_value_heads", None) or H
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    b, s, T, K = 2, 3, 5, 4
    N = b * s
    args = [torch.zeros(N, 1, dtype=torch.int64), torch.full((N, 1), T, dtype=torch.int64),
            torch.ones(b, T, dtype=torch.int64), torch.zeros(N, K, dtype=torch.int64)]
    for _ in range(L):
        args += [torch.zeros(b, KV, T, d), torch.zeros(b, KV, T, d), torch.zeros(N, KV, K, d), torch.zeros(N, KV, K, d)]
    ins, outs = io_names(L)
    axes = {"input_ids": {0: "rows"}, "position_ids": {0: "rows"}, "prefix_mask": {0: "beams", 1: "prefix"},
            "chunk_mask": {0: "rows", 1: "chunk"}, "logits": {0: "rows"}}
    for i in range(L):
        axes.update({f"prefix.{i}.key": {0: "beams", 2: "prefix"}, f"prefix.{i}.value": {0: "beams", 2: "prefix"},
                     f"chunk.{i}.key": {0: "rows", 2: "chunk"}, f"chunk.{i}.value": {0: "rows", 2: "chunk"},
                     f"new.{i}.key": {0: "rows"}, f"new.{i}.value": {0: "rows"}})
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        torch.onnx.export(dec, tuple(args), str(path), input_names=ins, output_names=outs, dynamic_axes=axes,
                          opset_version=opset, dynamo=False, do_constant_folding=True)
    saved = share_tied_head(path)
    return {"graph": path.name, "family": family(cfg), "layers": L, "opset": opset,
            "inputs": "input_ids, position_ids, prefix_mask, chunk_mask, prefix.L.key/value, chunk.L.key/value",
            "outputs": "logits, new.L.key/value", "tied_head_bytes_shared": saved}


def parity(model_dir: Path, s: int = 3, k: int = 3, seed: int = 0) -> dict:
    """decode.onnx against model.onnx of the same export: two left-padded contexts, 2 beams x s
    candidates, two chunks of k random tokens with a keep between them; max |logit diff|."""
    import numpy as np

    from dbs_fast.prefix import DECODE_GRAPH, PrefixCache, PrefixDecoder
    from dbs_fast.session import OnnxModel

    full, dec = OnnxModel(model_dir), PrefixDecoder(model_dir / DECODE_GRAPH)
    rng = np.random.default_rng(seed)
    V = full.vocab_size
    ctx, mask = rng.integers(1, V, (2, 4)), np.array([[1, 1, 1, 1], [0, 0, 1, 1]])
    _, past = full.forward(ctx, full.empty_cache(2), mask)
    pc, rows = PrefixCache.start(past.tensors, past.mask, s, k), past.repeat(s)
    diff, kls = 0.0, []
    for chunk in range(2):
        for _ in range(k):
            tok = rng.integers(1, V, 2 * s)
            ref, rows = full.forward(tok[:, None], rows)
            got = dec.step(tok, pc)
            diff = max(diff, float(np.abs(ref[:, 0] - got).max()))
            kls.append(_kl(ref[:, 0], got))
        keep = np.array([s + 1, 0])                       # the beams swap places
        pc.keep(keep)
        rows = rows.select(np.repeat(keep, s))
    return {"max_abs_logit_diff": diff, "mean_kl": float(np.mean(kls))}


def _kl(p_logits, q_logits) -> float:
    """Mean over rows of KL(p || q) of the next-token distributions, in nats."""
    import numpy as np

    lp = p_logits - np.logaddexp.reduce(p_logits, axis=-1, keepdims=True)
    lq = q_logits - np.logaddexp.reduce(q_logits, axis=-1, keepdims=True)
    return float((np.exp(lp) * (lp - lq)).sum(-1).mean())
