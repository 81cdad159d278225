"""`dbs-fast eval`: the paper's keyword-to-phrase evaluation (SPEC, "Evaluation").

Keyword sets: English words ranked 501-1000 by frequency (wordfreq), stop words removed,
5 per set, sampled with a fixed seed (or read from a file, one comma-separated set per line).
Each set runs DBS and the unguided baseline (b = s = 1, no boosts); results are appended to
results.jsonl as they finish (a re-run skips finished sets), then summary.json + summary.md.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from dbs_fast.errors import DBSError

# NLTK's English stop-word list (the corpus download is not available offline).
STOP_WORDS = set("""i me my myself we our ours ourselves you you're you've you'll you'd your yours yourself
yourselves he him his himself she she's her hers herself it it's its itself they them their theirs
themselves what which who whom this that that'll these those am is are was were be been being have has
had having do does did doing a an the and but if or because as until while of at by for with about
against between into through during before after above below to from up down in out on off over under
again further then once here there when where why how all any both each few more most other some such
no nor not only own same so than too very s t can will just don don't should should've now d ll m o re
ve y ain aren aren't couldn couldn't didn didn't doesn doesn't hadn hadn't hasn hasn't haven haven't isn
isn't ma mightn mightn't mustn mustn't needn needn't shan shan't shouldn shouldn't wasn wasn't weren
weren't won won't wouldn wouldn't""".split())


def candidate_words() -> list[str]:
    from wordfreq import top_n_list

    words = top_n_list("en", 1000)[500:1000]                     # frequency ranks 501-1000
    return [str(w) for w in words if w.isalpha() and len(w) >= 3 and w not in STOP_WORDS]


def sample_sets(n: int, seed: int, size: int = 5) -> list[list[str]]:
    rng = np.random.default_rng(seed)
    words = candidate_words()
    return [[str(w) for w in rng.choice(words, size=size, replace=False)] for _ in range(n)]


def read_sets(path: str) -> list[list[str]]:
    p = Path(path)
    if not p.is_file():
        raise DBSError(f"keyword file not found: {path}")
    return [[w.strip() for w in line.split(",")] for line in p.read_text().splitlines() if line.strip()]


def _row(i, kws, mode, r, n_batch) -> dict:
    # r.seconds is the wall time of the whole batch; a set's share is that over the batch size
    return {"set": i, "mode": mode, "keywords": kws, "success_rate": r.success_rate,
            "perplexity": r.perplexity, "success_length": r.success_length, "seconds": r.seconds / n_batch,
            "batch_seconds": r.seconds, "batch_sets": n_batch,
            "text": r.text, "found": r.found}


def run_modes(dbs, sets, configs: dict, path: Path, context="It is", batch=4, seed=0, quiet=False,
              desc="eval") -> list[dict]:
    """Every (set, mode) not yet in `path` (JSONL) is generated, batch sets at a time, and appended
    as soon as its batch ends; returns all rows of the file."""
    from tqdm import tqdm

    path.parent.mkdir(parents=True, exist_ok=True)
    done = set()
    if path.is_file():
        done = {(d["set"], d["mode"]) for d in map(json.loads, path.read_text().splitlines())}
    todo = [(i, m) for m in configs for i in range(len(sets)) if (i, m) not in done]
    with open(path, "a") as f, tqdm(total=len(todo), desc=desc, unit="set", disable=quiet) as bar:
        for mode, cfg in configs.items():
            idx = [i for i, m in todo if m == mode]
            for start in range(0, len(idx), batch):
                part = idx[start:start + batch]
                res = dbs.generate_batch([(context, sets[i]) for i in part], seeds=[seed + i for i in part],
                                         config=cfg)
                for i, r in zip(part, res):
                    f.write(json.dumps(_row(i, sets[i], mode, r, len(part))) + "\n")
                f.flush()
                bar.update(len(part))
    return [json.loads(line) for line in path.read_text().splitlines()]


METRICS = ("success_rate", "perplexity", "success_length", "seconds")


def _aggregate(rows) -> dict:
    return {m: {"mean": float(np.mean([r[m] for r in rows])), "std": float(np.std([r[m] for r in rows]))}
            for m in METRICS}


