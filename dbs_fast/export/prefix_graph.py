"""The decode graph: a request's context K/V stored once, each beam's generated prefix once, each
candidate's chunk on its own.

The row layout's graph (model.onnx) takes one past per row, so the b x s candidates of a request
carry b x s copies of its context, gathered every chunk and re-copied (past + new -> present)
every step. This graph takes three levels of cache:

    input_ids, position_ids   (n, L)          the n distinct rows computed (n <= N)
    slot_row                  (N,)    int64   N = b * s attention slots, slot r a candidate of beam r // s:
                                              the computed row whose history it holds
    row_slot                  (n,)    int64   for each computed row, one slot that holds it
    context_mask              (R, C)  int64   R contexts (one per request), 0 = left padding
    context_beams             (R, M)  int64   the beams of each context, M blocks (one repeated where fewer)
    beam_slot                 (b,)    int64   each beam's block among the R * M
    prefix_mask               (b, T)  int64   0 = left padding
    chunk_mask                (N, U)  int64   1 = a token of this chunk already decoded
    new_mask                  (n, L)  int64   0 = left padding among the new tokens
    context.L.key/value       (R, kv_heads, C, head_dim)   shared by every beam and candidate of a request
    prefix.L.key/value        (b, kv_heads, T, head_dim)   the tokens a beam generated, shared by its s candidates
    chunk.L.key/value         (U, b, kv_heads, s, head_dim)   each row's own chunk, slot-major: the
                                                              chunk's buffer of U = k slots, the
                                                              undecoded ones masked

and returns `logits` (n, vocab) of each computed row's last new token and only the new tokens'
`new.L.key/value` (L, b, kv_heads, s, head_dim), slot-major as the chunk is: with L = 1 that is one
slot of the chunk buffer (the host copies it there, or, with the cache on a device, binds the slot
as the output), and the chunk's keys and values join them in one Concat each, which ORT's matmuls
read as they lie, with no transpose of the new or the chunk's tensors; the kept
rows' chunks are appended to the prefixes once per chunk (`dbs_fast.kv.prefix_cache.PrefixCache`).
Nothing per step copies the context or the prefix, and a chunk's inputs are the same arrays at each
of its steps, bound once (binding 60 tensors a step was a tenth of a one-row step on the default).
A decode step has L = 1; a prefill runs a (left-padded) context as L new tokens per call over the columns before them as context.

Attention (Hydragen's decomposition, at two levels): all query rows of a request are rows of one
batched matmul over its context, and those of a beam (its s candidates, their L new tokens and
the g query heads of a kv head) of one over the beam's prefix; each row's queries are scored
against its own new keys (causal by position) and its own chunk slots; one softmax over
[context | prefix | chunk | new], the context entering it by its log-sum-exp (`attend`). RoPE
(Llama family) is applied before anything is cached, so cached keys are position-final, as in
Hugging Face's cache, by ORT's contrib `RotaryEmbedding` (CPU and CUDA kernels; `_rotary`). The
attention is plain ONNX ops (MatMul, Softmax, ...), no contrib ops: `benchmarks/attention.py`
measured ORT's DecoderMaskedMultiHeadAttention (cache indirection) at 11.8x and
MultiHeadAttention on the row layout at 3.4x this attention's time, with 9.5x and 5x its cache.

Distinct rows: candidates of a beam that drew the same tokens so far are the same sequence, with
the same logits and the same new K/V. The weight matmuls, norms and the head run once per
distinct row (n of them); only the attention runs on the N slots of the (b, s) layout, the
queries and new keys gathered to the slots by `slot_row` and its output back by `row_slot`.
Slots whose history no computed row holds (ended candidates, idle slots) take any row's values:
their logits are not read and their chunk K/V are never attended by a live row.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

from dbs_fast.kv.decoder import PrefixDecoder
from dbs_fast.kv.prefix_cache import DECODE_GRAPH
from dbs_fast.manifest import DECODE_GRAPH_REVISION
from dbs_fast.model import OnnxModel

MASKED = -1e4     # additive bias of a masked key (finite, see export/fuse.py)
LANES = 16        # float32 lanes of the widest vector unit (AVX-512): `attend` logs each row's number this wide
# the Llama layer, with options: qwen3 an RMSNorm on each head's q and k, phi3 fused q/k/v,
# smollm3 layers without RoPE
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", "phi3", "smollm3")
# norms around each block, q/k norms, local and global RoPE, logit soft-capping (Gemma 2)
GEMMA_FAMILY = ("gemma2", "gemma3_text")
# the decode graph's attention: "split" reads each request's context and each beam's prefix once
# (`attend`: the CPU's, and long contexts'); "gathered" gives each slot its own keys, about a third
# of the nodes (`attend_gathered`: the GPU's, where launches bound a step); "fused", the gathered
# form as one ONNX Attention node a layer (`attend_fused`, opset 23)
ATTENTIONS = ("split", "gathered", "fused")
FUSED_OPSET = 23    # ONNX's Attention operator (grouped KV heads, an additive mask, a past to append to)


def family(config) -> str:
    if config.model_type == "gpt2":
        return "gpt2"
    if config.model_type == "opt":
        if not getattr(config, "do_layer_norm_before", True) or \
                getattr(config, "word_embed_proj_dim", config.hidden_size) != config.hidden_size:
            raise ValueError("no prefix-shared decode graph for OPT with its norms after the blocks or a projected "
                             "embedding (OPT-350m)")
        return "opt"
    if config.model_type in GEMMA_FAMILY:
        return "gemma"
    if config.model_type in LLAMA_FAMILY:
        return "llama"
    if config.model_type == "gpt_neox":
        return "neox"
    raise ValueError(f"no prefix-shared decode graph for model type {config.model_type!r} "
                     f"(supported: gpt2, opt, gpt_neox, {', '.join(LLAMA_FAMILY + GEMMA_FAMILY)})")


class Dims(NamedTuple):
    """The sizes a layer's attention reshapes by. The export takes the dynamic ones (N, L, b, s, T,
    K, R, M, C, n) once from the graph's inputs and the static ones (H, kv, d) from the config, so that
    the shape arithmetic is one copy that every layer shares (ORT merges the identical nodes), not
    a Shape/Gather/Unsqueeze/Concat chain per layer and tensor: on the default, 2206 nodes per step
    after ORT's optimisations instead of 3619."""
    N: object
    L: object
    b: object
    s: object
    T: object
    K: object
    R: object      # contexts (requests)
    M: object      # query blocks per context: the most beams any one context has
    C: object      # context columns
    H: int
    kv: int
    d: int
    n: object = None  # distinct rows computed (the weight matmuls' rows); None: n = N


def block_biases(chunk_mask, seen, dims: Dims):
    """The additive biases of the beam-major attention, built once per step for all layers: chunk
    (b, 1, s*L*g, U), each query row against its own row's U chunk slots (`chunk_mask` (N, U), 1 =
    decoded), and new (b, 1, s*L*g, L), each query row against its own row's L new tokens
    (`seen` (N, L, L) bool: new query i sees new key j). Query rows are ordered (candidate, new
    token, query head of the kv head)."""
    L, b, s, H, kv = dims.L, dims.b, dims.s, dims.H, dims.kv
    g = H // kv
    sees_new = seen.reshape(b, s, L, 1, L).expand(b, s, L, g, L).reshape(b, 1, s * L * g, L)
    sees_chunk = (chunk_mask.reshape(b, s, 1, 1, -1) > 0).expand(b, s, L, g, chunk_mask.shape[1])

    return mask_bias(sees_chunk).reshape(b, 1, s * L * g, -1), mask_bias(sees_new)


