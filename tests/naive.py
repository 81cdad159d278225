"""Plain NumPy references of the kernels (full sort, float64), compared with them in tests."""
import numpy as np


def banned_ngram_tokens(history, n):
    """transformers' no_repeat_ngram rule, spelled out: tokens completing an n-gram already seen."""
    h = list(history)
    if n <= 0 or len(h) + 1 < n:
        return set()
    grams = {}
    for i in range(len(h) - n + 1):
        grams.setdefault(tuple(h[i:i + n - 1]), set()).add(h[i + n - 1])
    return grams.get(tuple(h[len(h) - n + 1:]) if n > 1 else (), set())


def banned_tokens(history, ban_seqs):
    """The ban rule, spelled out on its own: a token t is banned when the row's text with t
    appended ends with a banned sequence."""
    h = [] if history is None else [int(x) for x in history]
    out = set()
    for seq in ban_seqs or ():
        *head, last = [int(x) for x in seq]
        if h[len(h) - len(head):] == head if head else True:
            out.add(last)
    return out


def word_loop_tokens(history, words, window):
    """The word-loop rule, spelled out. `words`: (word_class, key, ...) as `occurrence.WordTable`.
    Cut the history into words (a word-start token, or a word piece after a token that is no
    word, and the word pieces after it), keep the last window - 1, and ban every word spelled by
    one token that is the last word or two of those words already: every token of that word that
    would begin a word here."""
    if window <= 0 or history is None or not len(history):
        return set()
    cls, key = words[0], words[1]
    h = [int(x) for x in history]
    spans = []                                   # token lists of the words, in order
    for i, t in enumerate(h):
        if cls[t] == 1 or (cls[t] == 2 and (i == 0 or cls[h[i - 1]] == 0)):
            spans.append([t])
        elif cls[t] == 2:
            spans[-1].append(t)
    last = spans[-(window - 1):]
    singles = [key[w[0]] for w in last if len(w) == 1 and key[w[0]] >= 0]
    banned = {k for k in singles if singles.count(k) >= 2}
    if last and len(last[-1]) == 1 and key[last[-1][0]] >= 0:
        banned.add(key[last[-1][0]])
    after_other = cls[h[-1]] == 0
    return {t for t in range(len(cls)) if key[t] in banned and (cls[t] == 1 or (cls[t] == 2 and after_other))}


def shape_logits(x, history, penalty=1.0, ngram=0, words=None, window=0, presence=0.0, frequency=0.0,
                 generated=None, logit_bias=None):
    """OpenAI's logit bias ({token: bias}), repetition penalty (CTRL / transformers), then OpenAI's
    presence and frequency penalties (over `generated`, the history's last tokens that the row
    generated; None: all of it), n-gram and word-loop bans on raw logits (float32)."""
    x = x.astype(np.float32).copy()
    for t, b in (logit_bias or {}).items():
        x[t] = x[t] + np.float32(b)
    if history is None:
        return x
    loops = word_loop_tokens(history, words, window)
    seen = np.unique(np.asarray(history, np.int64))
    if penalty != 1.0 and len(seen):
        v = x[seen]
        x[seen] = np.where(v > 0, v / np.float32(penalty), v * np.float32(penalty))
    gen, count = np.unique(np.asarray(history if generated is None else generated, np.int64), return_counts=True)
    if presence or frequency:
        x[gen] = x[gen] - np.float32(presence) - np.float32(frequency) * count.astype(np.float32)
    for t in loops:
        x[t] = -np.inf
    for t in banned_ngram_tokens(history, ngram):
        x[t] = -np.inf
    return x


