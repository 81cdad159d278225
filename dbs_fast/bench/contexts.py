"""`dbs-fast bench --contexts 2,256,1024,2048`: what a longer prompt costs.

One loaded worker per context length (the engine's own `worker_engine`, the embedded default or `--model`),
taking turns generation by generation so that the machine's load falls on every length alike:
the paper's search (b=7, s=10, k=5), 40 new tokens, `stop="max"`, keywords river/doctor/winter,
after English text cut to N tokens (sentences of CommonGen train, packaged). The workers run
without the context store (as every contender of the speed bench does), so each generation
prefills its whole context, as a new prompt of that length would be. Reported per length:
seconds per generation, of which prefill and decode, the KV cache's peak bytes, the worker's peak
RSS; and the growth against the shortest context, beside one copy of the added context's K/V and
beside the floor exact attention sets: the arithmetic at that length over the shortest's
(`generation_flops`), of the whole generation (its prefill in) and of its decode steps (times the
rows they computed), so that the growth over the floor is what the engine costs beyond the
arithmetic itself.
`schedule` "plain" computes every row at every step, so the rows are the same at every length and
the floor is the arithmetic's alone; "distinct" (the engine's) computes each distinct row once.

`shared_prefix` (`--shared 1000`): the time to the first chunk of a request whose context shares
its first tokens with one prefilled before (the context store hits), against the same request
with an empty store, in turns.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from dbs_fast.api import resolve_model_dir
from dbs_fast.bench.machine import machine
from dbs_fast.bench.suite import run_in_turns
from dbs_fast.config import DBSConfig
from dbs_fast.errors import DBSError
from dbs_fast.kv.decoder import ContextStore
from dbs_fast.text.prompt import train_pool

KEYWORDS = ["river", "doctor", "winter"]


def context_text(tokenizer, n: int) -> str:
    """English text of about `n` tokens (the model reads its document-start token before it)."""
    text = " ".join(s for _, s in train_pool())
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    while len(ids) < n:
        ids = ids + ids
    return tokenizer.decode(ids[:max(n - 1, 1)])


def step_flops(model_dir: Path, keys, head: bool = True):
    """Floating-point operations of one token's row of a decode step whose query attends to `keys`
    keys (a number, or an array of them): its weight matmuls (2 x in x out each; the LM head's
    unless `head` is False) and its exact attention (q.k and p.v, 2 x head_dim each per query head
    and key, every layer; a layer that slides a window reads at most the window's keys)."""
    import numpy as np

    from dbs_fast.bench.suite import linear_shapes

    c = json.loads((Path(model_dir) / "config.json").read_text())
    m = json.loads((Path(model_dir) / "dbs_fast_model.json").read_text())
    window = c.get("sliding_window")
    kinds = c.get("layer_types") or ["full_attention"] * m["num_layers"]
    keys = np.asarray(keys, dtype=np.float64)
    read = sum(np.minimum(keys, window) if window and kind == "sliding_attention" else keys for kind in kinds)
    V = m["vocab_size"]
    weights = sum(k * n * count for k, n, count in linear_shapes(model_dir) if head or (n, count) != (V, 1))
    return 2.0 * weights + 4.0 * m["num_heads"] * m["head_dim"] * read


def generation_flops(model_dir: Path, context: int, rows: float, steps: int) -> dict:
    """The arithmetic of a generation after `context` tokens: the prefill (each context token once,
    attending to those before it and itself, no LM head) and `steps` decode steps of `rows` rows
    on average, each at the middle step's keys (the steps' keys grow by one a step)."""
    import numpy as np

    prefill = float(step_flops(model_dir, np.arange(1, context + 1), head=False).sum())
    step = float(step_flops(model_dir, context + steps / 2))
    return {"prefill": prefill, "step": step, "decode": steps * rows * step}


def kv_bytes_per_token(manifest: dict) -> int:
    """K and V of one token over every layer, float32."""
    return 2 * manifest["num_layers"] * manifest["num_kv_heads"] * manifest["head_dim"] * 4


def run_contexts(lengths: list[int], out: Path, workdir: Path, repeats: int = 2, threads: int | None = None,
                 model: str = "default", shared: int | None = None, schedule: str = "distinct") -> dict:
    from tokenizers import Tokenizer

    model_dir = resolve_model_dir(model)
    manifest = json.loads((model_dir / "dbs_fast_model.json").read_text())
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    cfg = DBSConfig.paper(max_new_tokens=40)
    name = "context-{}" + ("-plain" if schedule == "plain" else "")        # the worker reads the schedule off it
    specs = [{"point": "contexts", "contender": name.format(n), "config": cfg.to_dict(),
              "keyword_sets": [KEYWORDS], "repeats": repeats, "threads": threads, "model_dir": str(model_dir),
              "context": context_text(tok, n), "same_load": False, "sweep": []} for n in lengths]
    out.mkdir(parents=True, exist_ok=True)
    workdir.mkdir(parents=True, exist_ok=True)
    done = run_in_turns(specs, workdir, repeats)
    rows = []
    for n in lengths:
        r = done[name.format(n)]
        if "error" in r:
            rows.append({"context_tokens": n, "error": r["error"]})
            continue
        rows.append({"context_tokens": r["prompt_tokens"], "asked": n, "seconds": r["seconds_min"],
                     "seconds_all": r["seconds_all"], "prefill_seconds": r["stage_ms_per_step"]["prefill_total"] / 1e3,
                     "decode_seconds": min(r["decode_seconds_all"]), "kv_cache_bytes": r["kv_cache_bytes"],
                     "peak_rss_bytes": r["peak_rss_bytes"], "success_rate": r["success_rate"],
                     "model_rows_ratio": r["model_rows_ratio"],
                     "flops": generation_flops(model_dir, r["prompt_tokens"],
                                               r["model_rows_ratio"] * cfg.beams * cfg.candidates, cfg.max_new_tokens)})
    ok = [r for r in rows if "error" not in r]
    if ok:
        base, top = ok[0], ok[-1]
        one_copy = kv_bytes_per_token(manifest) * top["context_tokens"]
        for r in ok:
            r["seconds_x"] = r["seconds"] / base["seconds"]
            r["decode_x"] = r["decode_seconds"] / base["decode_seconds"]
            r["kv_extra_bytes"] = r["kv_cache_bytes"] - base["kv_cache_bytes"]
            r["kv_extra_over_one_copy"] = r["kv_extra_bytes"] / (kv_bytes_per_token(manifest) * max(
                r["context_tokens"] - base["context_tokens"], 1))
            r.update(over_floor(r, base))
    report = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M %Z"), "model": str(model_dir),
              "config": cfg.to_dict(), "keywords": KEYWORDS, "repeats": repeats, "schedule": schedule,
              "kv_bytes_per_context_token": kv_bytes_per_token(manifest),
              "one_copy_of_longest_context_bytes": one_copy if ok else None, "rows": rows,
              "shared_prefix": shared_prefix(shared, threads=threads, model=model) if shared else None}
    (out / "contexts.json").write_text(json.dumps(report, indent=2))
    (out / "contexts.md").write_text(markdown(report))
    print(markdown(report))
    return report