def _context_level(qg, xk, xv, biases, cap, scale: float, dims: Dims):
    """`attend`'s context level: a request's query rows (gathered from the beams' `qg`) in M blocks,
    laid out block-major, (M, R, kv, s*L*g, d), so that the blocks' one batched matmul broadcasts
    over each request's one copy of the context (R, kv, C, d) with no head transpose of the queries
    or the results; per beam query row its normalised output (b, kv, s*L*g, d) and the log of its
    sum of exponentials (b, kv, s*L*g, 1)."""
    import torch

    N, L, b, s, T, U, R, M, C, H, kv, d, _ = dims
    qx = torch.index_select(qg, 0, biases.context_beams.t().reshape(-1)).reshape(M, R, kv, -1, d)
    sx = cap(torch.matmul(qx, xk.transpose(2, 3)) * scale) + biases.context                  # (M, R, kv, s*L*g, C)
    px = torch.softmax(sx, dim=-1)
    # log sum_j exp(sx_j) = sx_j - log(px_j) for any j; at the largest score px_j >= 1 / C. The log
    # of each row's one number is taken LANES times over, so that every row's log is a full
    # vector lane of the elementwise kernel: a row in the tensor's tail would take the kernel's
    # scalar path and round differently from the same row elsewhere in the batch.
    pmax = px.max(dim=-1, keepdim=True).values
    lse = sx.max(dim=-1, keepdim=True).values - torch.log(pmax * torch.ones(LANES))[..., :1]   # one Mul, no Shape
    ox = torch.cat([torch.matmul(px, xv), lse], dim=-1)                                  # (M, R, kv, s*L*g, d+1)
    # beam_slot numbers the blocks context-major (r * M + m): the same block block-major is m * R + r
    # (this index and the queries' gather index are the same nodes in every layer, which ORT merges)
    block = torch.remainder(biases.beam_slot, M) * R + torch.div(biases.beam_slot, M, rounding_mode="floor")
    out = torch.split(torch.index_select(ox.reshape(M * R, kv, -1, d + 1), 0, block), [d, 1], dim=-1)
    if biases.no_context is None:
        return out
    # a context of no tokens (every column masked: a short context the host keeps in the prefixes,
    # a prefill's first slice) gives no output and a log-mass of MASKED, whose weight in the beam's
    # softmax is exactly 0, as the context level's own is then: that level is skipped, and its
    # place is taken by the step's `no_context` pair, made once for all layers
    return if_context(out, biases.no_context, biases.any_context)


def no_context(chunk_bias, kv: int):
    """What a skipped context level gives every layer (`_context_level`), made once a step from the
    chunks' bias (b, 1, s*L*g, U): no output, a zero that broadcasts over the beam's (b, kv,
    s*L*g, d), and a log-mass of MASKED per query row (b, kv, s*L*g, 1), the column the beam's
    softmax reads."""
    import torch

    return torch.zeros(1, 1, 1, 1), (chunk_bias[..., :1] * 0 + MASKED).repeat(1, kv, 1, 1)


GRAPH_DOMAIN = "dbs_fast.graph"


