"""Attention fusion: each layer's exported attention subgraph -> one `com.microsoft.MultiHeadAttention`.

The optimum export of a decoder with past computes, per layer and per step,
`present.key = Concat(past.key, k)`, then `Transpose(present.key)`, scales both q and the
transposed keys with a `Mul`, and only then the score `MatMul`: three copies of the whole
cache per layer and step. On GPT-2 large at b x s = 70 rows that is most of an int8 step
(ORT profile: Transpose 279 ms, Concat 120 ms, Mul 46 ms of 773 ms). ONNX Runtime's contrib
`MultiHeadAttention` takes q, k, v (B, S, hidden) and the past (B, H, P, hd), writes the
present once and reads the keys in place. ORT's own fusion passes do not match this graph.

The match is structural (from each `present.N.key` output back and forward), so it does not
depend on node names; a graph that does not match is kept as it was and the report says why.
The attention mask the graph already builds (bool (B, 1, S, P+S), causal and padding) becomes
the additive `attention_bias`, built once and shared by every layer. Export parity against
PyTorch then checks the fused graph like any other.
"""
from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

MS = "com.microsoft"
# Additive bias of a masked key. Finite on purpose: a left-padding query row has every key
# masked, and with the float32 minimum MultiHeadAttention turns that row into NaN, which the
# next layer spreads through the padded keys (0 * NaN). exp(-1e4) is exactly 0 in float32,
# so a row with any unmasked key is unaffected.
MASKED = -1e4


class NoMatch(Exception):
    pass


def attention_scale(config, layer: int, head_dim: int) -> float:
    """The softmax scale of a GPT-2-style layer (transformers' GPT2Attention)."""
    scale = 1.0 / math.sqrt(head_dim) if getattr(config, "scale_attn_weights", True) else 1.0
    if getattr(config, "scale_attn_by_inverse_layer_idx", False):
        scale /= float(layer + 1)
    return scale


class _Graph:
    def __init__(self, graph):
        self.g = graph
        self.producer = {o: n for n in graph.node for o in n.output}
        self.consumers = defaultdict(list)
        for n in graph.node:
            for i in n.input:
                self.consumers[i].append(n)

    def prod(self, name, op):
        n = self.producer.get(name)
        if n is None or n.op_type != op:
            raise NoMatch(f"{name} is not produced by {op} (got {n.op_type if n else 'a graph input'})")
        return n

    def only(self, name, op):
        ns = [n for n in self.consumers[name] if n.op_type == op]
        if len(ns) != 1:
            raise NoMatch(f"{name} has {len(ns)} {op} consumers, expected 1")
        return ns[0]


def _perm(node):
    from onnx import helper

    return next((list(helper.get_attribute_value(a)) for a in node.attribute if a.name == "perm"), None)


def _heads_flat(G: _Graph, name: str) -> str:
    """(B, H, S, hd) tensor made by Transpose(Reshape(x (B, S, hidden))) -> x."""
    t = G.prod(name, "Transpose")
    if _perm(t) != [0, 2, 1, 3]:
        raise NoMatch(f"{t.name}: unexpected perm {_perm(t)}")
    return G.prod(t.input[0], "Reshape").input[0]


def _strip_mul(G: _Graph, name: str) -> str:
    n = G.producer.get(name)
    return n.input[0] if n is not None and n.op_type == "Mul" else name


def _match_layer(G: _Graph, layer: int):
    """Tensor names of one layer's attention; raises NoMatch."""
    pk, pv = f"past_key_values.{layer}.key", f"past_key_values.{layer}.value"
    ck, cv = G.prod(f"present.{layer}.key", "Concat"), G.prod(f"present.{layer}.value", "Concat")
    if list(ck.input[:1]) != [pk] or list(cv.input[:1]) != [pv] or len(ck.input) != 2 or len(cv.input) != 2:
        raise NoMatch(f"layer {layer}: present is not Concat(past, new)")
    k_flat, v_flat = _heads_flat(G, ck.input[1]), _heads_flat(G, cv.input[1])
    kt = G.only(f"present.{layer}.key", "Transpose")
    if _perm(kt) != [0, 1, 3, 2]:
        raise NoMatch(f"layer {layer}: key transpose perm {_perm(kt)}")
    scores = None
    for n in G.consumers[kt.output[0]]:
        cand = n if n.op_type == "MatMul" else (G.only(n.output[0], "MatMul") if n.op_type == "Mul" else None)
        if cand is not None:
            scores = cand
    if scores is None:
        raise NoMatch(f"layer {layer}: no score MatMul")
    q_flat = _heads_flat(G, _strip_mul(G, scores.input[0]))
    add = G.only(scores.output[0], "Add")
    bias = add.input[1] if add.input[0] == scores.output[0] else add.input[0]
    where = G.prod(bias, "Where")
    mask = where.input[0]
    sl = G.producer.get(mask)
    if sl is not None and sl.op_type == "Slice":      # slice of the shared mask to P+S: a no-op
        mask = sl.input[0]
    soft = G.only(add.output[0], "Softmax")
    probs = soft.output[0]
    isnan = [n for n in G.consumers[probs] if n.op_type == "IsNaN"]
    if isnan:                                         # fully masked rows -> 0 (padding guard)
        probs = G.only(isnan[0].output[0], "Where").output[0]
    mm = G.only(probs, "MatMul")
    if mm.input[1] != f"present.{layer}.value":
        raise NoMatch(f"layer {layer}: probabilities do not multiply present.value")
    tr = G.only(mm.output[0], "Transpose")
    if _perm(tr) != [0, 2, 1, 3]:
        raise NoMatch(f"layer {layer}: output transpose perm {_perm(tr)}")
    out = G.only(tr.output[0], "Reshape")
    return dict(q=q_flat, k=k_flat, v=v_flat, mask=mask, where=where, out=out.output[0],
                drop=[ck, cv, out])