def sample_ref(logits, uniforms, temperature=1.0, top_p=0.9, dense_boosts=None, boost_first=False,
               histories=None, penalty=1.0, ngram=0, bans=None, force=None, words=None, window=0, min_p=0.0,
               rank=None, presence=0.0, frequency=0.0, generated=None, logit_bias=None):
    """dense_boosts: list per row of a (V,) boost vector or None; histories: list per row of token ids;
    bans: list per row of banned token sequences; force: per row a token id or -1; min_p (one, or one
    per row): keep only tokens whose own probability (shaped, before boosts) is at least min_p times
    the top one's, then top-p of those; temperature 0 takes the kept token of the rank[r]-th largest
    weight at temperature 1 (rank None: the largest; counted round the kept tokens). temperature
    and top_p: one, or one per row; logit_bias: one dict, or a list of one per row (None: none)."""
    R, V = logits.shape
    ids = np.empty(R, np.int64)
    logp = np.empty(R, np.float64)
    temperatures = np.broadcast_to(temperature, (R,))
    top_ps = np.broadcast_to(top_p, (R,))
    for r in range(R):
        temperature, top_p = float(temperatures[r]), float(top_ps[r])
        inv_t = np.float32(1.0 / max(temperature, 0.01) if temperature > 0 else 1.0)
        raw = (logits[r].astype(np.float32) * inv_t)
        logz = float(raw.max()) + np.log(np.exp((raw - raw.max()).astype(np.float64)).sum())
        h = None if histories is None else histories[r]
        s = shape_logits(logits[r], h, penalty, ngram, words, window, presence, frequency,
                         None if generated is None else generated[r],
                         logit_bias[r] if isinstance(logit_bias, list) else logit_bias) * inv_t
        for t in banned_tokens(h, None if bans is None else bans[r]):
            s[t] = -np.inf
        if force is not None and force[r] >= 0:
            ids[r] = force[r]
            logp[r] = float(raw[ids[r]]) - logz
            continue
        m = s.max()
        b = None if dense_boosts is None else dense_boosts[r]
        key = s.astype(np.float64) + (b if (b is not None and boost_first) else 0.0)
        key = key.astype(np.float32) if (b is not None and boost_first) else s
        plausible = np.exp(s.astype(np.float64) - float(m)) >= np.broadcast_to(min_p, (R,))[r]   # min_p first
        if top_p < 1.0:
            w = np.where(plausible, np.exp(key.astype(np.float64) - float(m)), 0.0)
            order = np.argsort(-key, kind="stable")
            cum = np.cumsum(w[order])
            k = int(np.searchsorted(cum, top_p * cum[-1]))
            cut = key[order[min(k, V - 1)]]
            kept = key >= cut
        else:
            kept = np.ones(V, bool)
        kept &= plausible
        final = key.astype(np.float64)
        if b is not None and not boost_first:
            final = final + np.where(kept, b, 0.0)
        w = np.where(kept, np.exp(final - float(m)), 0.0)
        c = np.cumsum(w)
        if temperature == 0:
            order = np.argsort(-w, kind="stable")
            ids[r] = int(order[(0 if rank is None else rank[r]) % max(int((w > 0).sum()), 1)])
            logp[r] = float(raw[ids[r]]) - logz
            continue
        ids[r] = min(int(np.searchsorted(c, uniforms[r] * c[-1], side="right")), V - 1)
        logp[r] = float(raw[ids[r]]) - logz
    return ids, logp


def attention_ref(q, keys, values, mask):
    """Plain softmax attention of one query row per head: q (H, d), keys/values (kv, T, d) with
    grouped heads (head h reads kv head h // (H / kv)), mask (T,) bool; returns (H * d,)."""
    H, d = q.shape
    g = H // keys.shape[0]
    out = []
    for h in range(H):
        s = keys[h // g] @ q[h] / np.sqrt(d)
        s = np.where(mask, s, -np.inf)
        w = np.exp(s - s.max())
        out.append((w / w.sum()) @ values[h // g])
    return np.concatenate(out)


def extend_prefix_ref(prefix, chunk, src, s, j, lead=0, first=0):
    """The chunk boundary's copy: new beam i = `lead` zero columns, the prefix of beam src[i] // s
    from its column `first`, then the first j chunk tokens of row src[i] (chunk slot-major (K, b,
    kv, s, d))."""
    src = np.asarray(src)
    p = prefix[src // s][:, :, first:]
    zeros = np.zeros(p.shape[:2] + (lead, p.shape[3]), p.dtype)
    return np.concatenate([zeros, p, chunk[:j, src // s, :, src % s].transpose(0, 2, 1, 3)], axis=2)


def distinct_rows_ref(group, ids, need):
    """`dbs_fast.kv.groups.distinct_rows` by a loop over the slots: a row per new (group, token)
    among the slots that need logits, in the order of their first slot."""
    rows, row_slot = {}, []
    for i in range(len(group)):
        if need[i]:
            assert group[i] >= 0
            if (group[i], ids[i]) not in rows:
                rows[(group[i], ids[i])] = len(row_slot)
                row_slot.append(i)
    new_group = [rows.get((g, t), -1) if g >= 0 else -1 for g, t in zip(group, ids)]
    return new_group, [max(g, 0) for g in new_group], row_slot