def keyword_misses(rows) -> dict:
    """Where DBS falls short: miss rate by the keyword's position in its set, and the missed words."""
    by_pos: dict[int, list[int]] = {}
    missed: dict[str, int] = {}
    for r in rows:
        for pos, kw in enumerate(r["keywords"]):
            hit = r["found"].get(kw) is not None
            by_pos.setdefault(pos + 1, []).append(0 if hit else 1)
            if not hit:
                missed[kw] = missed.get(kw, 0) + 1
    return {"miss_rate_by_position": {p: float(np.mean(v)) for p, v in sorted(by_pos.items())},
            "missed_words": dict(sorted(missed.items(), key=lambda kv: (-kv[1], kv[0])))}


def run_eval(dbs, sets, out: Path, context="It is", batch=4, seed=0, unguided_cfg=None, quiet=False) -> dict:
    cfgs = {"dbs": dbs.config, "unguided": unguided_cfg}
    rows = run_modes(dbs, sets, cfgs, out / "results.jsonl", context, batch, seed, quiet)
    summary = {"scorer": dbs.scorer_name, "model": str(dbs.model_dir), "sets": len(sets),
               "config": dbs.config.to_dict(), "date": time.strftime("%Y-%m-%d")}
    for mode in cfgs:
        summary[mode] = _aggregate([r for r in rows if r["mode"] == mode and r["set"] < len(sets)])
    summary["dbs_misses"] = keyword_misses([r for r in rows if r["mode"] == "dbs" and r["set"] < len(sets)])
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    lines = ["| run | success rate | perplexity | success length | seconds/set (amortised over a batch) |",
             "|---|---|---|---|---|"]
    for mode in cfgs:
        s = summary[mode]
        lines.append(f"| {mode} | {s['success_rate']['mean']:.2f} ± {s['success_rate']['std']:.2f} | "
                     f"{s['perplexity']['mean']:.1f} ± {s['perplexity']['std']:.1f} | "
                     f"{s['success_length']['mean']:.1f} | {s['seconds']['mean']:.1f} |")
    miss = summary["dbs_misses"]
    lines += ["", "DBS miss rate by keyword position: " + ", ".join(
        f"{p}: {v:.2f}" for p, v in miss["miss_rate_by_position"].items()),
        "Missed keywords (times): " + (", ".join(f"{w} ({n})" for w, n in miss["missed_words"].items()) or "none")]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    return summary


# -- hyper-parameter grids (the paper's Figure 1 and Figures 2-3) -------------------------------
LAMBDAS = (5.0, 10.0, 15.0, 20.0, 25.0)
BS_VALUES = (3, 5, 7, 10)
K_VALUES = (2, 5, 10)


def grid_configs(base, which: str, lambdas=LAMBDAS, bs_values=BS_VALUES, k_values=K_VALUES) -> dict:
    """{point name: DBSConfig}. `lambda`: lambda sweep at b = s = k = 5; `bsk`: b, s x k at lambda 20."""
    from dataclasses import replace

    out = {}
    if which in ("lambda", "all"):
        for lam in lambdas:
            out[f"lam={lam:g},b=5,s=5,k=5"] = replace(base, lam=float(lam), beams=5, candidates=5, chunk=5)
    if which in ("bsk", "all"):
        for k in k_values:
            for b in bs_values:
                for s in bs_values:
                    out[f"lam=20,b={b},s={s},k={k}"] = replace(base, lam=20.0, beams=b, candidates=s, chunk=k)
    if not out:
        raise DBSError(f"--grid must be lambda, bsk or all, got {which!r}")
    return out