def _prune(graph) -> int:
    """Drop nodes no graph output depends on; returns how many."""
    need = {o.name for o in graph.output}
    keep = []
    for n in reversed(graph.node):
        if any(o in need for o in n.output):
            keep.append(n)
            need.update(i for i in n.input if i)
    dropped = len(graph.node) - len(keep)
    del graph.node[:]
    graph.node.extend(reversed(keep))
    return dropped


def _toposort(graph) -> None:
    known = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    pending, ordered = list(graph.node), []
    while pending:
        rest = []
        for n in pending:
            if all(i in known for i in n.input):
                ordered.append(n)
                known.update(n.output)
            else:
                rest.append(n)
        if len(rest) == len(pending):
            raise NoMatch("fused graph has a cycle")
        pending = rest
    del graph.node[:]
    graph.node.extend(ordered)


def fuse_graph(model, num_layers: int, num_heads: int, head_dim: int, config) -> dict:
    """Fuse in place on an onnx ModelProto; returns {applied, layers, removed_nodes, reason}."""
    import numpy as np
    from onnx import helper, numpy_helper

    G = _Graph(model.graph)
    try:
        layers = [_match_layer(G, i) for i in range(num_layers)]
    except NoMatch as e:
        return {"applied": False, "layers": 0, "reason": f"attention pattern not matched ({e}); graph kept"}
    drop = {id(n) for L in layers for n in L["drop"]}
    kept = [n for n in model.graph.node if id(n) not in drop]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    biases: dict[str, str] = {}
    for i, L in enumerate(layers):
        if L["mask"] not in biases:                   # one additive bias per distinct mask
            name = f"dbs_fast/attention_bias_{len(biases)}"
            w = L["where"]
            model.graph.node.append(helper.make_node("Constant", [], [name + "_masked"], name=name + "_masked",
                                                     value=numpy_helper.from_array(np.array(MASKED, np.float32))))
            model.graph.node.append(helper.make_node("Where", [L["mask"], w.input[1], name + "_masked"], [name],
                                                     name=name))
            biases[L["mask"]] = name
        model.graph.node.append(helper.make_node(
            "MultiHeadAttention",
            [L["q"], L["k"], L["v"], "", "", biases[L["mask"]], f"past_key_values.{i}.key",
             f"past_key_values.{i}.value"],
            [L["out"], f"present.{i}.key", f"present.{i}.value"],
            name=f"dbs_fast/mha_{i}", domain=MS, num_heads=num_heads,
            scale=attention_scale(config, i, head_dim)))
    if not any(o.domain == MS for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS, 1))
    removed = _prune(model.graph)
    _toposort(model.graph)
    return {"applied": True, "layers": num_layers, "removed_nodes": removed,
            "reason": f"{num_layers} attention subgraphs -> com.microsoft.MultiHeadAttention"}


def fuse_attention(path: Path, config) -> dict:
    """Fuse the model at `path` in place (graph only; external weight files are untouched)."""
    import onnx

    if config.model_type not in ("gpt2",):
        return {"applied": False, "layers": 0,
                "reason": f"attention fusion is implemented for GPT-2-style graphs, not {config.model_type!r}; "
                          f"graph kept"}
    model = onnx.load(str(path), load_external_data=False)
    heads = int(config.num_attention_heads)
    report = fuse_graph(model, int(config.num_hidden_layers), heads, int(config.hidden_size) // heads, config)
    if report["applied"]:
        tmp = Path(str(path) + ".fused")
        onnx.save(model, str(tmp))
        tmp.replace(path)
    return report