def over_floor(row: dict, base: dict) -> dict:
    """`row`'s growth against the shortest context `base` over the floor exact attention sets
    (`generation_flops`): `step_floor_x` a decode step's arithmetic at its length over the
    shortest's, times the rows the steps computed, and `decode_over_floor` the decode's growth
    (`decode_x`) over it; `floor_x` the whole generation's, its prefill in, and `over_floor` the
    generation's growth (`seconds_x`) over that. 1.0 is the arithmetic's own growth."""
    a, b = row["flops"], base["flops"]
    step = a["decode"] / b["decode"]
    whole = (a["prefill"] + a["decode"]) / (b["prefill"] + b["decode"])
    return {"step_floor_x": step, "decode_over_floor": row["decode_x"] / step,
            "floor_x": whole, "over_floor": row["seconds_x"] / whole}


def markdown(report: dict) -> str:
    lines = [f"Context length: {report['date']}, {report['machine']}; the paper's search "
             f"(b={report['config']['beams']}, s={report['config']['candidates']}, k={report['config']['chunk']}), "
             f"{report['config']['max_new_tokens']} new tokens, keywords {', '.join(report['keywords'])}, the "
             f"{report.get('schedule', 'distinct')} schedule; best of {report['repeats']} per length, the lengths "
             f"taking turns. The floors: the arithmetic of exact attention and the weight matmuls over the shortest "
             f"context's, of a decode step (times the rows computed) and of the whole generation (its prefill in).", "",
             "| context tokens | s / generation | x shortest | floor x | over the floor | prefill s (median) | "
             "decode s | decode x shortest | step floor x | decode over it | "
             "KV cache MB | KV added / one copy of the added context | peak RSS MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        if "error" in r:
            lines.append(f"| {r['context_tokens']} | failed: {r['error']} | | | | | | | | | | | |")
            continue
        lines.append(f"| {r['context_tokens']} | {r['seconds']:.2f} | {r['seconds_x']:.2f} | {r['floor_x']:.2f} | "
                     f"{r['over_floor']:.2f} | {r['prefill_seconds']:.2f} | {r['decode_seconds']:.2f} | "
                     f"{r['decode_x']:.2f} | {r['step_floor_x']:.2f} | {r['decode_over_floor']:.2f} | "
                     f"{r['kv_cache_bytes'] / 1e6:.0f} | {r['kv_extra_over_one_copy']:.1f} | "
                     f"{r['peak_rss_bytes'] / 1e6:.0f} |")
    sp = report.get("shared_prefix")
    if sp:
        lines += ["", f"A request of {sp['context_tokens']} context tokens whose first {sp['shared_tokens']} another "
                  f"request's context shares ({sp['reused_tokens']} taken from the context store): time to its first "
                  f"chunk {sp['warm_seconds']:.2f} s against {sp['cold_seconds']:.2f} s with an empty store "
                  f"({sp['ratio']:.2f}x; best of {len(sp['cold_all'])}, in turns)."]
    return "\n".join(lines) + "\n"


def shared_prefix(shared: int, tail: int = 100, repeats: int = 3, threads: int | None = None,
                  model: str = "default") -> dict:
    """Seconds to the first chunk (prefill + one chunk, the paper's search) of a context of
    `shared` + `tail` tokens: with an empty context store (cold) and after another context with
    the same first `shared` tokens was prefilled (warm); best of `repeats`, alternating."""
    from dbs_fast.api import DirectedBeamSearch

    cfg = DBSConfig.paper(max_new_tokens=40)
    dbs = DirectedBeamSearch(model, config=cfg, threads=threads, context_cache_mb=0)   # each length prefilled
    if dbs.decoder is None:
        raise DBSError("--shared needs the prefix cache (an export with decode.onnx)")
    tok = dbs.backend.tokenizer
    text = context_text(tok, shared + 2 * tail + 2)
    ids = tok.encode(text, add_special_tokens=False).ids
    first, second = tok.decode(ids[:shared] + ids[shared + tail:shared + 2 * tail]), tok.decode(ids[:shared + tail])

    def first_chunk(context: str) -> float:
        batch = dbs.batch(cfg)
        t0 = time.perf_counter()
        batch.admit([dbs.request(context, KEYWORDS, seed=0, config=cfg)])
        batch.decode_chunk()
        seconds = time.perf_counter() - t0
        batch.drop(batch.requests)
        return seconds

    first_chunk("It is")                                         # warm-up: kernels compiled, sessions loaded
    cold, warm, reused = [], [], []
    for _ in range(repeats):
        dbs.decoder.store = ContextStore(2**30)
        cold.append(first_chunk(second))
        dbs.decoder.store = ContextStore(2**30)
        first_chunk(first)
        warm.append(first_chunk(second))
        reused.append(dbs.decoder.store.reused_tokens)
    return {"shared_tokens": shared, "context_tokens": len(dbs.request(second, KEYWORDS).context_ids) + 1,
            "reused_tokens": reused[-1], "cold_seconds": min(cold), "warm_seconds": min(warm),
            "cold_all": cold, "warm_all": warm, "ratio": min(warm) / min(cold)}