def run_grid(dbs, sets, out: Path, configs: dict, batch=4, seed=0, quiet=False) -> dict:
    rows = run_modes(dbs, sets, configs, out / "grid.jsonl", batch=batch, seed=seed, quiet=quiet, desc="grid")
    points = []
    for name, cfg in configs.items():
        rs = [r for r in rows if r["mode"] == name and r["set"] < len(sets)]
        points.append({"point": name, "lam": cfg.lam, "beams": cfg.beams, "candidates": cfg.candidates,
                       "chunk": cfg.chunk, "sets": len(rs), **_aggregate(rs)})
    summary = {"scorer": dbs.scorer_name, "model": str(dbs.model_dir), "sets": len(sets),
               "date": time.strftime("%Y-%m-%d"), "points": points}
    (out / "grid.json").write_text(json.dumps(summary, indent=2))
    lines = ["| lambda | b | s | k | success rate | perplexity | success length | seconds/set |",
             "|---|---|---|---|---|---|---|---|"]
    for p in points:
        lines.append(f"| {p['lam']:g} | {p['beams']} | {p['candidates']} | {p['chunk']} | "
                     f"{p['success_rate']['mean']:.2f} ± {p['success_rate']['std']:.2f} | "
                     f"{p['perplexity']['mean']:.1f} | {p['success_length']['mean']:.1f} | {p['seconds']['mean']:.1f} |")
    (out / "grid.md").write_text("\n".join(lines) + "\n")
    grid_plots(points, out)
    return summary


def grid_plots(points, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lam = sorted((p for p in points if p["beams"] == p["candidates"] == p["chunk"] == 5), key=lambda p: p["lam"])
    if len({p["lam"] for p in lam}) > 1:
        fig, ax = plt.subplots(figsize=(5.5, 4))
        xs = [p["lam"] for p in lam]
        ax.errorbar(xs, [p["success_rate"]["mean"] for p in lam], fmt="o-", color="tab:blue", label="success rate")
        ax.set_xlabel("lambda (b = s = k = 5)")
        ax.set_ylabel("success rate", color="tab:blue")
        ax.set_ylim(0, 1.05)
        ax2 = ax.twinx()
        ax2.plot(xs, [p["perplexity"]["mean"] for p in lam], "s--", color="tab:red", label="perplexity")
        ax2.set_ylabel("perplexity", color="tab:red")
        ax.set_title(f"success rate and perplexity per lambda ({lam[0]['sets']} keyword sets)")
        fig.tight_layout()
        fig.savefig(out / "lambda.png", dpi=120)
        plt.close(fig)
    bsk = [p for p in points if p["lam"] == 20.0]
    ks = sorted({p["chunk"] for p in bsk})
    if len(bsk) > 1:
        fig, axes = plt.subplots(3, len(ks), figsize=(4.5 * len(ks), 9), squeeze=False)
        for j, k in enumerate(ks):
            pk = sorted((p for p in bsk if p["chunk"] == k), key=lambda p: (p["beams"], p["candidates"]))
            labels = [f"{p['beams']}x{p['candidates']}" for p in pk]
            for i, (m, lab) in enumerate((("success_rate", "success rate"), ("perplexity", "perplexity"),
                                          ("seconds", "seconds per set"))):
                axes[i][j].bar(labels, [p[m]["mean"] for p in pk])
                axes[i][j].set_ylabel(lab)
                axes[i][j].tick_params(axis="x", rotation=60, labelsize=7)
            axes[0][j].set_title(f"k = {k} (b x s)")
        fig.tight_layout()
        fig.savefig(out / "bsk.png", dpi=120)
        plt.close(fig)


# -- story generation: the four ROC examples of the paper's comparison table --------------------
STORIES = [
    ("He and his friends are bored on a weekend day.", ["go", "decide"]),
    ("He had a heavy duty backpack.", ["took"]),
    ("He hiked up the local hill.", ["top"]),
    ("He liked trading commodities. one day he was trading several products. He noticed that he "
     "gained a lot of money from the new trades.", ["realize"]),
]


def run_stories(dbs, out: Path, seed=0, max_new_tokens: int = 50) -> list[dict]:
    from dataclasses import replace

    cfg = replace(dbs.config, max_new_tokens=max_new_tokens)
    res = dbs.generate_batch(STORIES, seeds=[seed + i for i in range(len(STORIES))], config=cfg)
    rows = [{"context": c, "keywords": k, "text": r.generated, "found": r.found, "success_rate": r.success_rate,
             "perplexity": r.perplexity} for (c, k), r in zip(STORIES, res)]
    out.mkdir(parents=True, exist_ok=True)
    (out / "stories.json").write_text(json.dumps(rows, indent=2))
    return rows