def if_context(out: tuple, empty: tuple, any_context) -> tuple:
    """The tensors `out` where `any_context` (some context column is a token), else those of
    `empty`: exported as a marker that `context_ifs` makes an ONNX If, whose branches hold the
    nodes that only `out` and only `empty` need (the context level, and none), so that a step
    whose contexts are empty runs none of the level's nodes."""
    import torch

    k = len(out)

    class IfContext(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            return tuple(a.clone() for a in args[:k])

        @staticmethod
        def symbolic(g, *args):
            outs = g.op(f"{GRAPH_DOMAIN}::IfContext", *args, outputs=k)
            for o, a in zip(outs, args[:k]):
                o.setType(a.type())
            return outs

    return IfContext.apply(*out, *empty, any_context)


def context_ifs(g) -> int:
    """The ONNX model `g` with each `if_context` marker made an If node, in place: its then-branch
    the nodes whose outputs only the marker's first k inputs need (k: its outputs), its
    else-branch those of the next k, of the nodes that compute on the step's activations or K/V
    (the index arithmetic that every layer shares stays in the graph, where ORT merges it, and so
    does what a branch returns unchanged from the graph: the branch passes it on by an Identity).
    Returns the number of Ifs."""
    import collections
    import heapq

    from onnx import TensorProto, helper

    graph = g.graph
    nodes = list(graph.node)
    marks = [i for i, n in enumerate(nodes) if n.domain == GRAPH_DOMAIN]
    if not marks:
        return 0
    producer = {o: i for i, n in enumerate(nodes) for o in n.output}
    consumers = collections.defaultdict(set)
    for i, n in enumerate(nodes):
        for t in n.input:
            consumers[t].add(i)
    kept = {o.name for o in graph.output}
    heavy = {i.name for i in graph.input if i.name == "input_ids" or i.name.endswith((".key", ".value"))}
    for n in nodes:                                     # in topological order, as the exporter writes them
        if any(t in heavy for t in n.input):
            heavy.update(n.output)

    def cone(values, mark: int) -> set:
        # latest node first: a node's consumers come after it, so they are decided before it is
        own: set = set()
        todo = [-producer[v] for v in values if v in producer]
        heapq.heapify(todo)
        while todo:
            i = -heapq.heappop(todo)
            n = nodes[i]
            if i in own or kept & set(n.output) or not any(t in heavy for t in n.input) \
                    or not all(c in own or c == mark for o in n.output for c in consumers[o]):
                continue
            own.add(i)
            for t in n.input:
                if t in producer:
                    heapq.heappush(todo, -producer[t])
        return own

    moved, ifs = set(), {}
    for m in marks:
        mark = nodes[m]
        k = len(mark.output)
        branches = []
        for values, side in ((mark.input[:k], "then"), (mark.input[k:2 * k], "else")):
            own = cone(values, m)
            moved |= own
            body = [nodes[i] for i in sorted(own)]
            made = {o for n in body for o in n.output}
            outs = []
            for v in values:
                if v not in made:                   # a value of the graph's: ONNX returns it through a node
                    body.append(helper.make_node("Identity", [v], [f"{v}_{mark.output[0]}_{side}"]))
                    v = body[-1].output[0]
                outs.append(helper.make_tensor_value_info(v, TensorProto.FLOAT, None))
            branches.append(helper.make_graph(body, f"{mark.output[0]}_{side}", [], outs))
        ifs[m] = helper.make_node("If", [mark.input[2 * k]], list(mark.output), name=f"{mark.output[0]}_if",
                                  then_branch=branches[0], else_branch=branches[1])
    rest = [ifs.get(i, n) for i, n in enumerate(nodes) if i not in moved]
    del graph.node[:]
    graph.node.extend(rest)
    domains = [o for o in g.opset_import if o.domain != GRAPH_DOMAIN]
    del g.opset_import[:]
    g.opset_import.extend(domains)
    return len(ifs)


def attend(q, k, v, xk, xv, pk, pv, ck, cv, biases, scale: float, dims: Dims, softcap: float | None = None):
    """Attention of L new tokens per row, row r = candidate r % s of beam r // s, over three levels:
    its request's context, its beam's generated prefix and its own chunk (then its new tokens).
    q (N, L, H * d); k, v (N, L, kv * d) (or with the heads as an axis of their own): the new
    tokens'; xk, xv (R, kv, C, d): the contexts, one copy per request; pk, pv (b, kv, T, d): the
    beams' prefixes; ck, cv (U, b, kv, s, d): the chunks' U slots, slot-major; `biases` (`Biases`). Returns the output (N * L, H * d) and
    the new keys and values (L, b, kv, s, d): L chunk slots, slot-major.

    Every query of a request (its beams x s candidates x L new tokens x g query heads per kv head)
    is a row of one batched matmul against the request's context, (M, R, kv, s*L*g, d) x (R, kv, d,
    C) broadcast over the M blocks (Hydragen's decomposition, one level up): the beams' query rows
    are gathered into M blocks per context (`Biases.context_beams`; a context with fewer beams
    repeats one, whose extra rows are computed and dropped) and their results gathered back
    (`beam_slot`). Every query of a
    beam is a row of one matmul against the beam's prefix, (b, kv, s*L*g, d) x (b, kv, d, T); each
    row's L*g queries are scored against its own keys, its U chunk slots and its L new tokens side
    by side, in one batched matmul over the rows, (b, kv, s, L*g, d) x (b, kv, s, d, U+L), and
    weighs their values in another (not against the beam's s*K chunk columns and s*L new keys
    masked block-diagonal: there a row's own key sat at its candidate's column, so identical
    candidates summed their softmax in different orders and differed in the last bits, and most of
    the columns were masked; here every row's scores are laid out alike, and only its own U slots
    are read). The two parts are one softmax: the context's part enters the beam's softmax as
    one more key per query row, scored by the log-sum-exp of its scores, with its normalised output
    as the value (exactly the split-softmax merge, in one Softmax node), so no score tensor is
    transposed; only q and d + 1 numbers per query row are. The context level is one If a layer
    (`if_context`), taken where some context column is a token: the host keeps a short context in
    the beams' prefixes (`PrefixCache.start`), and its steps run none of the level's nodes.
    `softcap` (Gemma 2): scores become softcap * tanh(score / softcap) before the mask."""
    import torch

    if biases.gathered is not None:
        form = attend_fused if biases.fused else attend_gathered
        return form(q, k, v, xk, xv, pk, pv, ck, cv, biases, scale, dims, softcap)

    def cap(x):
        return x if softcap is None else torch.tanh(x / softcap) * softcap

    N, L, b, s, T, U, R, M, C, H, kv, d, _ = dims
    g = H // kv
    q6 = q.reshape(b, s, L, kv, g, d).permute(0, 3, 1, 2, 4, 5)                          # (b, kv, s, L, g, d)
    qg = q6.reshape(b, kv, -1, d)                                                        # (b, kv, s*L*g, d)
    kn, vn = (x.reshape(b, s, L, kv, d).permute(2, 0, 3, 1, 4) for x in (k, v))          # (L, b, kv, s, d)
    ov, lse = _context_level(qg, xk, xv, biases, cap, scale, dims)              # (b, kv, s*L*g, d), (..., 1)
    # the beam: its prefix, each row's chunk and new tokens; the context joins the softmax as one
    # more key whose score is its log-sum-exp and whose value is its normalised output
    # the scale right after the MatMul (ORT folds it into one FusedMatMul); the levels' biases are
    # one tensor of the step's (`Biases.joint`), added once to the softmax's joined scores
    sp = cap(torch.matmul(qg, pk.transpose(2, 3)) * scale)                               # (b, kv, s*L*g, T)
    kr, vr = (torch.cat([c, x]).permute(1, 2, 3, 0, 4) for c, x in ((ck, kn), (cv, vn)))     # (b, kv, s, U+L, d)
    sr = cap(torch.matmul(q6.reshape(b, kv, s, L * g, d), kr.transpose(3, 4)) * scale)   # (b, kv, s, L*g, U+L)
    w = torch.softmax(torch.cat([sp, sr.reshape(b, kv, s * L * g, U + L), lse], dim=-1) + biases.joint, dim=-1)
    wp, wr, wx = split_last(w, level_sizes(biases))
    orow = torch.matmul(wr.reshape(b, kv, s, L * g, U + L), vr).reshape(b, kv, s * L * g, d)
    o = sum_of(torch.matmul(wp, pv), orow, wx * ov)
    return o.reshape(b, kv, s, L, g, d).permute(0, 2, 3, 1, 4, 5).reshape(N * L, H * d), kn, vn


def attend_gathered(q, k, v, xk, xv, pk, pv, ck, cv, biases, scale: float, dims: Dims, softcap: float | None = None):
    """`attend` as one attention per slot over its own keys, [its context | its beam's prefix | its
    chunk | its new tokens], gathered and concatenated (`Biases.slot_context`, `slot_beam`): one
    score MatMul, one Add of the step's bias (`gathered_biases`), one Softmax, one MatMul, about 20
    nodes a layer where the split form takes about 70. The context and the prefix are copied to
    every slot at every layer (N x (C + T) keys where the split form reads one copy per request and
    beam): cheap on a GPU at short contexts, where launches and not bytes bound the step; the split
    form stays the CPU's and the long contexts' (docs/design/kv-cache.md). Same arguments and
    results as `attend`."""
    import torch

    N, L, b, s, T, U, R, M, C, H, kv, d, _ = dims
    g = H // kv
    qs = q.reshape(N, L, kv, g, d).permute(0, 2, 1, 3, 4).reshape(N, kv, L * g, d)    # (N, kv, L*g, d)
    k, v = (x.reshape(N, L, kv, d) for x in (k, v))

    def keys(x, p, c, new):                                                           # (N, kv, C+T+U+L, d)
        return torch.cat([*_slot_levels(x, p, c, biases, dims), new.permute(0, 2, 1, 3)], dim=2)

    scores = torch.matmul(qs, keys(xk, pk, ck, k).transpose(2, 3)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    o = torch.matmul(torch.softmax(scores + biases.gathered, dim=-1), keys(xv, pv, cv, v))  # (N, kv, L*g, d)
    o = o.reshape(N, kv, L, g, d)
    kn, vn = (x.reshape(b, s, L, kv, d).permute(2, 0, 3, 1, 4) for x in (k, v))      # (L, b, kv, s, d)
    return o.permute(0, 2, 1, 3, 4).reshape(N * L, H * d), kn, vn


def attend_fused(q, k, v, xk, xv, pk, pv, ck, cv, biases, scale: float, dims: Dims, softcap: float | None = None):
    """`attend_gathered` as one ONNX `Attention` node (opset 23): each slot's queries (N, L, H * d),
    as the projection and RoPE lay them out, against its past, [its context | its beam's prefix |
    its chunk] (N, kv, C+T+U, d), and its new keys (N, L, kv * d), which the operator appends; the
    kv heads grouped (`kv_num_heads`), the step's additive bias (N, 1, L, C+T+U+L) shared by the
    heads (`gathered_biases(..., fused=True)`). No score tensor, Softmax or head transpose in the
    graph: the operator's kernel (CPU and CUDA) does them. No `softcap`: soft-capped scores (Gemma
    2) are exported gathered (`written_form`). Same arguments and results as `attend`."""
    import torch

    N, L, b, s, T, U, R, M, C, H, kv, d, _ = dims
    q, k, v = (x if x.dim() == 3 else x.reshape(N, L, -1) for x in (q, k, v))

    past_k, past_v = (torch.cat(_slot_levels(x, p, c, biases, dims), dim=2) for x, p, c in ((xk, pk, ck), (xv, pv, cv)))
    o = _attention(q, k, v, biases.gathered, past_k, past_v, H, kv, scale)      # past: (N, kv, C+T+U, d)
    kn, vn = (x.reshape(b, s, L, kv, d).permute(2, 0, 3, 1, 4) for x in (k, v))      # (L, b, kv, s, d)
    return o.reshape(N * L, H * d), kn, vn


def _slot_levels(x, p, c, biases, dims: Dims) -> list:
    """Each slot's context (from the contexts x), its beam's prefix (from p) and its own chunk
    (from the slot-major c), (N, kv, ., d) each: the gathered and fused forms' keys or values."""
    import torch

    return [torch.index_select(x, 0, biases.slot_context), torch.index_select(p, 0, biases.slot_beam),
            c.permute(1, 3, 2, 0, 4).reshape(dims.N, dims.kv, -1, dims.d)]


def onnx_attention(q, k, v, bias, past_k, past_v, heads: int, kv_heads: int, scale: float):
    """ONNX's Attention (opset 23) as `attend_fused` calls it, in torch: q (N, L, heads * d), k, v
    (N, L, kv_heads * d) appended to the past (N, kv_heads, P, d), each kv head serving heads /
    kv_heads query heads, bias broadcast to (N, heads, L, P + L); (N, L, heads * d) out."""
    import torch

    N, L, _ = q.shape
    d = past_k.shape[-1]
    keys, values = (torch.cat([p, x.reshape(N, L, kv_heads, d).transpose(1, 2)], dim=2).repeat_interleave(
        heads // kv_heads, dim=1) for p, x in ((past_k, k), (past_v, v)))               # (N, heads, P+L, d)
    w = torch.softmax(torch.matmul(q.reshape(N, L, heads, d).transpose(1, 2), keys.transpose(2, 3)) * scale + bias, -1)
    return torch.matmul(w, values).transpose(1, 2).reshape(N, L, heads * d)


def _attention(*args):
    """`onnx_attention`, exported as one Attention node."""
    import torch

    class Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, bias, past_k, past_v, heads, kv_heads, scale):
            return onnx_attention(q, k, v, bias, past_k, past_v, heads, kv_heads, scale)

        @staticmethod
        def symbolic(g, q, k, v, bias, past_k, past_v, heads, kv_heads, scale):
            # written in a domain of its own and moved to ONNX's at opset 23 after the export
            # (`standard_attention`): the TorchScript exporter writes opsets up to 20. The two
            # presents (past + new) are outputs ORT's CPU kernel needs when a past is given.
            out, _, _ = g.op(f"{ATTENTION_DOMAIN}::Attention", q, k, v, bias, past_k, past_v, q_num_heads_i=heads,
                             kv_num_heads_i=kv_heads, scale_f=scale, outputs=3)
            return out.setType(q.type())

    return Attention.apply(*args)


ATTENTION_DOMAIN = "dbs_fast.attention"


def standard_attention(path: Path) -> None:
    """The graph at `path` with its `attend_fused` nodes in ONNX's own domain at opset
    `FUSED_OPSET` (the ops it has besides are the same there: from opset 18 on, none of them
    changed meaning)."""
    import onnx

    g = onnx.load(str(path))
    for node in g.graph.node:
        if node.domain == ATTENTION_DOMAIN:
            node.domain = ""
    kept = [o for o in g.opset_import if o.domain not in ("", "ai.onnx", ATTENTION_DOMAIN)]
    del g.opset_import[:]
    g.opset_import.extend([onnx.helper.make_opsetid("", FUSED_OPSET), *kept])
    save(g, path)


def written_form(attention: str, config) -> str:
    """The attention form a graph of `config` is written in when `attention` is asked: soft-capped
    scores (Gemma 2) are not fused (ORT's CUDA Attention kernel refuses a softcap), gathered instead."""
    return "gathered" if attention == "fused" and getattr(config, "attn_logit_softcapping", None) else attention


def gathered_biases(biases, seen, position_ids, context_mask, prefix_mask, chunk_mask, dims: Dims,
                    window: int | None = None, fused: bool = False):
    """`biases` with what `attend_gathered` takes, built once per step for all layers: each slot's
    context and beam, and the additive bias (N, 1, L*g, C+T+U+L) of its queries (ordered new
    token, query head of the kv head) over [context | prefix | chunk | new] keys: padding and
    undecoded chunk slots masked, new keys causal (`seen` (N, L, L), per slot), and with `window`
    keys at or before a query's position - window masked too (positions numbered as
    `window_biases` numbers them). `fused`: the bias (N, 1, L, C+T+U+L), one row per new token,
    shared by the query heads (`attend_fused`)."""
    import torch

    N, L, s, M, H, kv = dims.N, dims.L, dims.s, dims.M, dims.H, dims.kv
    g = H // kv
    slot_beam = torch.div(torch.arange(N), s, rounding_mode="floor")
    slot_context = torch.index_select(torch.div(biases.beam_slot, M, rounding_mode="floor"), 0, slot_beam)
    cm = torch.index_select(context_mask, 0, slot_context)                           # (N, C)
    pm = torch.index_select(prefix_mask, 0, slot_beam)                               # (N, T)
    old = torch.cat([cm, pm, chunk_mask], dim=1) > 0                                 # (N, C+T+U)
    sees = torch.cat([old[:, None, :].expand(N, L, old.shape[1]), seen], dim=2)      # (N, L, C+T+U+L)
    if window:
        slot_pos = position_ids if biases.slot_row is None else torch.index_select(position_ids, 0, biases.slot_row)
        n_ctx = cm.sum(-1, keepdim=True)                                             # (N, 1)
        n_pre = n_ctx + pm.sum(-1, keepdim=True)
        U = chunk_mask.shape[1]
        key_pos = torch.cat([torch.cumsum(cm, -1) - 1, n_ctx + torch.cumsum(pm, -1) - 1,
                             n_pre + torch.arange(U)[None], slot_pos], dim=1)        # (N, C+T+U+L)
        sees = sees & (key_pos[:, None, :] > slot_pos[:, :, None] - window)
    if fused:
        return biases._replace(slot_context=slot_context, slot_beam=slot_beam, gathered=mask_bias(sees)[:, None], fused=True)
    bias = mask_bias(sees)[:, None, :, None, :].expand(N, 1, L, g, sees.shape[2]).reshape(N, 1, L * g, -1)
    return biases._replace(slot_context=slot_context, slot_beam=slot_beam, gathered=bias)


def window_biases(biases, seen, position_ids, context_mask, prefix_mask, chunk_mask, dims: Dims, window: int):
    """`biases` for the layers that attend to the last `window` positions only (Gemma's local
    layers; Mistral's where set): a query at position p sees a key at position j when p - window
    < j <= p, at every level. Positions are counted as the host numbers them: a context column's
    is the real tokens before it, a prefix column's its context's length plus the beam's real
    tokens before it, chunk slot u's the context and prefix lengths plus u. `seen` (N, L, L): new
    query i sees new key j (causal); query rows ordered as in `block_biases`."""
    import torch

    b, s, L, H, kv, M = dims.b, dims.s, dims.L, dims.H, dims.kv, dims.M
    g = H // kv
    slot_pos = position_ids if biases.slot_row is None else torch.index_select(position_ids, 0, biases.slot_row)
    q = slot_pos.reshape(b, s, L, 1).expand(b, s, L, g).reshape(b, -1)               # (b, s*L*g) query positions
    far = q[:, :, None] - window                                                     # keys at or before it: out

    def out(bias, pos):                         # a beam's keys at positions `pos` (b, cols), out of the window
        return bias + (pos[:, None, :] <= far).to(torch.float32)[:, None] * MASKED

    n_ctx = context_mask.sum(-1)                                                     # (R,)
    beam_ctx = torch.index_select(n_ctx, 0, torch.div(biases.beam_slot, M, rounding_mode="floor"))   # (b,)
    ctx_pos = torch.cumsum(context_mask, -1) - 1                                     # (R, C)
    qx = torch.index_select(q, 0, biases.context_beams.t().reshape(-1)).reshape(M, context_mask.shape[0], 1, -1)  # (M, R, 1, s*L*g)
    context = biases.context + (ctx_pos[:, None, None, :] <= qx[..., None] - window).to(torch.float32) * MASKED
    pre_pos = beam_ctx[:, None] + torch.cumsum(prefix_mask, -1) - 1                 # (b, T)
    prefix = out(biases.prefix, pre_pos)
    U = chunk_mask.shape[1]
    c_pos = (beam_ctx + prefix_mask.sum(-1))[:, None] + torch.arange(U)[None]        # (b, U)
    chunk = out(biases.chunk, c_pos)
    near = seen & (slot_pos[:, None, :] > slot_pos[:, :, None] - window)             # (N, L, L)
    sees_new = near.reshape(b, s, L, 1, L).expand(b, s, L, g, L).reshape(b, 1, s * L * g, L)
    return biases._replace(context=context, prefix=prefix, chunk=chunk, new=mask_bias(sees_new))


class Biases(NamedTuple):
    """What a step's attention takes besides the tensors, built once for all layers: the additive
    biases of the context (R, 1, 1, C), the prefixes (b, 1, 1, T), the chunks and the new tokens
    (`block_biases`), and the gathers between beams and contexts: `context_beams` (R, M), the beam
    whose query rows fill each of a context's M blocks, and `beam_slot` (b,), each beam's block
    (r * M + m)."""
    context: object
    prefix: object
    chunk: object
    new: object
    context_beams: object
    beam_slot: object
    slot_row: object = None     # (N,) the computed row each attention slot takes (None: slot r = row r)
    row_token: object = None    # (n * L,) the slot token each computed row token's attention output comes from
    window: object = None       # the biases of the layers that slide a window (`window_biases`), or None
    # the gathered attention (`attend_gathered`): each slot's context (N,) and beam (N,), and the
    # additive bias (N, 1, L*g, C+T+U+L) of its queries over its keys; None: the split attention
    slot_context: object = None
    slot_beam: object = None
    gathered: object = None
    fused: bool = False         # the gathered attention as one Attention node (`attend_fused`)
    any_context: object = None  # () bool: some context column is a token (the split attention's context level runs)
    no_context: object = None   # what a skipped context level gives (`no_context`); None: the level always runs
    joint: object = None        # the split attention's bias over the beam's joined softmax (`joint_bias`)


def level_sizes(biases):
    """[T, U + L, 1] (int64): the columns of the split attention's one softmax that are the prefix's,
    the row's own chunk and new tokens', and the context's, read off the biases' last axes (the same
    nodes in every layer, which ORT merges into one)."""
    import torch
    from torch.onnx.operators import shape_as_tensor as shape

    return torch.cat([shape(biases.prefix)[-1:], shape(biases.chunk)[-1:] + shape(biases.new)[-1:],
                      torch.ones(1, dtype=torch.int64)])


def split_last(x, sizes):
    """torch.split(x, sizes, dim=-1), `sizes` a tensor of the step: one ONNX Split node per layer
    (the exporter writes a Slice per part where the sizes are dynamic)."""
    import torch

    parts = len(sizes)

    class SplitLast(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, sizes):
            return tuple(torch.split(x, sizes.tolist(), dim=-1))

        @staticmethod
        def symbolic(g, x, sizes):
            return g.op("Split", x, sizes, axis_i=-1, outputs=parts)

    return SplitLast.apply(x, sizes)


def sum_of(*xs):
    """xs[0] + xs[1] + ..., broadcast, as one ONNX Sum node (ORT adds the inputs in order, so the
    result is the chain of Adds' to the bit)."""
    import torch

    class SumOf(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            out = args[0]
            for a in args[1:]:
                out = out + a
            return out

        @staticmethod
        def symbolic(g, *args):
            return g.op("Sum", *args)

    return SumOf.apply(*xs)


def joint_bias(biases):
    """`biases` with the split attention's one bias over the beam's softmax (b, 1, s*L*g, T+U+L+1):
    the prefix's (broadcast over the query rows), the row's chunk and new tokens', and 0 for the
    context's column, built once per step and added once a layer to the joined scores."""
    import torch

    zero = biases.chunk[..., :1] * 0                                                  # (b, 1, s*L*g, 1)
    return biases._replace(joint=torch.cat([biases.prefix + zero, biases.chunk, biases.new, zero], dim=-1))


def layer_biases(biases, layer=None):
    """The biases of a layer: its window's where its attention slides one (`attention_type`
    "sliding_attention", or every layer of a model with a window and no layer types)."""
    if biases.window is None or getattr(layer, "attention_type", "sliding_attention") != "sliding_attention":
        return biases
    return biases.window


def to_slots(x, biases):
    """Per computed row (n, ...) -> per attention slot (N, ...)."""
    import torch

    return x if biases.slot_row is None else torch.index_select(x, 0, biases.slot_row)


def to_rows(x, biases):
    """Per attention slot's tokens (N * L, F), as `attend` returns them, -> per computed row's tokens
    (n * L, F), the output projection's input: one Gather (`Biases.row_token`)."""
    import torch

    return x if biases.row_token is None else torch.index_select(x, 0, biases.row_token)


def row_tokens(row_slot, L):
    """(n * L,) the slot token (slot * L + token) each computed row's token reads its attention
    output from, for the slots' (N * L, F) layout."""
    import torch

    return (row_slot[:, None] * L + torch.arange(L)[None, :]).reshape(-1)


def mask_bias(mask):
    """0 where `mask` is 1, MASKED where 0, as float32."""
    import torch

    return (1.0 - mask.to(torch.float32)) * MASKED


def _decoder(model, attention: str = "split"):
    import torch

    fam = family(model.config)
    heads = _heads(model.config)
    window = sliding_window(model.config)

    class PrefixDecoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, position_ids, slot_row, row_slot, context_mask, context_beams, beam_slot,
                    prefix_mask, chunk_mask, new_mask, *kv):
            # new key j is seen by new query i when it is a token (not padding) at or before i
            seen = (position_ids[:, None, :] <= position_ids[:, :, None]) & (new_mask[:, None, :] > 0)
            seen = torch.index_select(seen, 0, slot_row)
            dims = Dims(slot_row.shape[0], input_ids.shape[1], prefix_mask.shape[0], kv[4].shape[3],
                        prefix_mask.shape[1], chunk_mask.shape[1], *context_beams.shape, context_mask.shape[1], *heads,
                        input_ids.shape[0])
            row_token = row_tokens(row_slot, input_ids.shape[1])
            if attention != "split":
                biases = Biases(None, None, None, None, context_beams, beam_slot, slot_row, row_token)
                levels = (seen, position_ids, context_mask, prefix_mask, chunk_mask, dims)
                fused = attention == "fused"
                if window:
                    biases = biases._replace(window=gathered_biases(biases, *levels, window, fused=fused))
                return LAYERS[fam](self.model, input_ids, position_ids, gathered_biases(biases, *levels, fused=fused),
                                   kv, dims)
            chunk, new = block_biases(chunk_mask, seen, dims)
            biases = joint_bias(Biases(mask_bias(context_mask)[:, None, None, :], mask_bias(prefix_mask)[:, None, None, :],
                                       chunk, new, context_beams, beam_slot, slot_row, row_token,
                                       any_context=context_mask.max() > 0, no_context=no_context(chunk, dims.kv)))
            if window:
                biases = biases._replace(window=joint_bias(window_biases(biases, seen, position_ids, context_mask,
                                                                         prefix_mask, chunk_mask, dims, window)))
            return LAYERS[fam](self.model, input_ids, position_ids, biases, kv, dims)

    return PrefixDecoder().eval()


def _heads(cfg) -> tuple[int, int, int]:
    """(query heads, kv heads, head dim) of a transformers config."""
    H = cfg.num_attention_heads
    return H, getattr(cfg, "num_key_value_heads", None) or H, getattr(cfg, "head_dim", None) or cfg.hidden_size // H


# The hidden states are (N * L, D) throughout, so every weight matmul is one 2-D Gemm/MatMul with
# no reshape around it; only the attention sees (N, L, heads, d).
def _llama(model, ids, pos, biases, kv, dims):
    m = model.model
    H, KV, d = dims.H, dims.kv, dims.d
    h = m.embed_tokens(ids.reshape(-1))                                # (n * L, D)
    rope = _rotary(model, h, to_slots(pos, biases), dims._replace(n=dims.N))   # q and k are the slots'
    new = []
    x = norm(m.layers[0].input_layernorm, h)
    for i, layer in enumerate(m.layers):
        a = layer.self_attn
        q, k, v = _qkv(a, x, dims, biases)
        turn = rope if getattr(a, "use_rope", True) else lambda y, heads: y       # SmolLM3: NoPE
        q = turn(_head_norm(a, "q_norm", q, H, d), H)                  # (N, L, H * d)
        k = turn(_head_norm(a, "k_norm", k, KV, d), KV)                # (N, L, KV * d)
        o, kn, vn = attend(q, k, v, *kv[6 * i:6 * i + 6], layer_biases(biases, layer),
                           a.scaling, dims)
        x, h = skip_norm(layer.post_attention_layernorm, a.o_proj(to_rows(o, biases)), h)
        after = m.layers[i + 1].input_layernorm if i + 1 < len(m.layers) else m.norm
        x, h = skip_norm(after, _mlp(layer.mlp, x), h)                 # the next layer's input, or the head's
        new += [kn, vn]                                                # (L, b, KV, s, d)
    return (_logits(model, x, dims), *new)


def _qkv(attn, x, dims: Dims, biases):
    """The attention slots' q (N, L, H * d), k and v (N, L, KV * d) from the computed rows' x: one
    projection on the three weights packed (Phi-3's own `qkv_proj`), taken to the slots and split:
    one MatMul, one Reshape, one Gather and one Split where three of each were."""
    sizes = [dims.H * dims.d, dims.kv * dims.d, dims.kv * dims.d]
    y = attn.qkv_proj(x) if hasattr(attn, "qkv_proj") else _packed(x, (attn.q_proj, attn.k_proj, attn.v_proj))
    return to_slots(y.reshape(dims.n, dims.L, -1), biases).split(sizes, dim=-1)


def _mlp(mlp, x):
    """A gated MLP, down(act(gate(x)) * up(x)), with gate and up as one projection and a Split (Phi-3's
    own `gate_up_proj` as it is); other MLPs as their module runs them."""
    if not (hasattr(mlp, "gate_proj") and hasattr(mlp, "up_proj") and hasattr(mlp, "act_fn")):
        return mlp(x)
    gate, up = _packed(x, (mlp.gate_proj, mlp.up_proj)).split(mlp.up_proj.weight.shape[0], dim=-1)
    return mlp.down_proj(mlp.act_fn(gate) * up)


def _packed(x, projs):
    """x through the linear layers `projs` (the same input) as one projection, their outputs side by
    side: one MatMul on the weights stacked, or one MatMulNBits on a GGUF's blocks stacked where
    each layer holds blocks of one form (`export/gguf_weights.py`), or each on its own where their
    forms differ (Gemma's Q4_K_M file mixes types within a layer)."""
    import torch

    blocks = [getattr(p, "blocks", None) for p in projs]
    if all(q is not None for q in blocks) and len({(q.bits, q.block, q.mins is None) for q in blocks}) > 1:
        return torch.cat([p(x) for p in projs], dim=-1)
    w = torch.cat([p.weight for p in projs])
    b = None if projs[0].bias is None else torch.cat([p.bias for p in projs])
    if all(q is not None for q in blocks):
        from .gguf_weights import Blocks, quantized_linear

        return quantized_linear(x, w, b, Blocks.stack(blocks), projs[0].accuracy)
    return torch.nn.functional.linear(x, w, b)


def _head_norm(attn, name: str, y, heads: int, d: int):
    """`y` (n * L, heads * d) with the layer's per-head norm `name` (Qwen3's q_norm / k_norm: an
    RMSNorm over each head's d, before RoPE) where it has one, else as it is."""
    module = getattr(attn, name, None)
    return y if module is None else norm(module, y.reshape(-1, heads, d)).reshape(y.shape)


def _gamma(norm):
    """(scale, eps, bias) of a norm module: an RMSNorm's (Llama's weight, Gemma's 1 + weight; bias
    None) or a LayerNorm's."""
    import torch

    eps = float(getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", 1e-6))
    w = norm.weight.detach()
    if type(norm).__name__.startswith("Gemma"):
        w = 1.0 + w.float()
    if not isinstance(norm, torch.nn.LayerNorm):
        return w, eps, None
    return w, eps, torch.zeros_like(w) if norm.bias is None else norm.bias.detach()


def _normed(h, w, eps, bias):
    """The norm's math (fp32), as ORT's ops compute it: RMSNorm without a bias, LayerNorm with one."""
    import torch

    if bias is None:
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w
    return torch.nn.functional.layer_norm(h, (h.shape[-1],), w, bias, eps)


def norm(module, x):
    """`module` (an RMSNorm or a LayerNorm) on `x` over its last axis, as one node: ONNX's
    SimplifiedLayerNormalization (ORT's) or LayerNormalization, not the Pow/ReduceMean/Sqrt/Div/Mul
    chain with float casts that the module's own code exports (which an fp16 graph keeps in fp32)."""
    import torch

    w, eps, bias = _gamma(module)

    class Norm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y, gamma, beta):
            return _normed(y, gamma, eps, beta)

        @staticmethod
        def symbolic(g, y, gamma, beta):
            if bias is None:
                out = g.op("SimplifiedLayerNormalization", y, gamma, epsilon_f=eps, axis_i=-1, stash_type_i=1)
            else:
                out = g.op("LayerNormalization", y, gamma, beta, epsilon_f=eps, axis_i=-1)
            return out.setType(y.type())

    return Norm.apply(x, w, bias)


def skip_norm(module, x, skip):
    """(module(skip + x), skip + x): a residual add and the norm after it as one node, ORT's
    SkipSimplifiedLayerNormalization or SkipLayerNormalization (its fourth output is the sum)."""
    import torch

    w, eps, bias = _gamma(module)

    class SkipNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y, r, gamma, beta):
            h = r + y
            return _normed(h, gamma, eps, beta), h

        @staticmethod
        def symbolic(g, y, r, gamma, beta):
            if bias is None:
                out, _, _, h = g.op("com.microsoft::SkipSimplifiedLayerNormalization", y, r, gamma, epsilon_f=eps,
                                    outputs=4)
            else:
                out, _, _, h = g.op("com.microsoft::SkipLayerNormalization", y, r, gamma, beta, epsilon_f=eps,
                                    outputs=4)
            return out.setType(y.type()), h.setType(y.type())

    return SkipNorm.apply(x, skip, w, bias)


def _rope(x, cos, sin, d: int):
    """Hugging Face's rotary embedding (rotate_half) with the half width a constant."""
    import torch

    half = d // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


# Rotary types whose angles depend on the position only (not on the sequence length), so that
# one (max_positions, d/2) table holds them all.
STATIC_ROPE = ("default", "linear", "llama3")


def rotary_module(model):
    """The model's rotary embedding module (the global one where there are two)."""
    return model.gpt_neox.rotary_emb if hasattr(model, "gpt_neox") else model.model.rotary_emb


def rope_kind(model, emb=None) -> str:
    """How the decode graph applies RoPE: 'contrib' (one com.microsoft.RotaryEmbedding per tensor,
    angles from a table) for the static rotary types over the whole head, else 'elementwise'
    (other types, and a rotary over part of each head: Phi-4-mini, GPT-NeoX)."""
    emb = rotary_module(model) if emb is None else emb
    whole = 2 * emb.inv_freq.shape[-1] == _heads(model.config)[2]
    return "contrib" if whole and getattr(emb, "rope_type", "default") in STATIC_ROPE else "elementwise"


def _rotary(model, h, pos, dims: Dims, emb=None):
    """A function of (y, heads): y (n, L, heads * d) with RoPE applied at `pos` (n, L), the rows'
    or the attention slots' positions (dims.n: their number); (n, L, heads * d) out, or
    (n, L, heads, d) for the elementwise form. For the static rotary types it exports as one
    `com.microsoft.RotaryEmbedding` per tensor, which looks the angles up in a table of positions
    0..max(pos), instead of 7 elementwise nodes per tensor (Slice, Slice, Neg,
    Concat, Mul, Mul, Add): the default's step runs 1877 nodes instead of 2206. On the CPU the
    step time is unchanged (A/B 0.99-1.01 at 4 and 70 rows); where every node is a kernel launch
    (CUDA) fewer nodes are fewer launches. Other rotary types keep the plain form; PyTorch runs
    the same math either way."""
    import torch

    N, L, d = dims.n, dims.L, dims.d
    emb = rotary_module(model) if emb is None else emb                # Gemma's local layers: their own
    if rope_kind(model, emb) != "contrib":
        cos, sin = emb(h, pos)                                         # (n, L, r), attention scaling applied
        r = 2 * emb.inv_freq.shape[-1]                                 # r < d: the rest of each head passes

        def partial(y, heads):
            y = y.reshape(N, L, heads, d)
            out = _rope(y[..., :r], cos[:, :, None], sin[:, :, None], r)
            return out if r == d else torch.cat([out, y[..., r:]], dim=-1)

        return partial
    # the angles of positions 0..max(pos) computed in the graph, not a (max_positions, d/2) table
    # stored in it (Gemma 3's four: 67 MB); the same float32 product as transformers' rotary module
    angles = torch.arange(pos.max() + 1)[:, None].float() * emb.inv_freq.float()[None, :]
    scaling = float(getattr(emb, "attention_scaling", 1.0))
    tc, ts = angles.cos() * scaling, angles.sin() * scaling

    class Rotary(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y, p, table_cos, table_sin, heads):        # y (N, L, heads * d); p (N, L)
            n, l = p.shape
            cos, sin = (torch.cat([t[p]] * 2, dim=-1)[:, :, None] for t in (table_cos, table_sin))
            return _rope(y.reshape(n, l, heads, -1), cos, sin, d).reshape(n, l, -1)

        @staticmethod
        def symbolic(g, y, p, table_cos, table_sin, heads):
            out = g.op("com.microsoft::RotaryEmbedding", y, p, table_cos, table_sin, num_heads_i=heads,
                       interleaved_i=0)
            return out.setType(y.type())                     # same shape and type as y (no exporter warning)

    # (n, L, heads * d) in and out: `attend` takes the heads as they are laid out, no Reshape either side
    return lambda y, heads: Rotary.apply(y, pos, tc, ts, heads)


def _gpt2(model, ids, pos, biases, kv, dims):
    import torch

    t = model.transformer
    n, L, H, d = dims.n, dims.L, dims.H, dims.d
    D = H * d
    h = t.wte(ids.reshape(-1)) + t.wpe(pos.reshape(-1))               # (n * L, D)
    conv = lambda c, x: torch.addmm(c.bias, x, c.weight)               # noqa: E731  (Conv1D without its reshapes)
    new = []
    x = norm(t.h[0].ln_1, h)
    for i, block in enumerate(t.h):
        q, k, v = (to_slots(y.reshape(n, L, H, d), biases) for y in conv(block.attn.c_attn, x).split(D, dim=1))
        o, kn, vn = attend(q, k, v, *kv[6 * i:6 * i + 6], biases, 1.0 / math.sqrt(d), dims)
        x, h = skip_norm(block.ln_2, conv(block.attn.c_proj, to_rows(o, biases)), h)
        mlp = block.mlp
        x, h = skip_norm(t.h[i + 1].ln_1 if i + 1 < len(t.h) else t.ln_f, conv(mlp.c_proj, mlp.act(conv(mlp.c_fc, x))), h)
        new += [kn, vn]                                                # (L, b, H, s, d)
    return (_logits(model, x, dims), *new)


def _opt(model, ids, pos, biases, kv, dims):
    """OPT (pre-norm, learned positions offset by 2, ReLU MLP, biased projections)."""
    import torch

    m = model.model.decoder
    n, L, H, d = dims.n, dims.L, dims.H, dims.d
    pe = m.embed_positions
    h = m.embed_tokens(ids.reshape(-1)) + torch.nn.functional.embedding(pos.reshape(-1) + pe.offset, pe.weight)
    new = []
    for i, layer in enumerate(m.layers):
        a, x = layer.self_attn, layer.self_attn_layer_norm(h)
        q, k, v = (to_slots(p(x).reshape(n, L, H, d), biases) for p in (a.q_proj, a.k_proj, a.v_proj))
        o, kn, vn = attend(q, k, v, *kv[6 * i:6 * i + 6], biases, a.scaling, dims)
        h = h + a.out_proj(to_rows(o, biases))
        h = h + layer.fc2(layer.activation_fn(layer.fc1(layer.final_layer_norm(h))))
        new += [kn, vn]
    if m.final_layer_norm is not None:
        h = m.final_layer_norm(h)
    return (_logits(model, h, dims), *new)


def _gemma(model, ids, pos, biases, kv, dims):
    """Gemma 2 and 3: embeddings scaled by sqrt(D) (Gemma 3 in `embed_tokens`), norms before and after
    each block, Gemma 3's q/k norms, RoPE of a local base on the sliding-window layers (Gemma 3),
    attention and final logit soft-capping (Gemma 2); the local layers attend within their window
    (`window_biases`)."""
    import torch

    m, cfg = model.model, model.config
    H, KV, d = dims.H, dims.kv, dims.d
    h = m.embed_tokens(ids.reshape(-1))                                # (n * L, D)
    if not hasattr(m.embed_tokens, "embed_scale"):                     # Gemma 2 scales after the lookup
        h = h * torch.tensor(cfg.hidden_size ** 0.5, dtype=h.dtype)
    slot_pos, slots = to_slots(pos, biases), dims._replace(n=dims.N)   # q and k are the slots'
    ropes = {"full_attention": _rotary(model, h, slot_pos, slots)}
    local = getattr(m, "rotary_emb_local", None)
    ropes["sliding_attention"] = ropes["full_attention"] if local is None else _rotary(model, h, slot_pos, slots, local)
    new = []
    x = norm(m.layers[0].input_layernorm, h)
    for i, layer in enumerate(m.layers):
        a = layer.self_attn
        q, k, v = _qkv(a, x, dims, biases)
        rope = ropes[getattr(layer, "attention_type", "full_attention")]
        q = rope(_head_norm(a, "q_norm", q, H, d), H)
        k = rope(_head_norm(a, "k_norm", k, KV, d), KV)
        o, kn, vn = attend(q, k, v, *kv[6 * i:6 * i + 6],
                           layer_biases(biases, layer), a.scaling, dims,
                           softcap=getattr(cfg, "attn_logit_softcapping", None))
        o = norm(layer.post_attention_layernorm, a.o_proj(to_rows(o, biases)))
        x, h = skip_norm(layer.pre_feedforward_layernorm, o, h)
        after = m.layers[i + 1].input_layernorm if i + 1 < len(m.layers) else m.norm
        x, h = skip_norm(after, norm(layer.post_feedforward_layernorm, _mlp(layer.mlp, x)), h)
        new += [kn, vn]
    logits = _logits(model, x, dims)
    cap = getattr(cfg, "final_logit_softcapping", None)
    return (logits if cap is None else torch.tanh(logits / cap) * cap, *new)


def _neox(model, ids, pos, biases, kv, dims):
    """GPT-NeoX (Pythia): q/k/v fused per head, a rotary over part of each head, the attention and
    the MLP side by side on the same input (parallel residual) or one after the other."""
    t = model.gpt_neox
    n, L, H, d = dims.n, dims.L, dims.H, dims.d
    h = t.embed_in(ids.reshape(-1))                                    # (n * L, D)
    rope = _rotary(model, h, pos, dims)
    new = []
    for i, layer in enumerate(t.layers):
        a = layer.attention
        q, k, v = a.query_key_value(layer.input_layernorm(h)).reshape(-1, H, 3 * d).chunk(3, dim=-1)
        q, k = (rope(t.reshape(n, L, H * d), H) for t in (q, k))      # (n, L, H * d) or (n, L, H, d)
        o, kn, vn = attend(*(to_slots(x, biases) for x in (q, k, v.reshape(n, L, H, d))), *kv[6 * i:6 * i + 6],
                           biases, a.scaling, dims)
        o = a.dense(to_rows(o, biases))
        if layer.use_parallel_residual:
            h = h + o + layer.mlp(layer.post_attention_layernorm(h))
        else:
            h = h + o
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        new += [kn, vn]
    return (_logits(model, t.final_layer_norm(h), dims), *new)


LAYERS = {"gpt2": _gpt2, "llama": _llama, "opt": _opt, "gemma": _gemma, "neox": _neox}


def sliding_window(config) -> int | None:
    """The attention window of a model whose layers attend to the last W tokens only (Gemma 2/3's
    local layers, Mistral's and Phi-3's where set), or None."""
    w = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    return int(w) if w and (types is None or "sliding_attention" in types) else None


def _logits(model, h, dims):
    """(n, vocab) from the hidden states (n * L, D): the last new token's."""
    import torch

    head = model.embed_out if hasattr(model, "gpt_neox") else model.lm_head
    last = h.reshape(dims.n, dims.L, -1)[:, -1, :]
    if hasattr(head, "blocks"):                                        # a GGUF's blocks (export/gguf_weights.py)
        return head(last)
    return torch.nn.functional.linear(last, head.weight, head.bias)


def written_once(path: Path) -> int:
    """The decode graph at `path` with its context levels in Ifs (`context_ifs`) and its weights
    written once (`share_tied_head`, `share_constants`), loaded and saved once; returns the bytes
    saved. A graph over protobuf's 2 GB (GPT-2 large: torch wrote one file per tensor) is saved with
    its weights in one external file, `<name>_data`, as model.onnx's are."""
    import onnx

    g = onnx.load(str(path))
    ifs = context_ifs(g)
    saved = share_tied_head(g) + share_constants(g)
    if ifs or saved or sum(len(t.raw_data) for t in g.graph.initializer) > LARGE:
        save(g, path)
    return saved


def share_tied_head(g) -> int:
    """The exporter writes a head tied to the embeddings as MatMul on a transposed copy of them
    (113 MB more on the default, 257 MB on GPT-2 large): make the graph `g` use Gemm(transB=1) on
    the embeddings themselves. Returns the bytes saved (0: nothing tied)."""
    import numpy as np
    from onnx import helper, numpy_helper

    inits = {i.name: i for i in g.graph.initializer}
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
    return saved


def share_constants(g, least: int = 1024) -> int:
    """The graph `g` with each large constant written once: constants of the same type and bytes
    (a tied head's MatMulNBits and the embedding's GatherBlockQuantized on the same blocks and
    scales) become one, read through a Reshape where their shapes differ. Returns the bytes
    saved."""
    import hashlib

    import numpy as np
    from onnx import helper, numpy_helper

    first, repeats = {}, []
    for node in g.graph.node:
        if node.op_type != "Constant" or not node.attribute or not node.attribute[0].t.raw_data:
            continue
        t = node.attribute[0].t
        if len(t.raw_data) < least:
            continue
        key = (t.data_type, hashlib.sha1(t.raw_data).hexdigest())
        if key in first:
            repeats.append((node, first[key]))
        else:
            first[key] = node
    if not repeats:
        return 0
    rename = {}
    for node, kept in repeats:
        dims = list(node.attribute[0].t.dims)
        if dims == list(kept.attribute[0].t.dims):
            rename[node.output[0]] = kept.output[0]
            g.graph.node.remove(node)
            continue
        at = list(g.graph.node).index(node)
        shape = node.output[0] + "_shape"
        g.graph.node.remove(node)
        g.graph.node.insert(at, helper.make_node("Reshape", [kept.output[0], shape], [node.output[0]]))
        g.graph.node.insert(at, helper.make_node("Constant", [], [shape],
                                                 value=numpy_helper.from_array(np.array(dims, np.int64))))
    for node in g.graph.node:
        for k, name in enumerate(node.input):
            if name in rename:
                node.input[k] = rename[name]
    return sum(len(n.attribute[0].t.raw_data) for n, _ in repeats)


LARGE = 1_800_000_000   # bytes of weights above which a graph keeps them in an external file


def save(g, path: Path) -> None:
    """Write the ONNX model `g` to `path`, its weights in one external file `<name>_data` when they
    are over `LARGE` (protobuf's 2 GB limit), as model.onnx's are."""
    import onnx

    large = sum(len(t.raw_data) for t in g.graph.initializer) > LARGE
    onnx.save(g, str(path), save_as_external_data=large, all_tensors_to_one_file=True, location=path.name + "_data")


def io_names(num_layers: int) -> tuple[list[str], list[str]]:
    ins = ["input_ids", "position_ids", "slot_row", "row_slot", "context_mask", "context_beams", "beam_slot", "prefix_mask", "chunk_mask",
           "new_mask"]
    outs = ["logits"]
    for i in range(num_layers):
        ins += [f"{level}.{i}.{t}" for level in ("context", "prefix", "chunk") for t in ("key", "value")]
        outs += [f"new.{i}.key", f"new.{i}.value"]
    return ins, outs


def export_prefix_decoder(model, path: Path, opset: int = 17, attention: str = "split") -> dict:
    """Write the decode graph of `model` (a transformers causal LM, fp32, eval) to `path`, its
    attention `attention` (ATTENTIONS)."""
    import torch

    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    cfg = model.config
    attention = written_form(attention, cfg)
    dec = _decoder(model, attention)
    L = cfg.num_hidden_layers
    H, KV, d = _heads(cfg)
    b, s, T, K, n, C = 2, 3, 5, 4, 2, 6    # n new tokens per row (dynamic, like the rest); one context
    N = b * s
    args = [torch.zeros(N, n, dtype=torch.int64), C + T + torch.arange(n).repeat(N, 1), torch.arange(N), torch.arange(N),
            torch.ones(1, C, dtype=torch.int64), torch.arange(b)[None], torch.arange(b),
            torch.ones(b, T, dtype=torch.int64), torch.zeros(N, K, dtype=torch.int64), torch.ones(N, n, dtype=torch.int64)]
    for _ in range(L):
        args += [torch.zeros(1, KV, C, d), torch.zeros(1, KV, C, d), torch.zeros(b, KV, T, d), torch.zeros(b, KV, T, d),
                 torch.zeros(K, b, KV, s, d), torch.zeros(K, b, KV, s, d)]
    ins, outs = io_names(L)
    axes = {"input_ids": {0: "rows", 1: "new"}, "position_ids": {0: "rows", 1: "new"}, "slot_row": {0: "slots"},
            "row_slot": {0: "rows"},
            "context_mask": {0: "contexts", 1: "context"}, "context_beams": {0: "contexts", 1: "blocks"},
            "beam_slot": {0: "beams"}, "prefix_mask": {0: "beams", 1: "prefix"}, "chunk_mask": {0: "slots", 1: "chunk"},
            "new_mask": {0: "rows", 1: "new"}, "logits": {0: "rows"}}
    for i in range(L):
        axes.update({**{f"context.{i}.{t}": {0: "contexts", 2: "context"} for t in ("key", "value")},
                     f"prefix.{i}.key": {0: "beams", 2: "prefix"}, f"prefix.{i}.value": {0: "beams", 2: "prefix"},
                     **{f"chunk.{i}.{t}": {0: "chunk", 1: "beams", 3: "candidates"} for t in ("key", "value")},
                     **{f"new.{i}.{t}": {0: "new", 1: "beams", 3: "candidates"} for t in ("key", "value")}})
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        torch.onnx.export(dec, tuple(args), str(path), input_names=ins, output_names=outs, dynamic_axes=axes,
                          opset_version=max(opset, 18) if attention == "fused" else opset, dynamo=False,
                          do_constant_folding=True)
    if attention == "fused":
        standard_attention(path)
        opset = FUSED_OPSET
    saved = written_once(path)
    rope = {"rope": rope_kind(model)} if family(cfg) in ("llama", "gemma", "neox") else {}
    window = {"sliding_window": sliding_window(cfg), "window_masked": True} if sliding_window(cfg) else {}
    return {"graph": path.name, "revision": DECODE_GRAPH_REVISION, "family": family(cfg), "layers": L, "opset": opset,
            "attention": attention, **rope, **window,
            "inputs": "input_ids, position_ids, slot_row, row_slot, context_mask, context_beams, beam_slot, prefix_mask, chunk_mask, "
                      "new_mask, context.L.key/value, prefix.L.key/value, chunk.L.key/value", "outputs": "logits, new.L.key/value", "shared_bytes": saved}


def to_float16(path: Path) -> dict:
    """The decode graph at `path` in float16, in place: weights, activations and the K/V it takes
    and returns, with the logits kept float32 for the kernel (ORT's float16 converter, which casts
    at the logits). Returns what was converted."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    g = convert_float_to_float16(onnx.load(str(path)), keep_io_types=["logits"], disable_shape_infer=True)
    casts = sum(n.op_type == "Cast" for n in g.graph.node)
    save(g, path)
    return {"dtype": "float16", "logits": "float32", "casts": casts}


def parity(model_dir: Path, s: int = 3, k: int = 3, seed: int = 0, context: int = 4, chunks: int = 2,
           provider: str = "cpu") -> dict:
    """decode.onnx against model.onnx of the same export: two left-padded contexts of `context`
    and `context` - 2 random tokens prefilled in one call of each (each graph's own), then 2 beams
    x s candidates, `chunks` chunks of k random tokens with a keep between them; max |logit diff|,
    mean KL and the share of rows whose likeliest token is the same (top-1 agreement) over the
    prefill and every step, both graphs on `provider`. A `context` longer than the model's sliding
    window checks the window."""
    import numpy as np

    full, dec = OnnxModel(model_dir, provider), PrefixDecoder(model_dir / DECODE_GRAPH, provider)
    rng = np.random.default_rng(seed)
    V = full.vocab_size
    ctx, mask = rng.integers(1, V, (2, context)), np.ones((2, context), np.int64)
    mask[1, :2] = 0
    ref, past = full.forward(ctx, full.empty_cache(2), mask)
    # each graph goes on from its own prefill: model.onnx may number a left-padded row's positions
    # from its first column (Gemma's export), the decode graph from its first token; RoPE makes
    # the logits the same either way, not the keys
    got, pc = dec.prefill(ctx, mask, full.kv_heads, full.head_dim, s, k)
    diff, kls, same = float(np.abs(ref[:, -1] - got).max()), [_kl(ref[:, -1], got)], [_top1(ref[:, -1], got)]
    rows = past.repeat(s)
    for chunk in range(chunks):
        for _ in range(k):
            tok = rng.integers(1, V, 2 * s)
            ref, rows = full.forward(tok[:, None], rows)
            got = dec.step(tok, pc)
            diff = max(diff, float(np.abs(ref[:, 0] - got).max()))
            kls.append(_kl(ref[:, 0], got))
            same.append(_top1(ref[:, 0], got))
        keep = np.array([s + 1, 0])                       # the beams swap places
        pc.keep(keep)
        rows = rows.select(np.repeat(keep, s))
    return {"max_abs_logit_diff": diff, "mean_kl": float(np.mean(kls)), "top1_agreement": float(np.mean(same))}


def _top1(p_logits, q_logits) -> float:
    """The share of rows whose likeliest token is the same under both."""
    import numpy as np

    return float(np.mean(np.argmax(p_logits, -1) == np.argmax(q_logits, -1)))


def _kl(p_logits, q_logits) -> float:
    """Mean over rows of KL(p || q) of the next-token distributions, in nats."""
    import numpy as np

    lp = p_logits - np.logaddexp.reduce(p_logits, axis=-1, keepdims=True)
    lq = q_logits - np.logaddexp.reduce(q_logits, axis=-1, keepdims=True)
    return float((np.exp(lp) * (lp - lq)).sum(-1).mean())
