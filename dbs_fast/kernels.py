"""The logits kernel: temperature -> (boosts) -> nucleus -> (boosts) -> one draw per row.

One Numba function, parallel over rows (with bans of token sequences and forced tokens), no full sort of the vocabulary: the nucleus cut is
found from a histogram of log-probabilities (BUCKETS_PER_NAT buckets per nat below the row's
maximum), the bucket that straddles top_p is split into SUB_BUCKETS finer ones, and only the
members of the finer one that straddles it are sorted. Randomness comes in as one
uniform per row, drawn by the caller from a seeded generator, so a fixed stream gives a fixed
result, and the NumPy reference (`tests/naive.py`) must pick the same token. Boosts come as a
CSR table per guide word: boost-first adds them to the logits token by token (and takes its
unguided mass back out densely); filter-then-boost (the default) multiplies the kept weights by
exp(boost), read densely (`dense_boosts`). min_p (off at 0) first drops the tokens whose own
probability (scaled and shaped, before boosts, in both orders) is below min_p times the top
token's, so that guide words are boosted only among what the model finds plausible; top-p then
cuts what is left (renormalised).

Kept set: every token whose (temperature-scaled, for boost_first also boosted) logit is >= the
logit of the token at which the cumulative mass, in descending order, first reaches top_p.
Tokens tied with that one are all kept (transformers' TopPLogitsWarper keeps them in sort
order); otherwise it is the same set.

The draw is an inverse CDF over kept tokens in id order (block sums, then one block token by
token: `_block_masses`, `_walk`). The returned log-probability is the
unguided, untruncated log softmax(logits / T) of the drawn token: the `self` scorer uses it.

Anti-repetition (transformers semantics, applied to the raw logits before temperature, as its
logits processors run before its warpers): `rep_penalty` divides the positive logits of tokens
already in the row's history (context + generated) and multiplies the negative ones;
`no_repeat_ngram` bans every token that would complete an n-gram already in the history.
Word loops ("summer summer summer", which no n-gram repeats) are banned by word: with a window
W > 0, a word spelled by one token (`occurrence.WordTable`: " Summer", "summer" and " summer" are
one word) does not begin right after itself, nor when it is already two of the last W - 1 words
(a third time within W words); punctuation between words is no word ("one-to-one" is three).
Longer words that loop repeat an n-gram, which the n-gram ban sees. The history is `hseq[r, hstart[r]:hend]`. None of
these changes the returned log-probability (the model's own, so the scorer still measures the
model's fluency).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np

from .config import PENALTIES, DBSConfig, inv_temperature
from .numba_runtime import njit, prange, start_threads

BUCKETS_PER_NAT = 16
SPAN_NATS = 64          # tokens further below the max than this share the last bucket
N_BUCKETS = BUCKETS_PER_NAT * SPAN_NATS
SUB_BUCKETS = 256     # finer buckets of the bucket that straddles top_p (`_nucleus_cut`)
SHORT_BANS = 1024     # a row's sequence bans up to this many are sorted; more, and in no order, are marked
DRAW_BLOCK = 256      # tokens per block of the draw's kept-mass sums (`_block_masses`)


LOG2E = np.float32(1.4426950408889634)
LN2_HI, LN2_LO = np.float32(0.693145751953125), np.float32(1.428606765330187e-06)   # Cody-Waite split of ln 2
FAR_BELOW = float(np.exp(-SPAN_NATS / 2))     # a row's total weight under this: its top token is gone and the
#                                                 rest lie more than half the span below it (`_sample_rows`)
EXP_FLOOR = np.float32(-87.0)      # exp below this is under float32's smallest normal: taken as 0


@njit(cache=True, nogil=True, inline="always")
def _exp_below(s, top, e, bits, bk):
    """e[i] = exp(s[i] - top) in float32 for all i, and bk[i] = the histogram bucket of s[i]:
    int((top - s[i]) * BUCKETS_PER_NAT), the last bucket for anything further below (and for -inf,
    a ban). No call and no branch in the loop, so that LLVM vectorises it (Numba's np.exp is one
    scalar libm call per element here: no SVML); the histogram and the nucleus cut then read the
    buckets instead of computing them again in their own scalar loops.
    Cody-Waite reduction y = n ln2 + f, |f| <= ln2 / 2, a degree-6 Taylor polynomial for e^f, and
    2^n written into the exponent bits (`bits`, int32 scratch, viewed as float32). Relative error
    under 3e-7 of float64 exp (tests/test_kernel.py); below EXP_FLOOR, and for -inf (a ban), 0."""
    V = s.shape[0]
    for i in range(V):
        y = s[i] - top
        bk[i] = np.int16(min(-y * np.float32(BUCKETS_PER_NAT), np.float32(N_BUCKETS - 1)))    # y <= 0: -y*16 is exact
        keep = y >= EXP_FLOOR
        y = max(y, EXP_FLOOR)
        n = np.floor(y * LOG2E + np.float32(0.5))
        f = y - n * LN2_HI - n * LN2_LO
        q = np.float32(1.0) + f * (np.float32(1.0) + f * (np.float32(0.5) + f * (
            np.float32(1 / 6) + f * (np.float32(1 / 24) + f * (np.float32(1 / 120) + f * np.float32(1 / 720))))))
        e[i] = q if keep else np.float32(0.0)
        bits[i] = (np.int32(n) + np.int32(127)) << 23
    two = bits.view(np.float32)
    for i in range(V):
        e[i] *= two[i]


@njit(cache=True, nogil=True, inline="always")
def _mass_histogram(bk, e, hist):
    """The weights' sum and their histogram over the buckets `bk`, four interleaved partial
    histograms and sums so that consecutive elements do not wait on the same memory cell."""
    V = bk.shape[0]
    part = np.zeros(4 * N_BUCKETS, np.float64)
    t0, t1, t2, t3 = 0.0, 0.0, 0.0, 0.0
    V4 = V - V % 4
    for i in range(0, V4, 4):
        part[bk[i]] += e[i]
        part[N_BUCKETS + bk[i + 1]] += e[i + 1]
        part[2 * N_BUCKETS + bk[i + 2]] += e[i + 2]
        part[3 * N_BUCKETS + bk[i + 3]] += e[i + 3]
        t0 += e[i]
        t1 += e[i + 1]
        t2 += e[i + 2]
        t3 += e[i + 3]
    for i in range(V4, V):
        part[bk[i]] += e[i]
        t0 += e[i]
    for b in range(N_BUCKETS):
        hist[b] = part[b] + part[N_BUCKETS + b] + part[2 * N_BUCKETS + b] + part[3 * N_BUCKETS + b]
    return (t0 + t1) + (t2 + t3)


@njit(cache=True, nogil=True)
def repeated_words(h, start, end, word_class, key, window, out):
    """Word-loop bans of one history `h[start:end]` (module docstring): the words (keys of
    `occurrence.WordTable`) that may not begin next, written to `out` (at least `window` long);
    returns how many."""
    singles = np.empty(max(window - 1, 1), np.int64)     # one-token words' keys, the most recent first
    n_single = 0
    n_words = 0
    first = -1                                           # the most recent word, if one token
    piece_after = False                                  # the token after i continues its word
    i = end - 1
    while i >= start and n_words < window - 1:
        c = word_class[h[i]]
        if c == 1 or (c == 2 and (i == start or word_class[h[i - 1]] == 0)):     # a word begins at i
            if not piece_after and key[h[i]] >= 0:
                singles[n_single] = key[h[i]]
                n_single += 1
                if n_words == 0:
                    first = key[h[i]]
            n_words += 1
        piece_after = c == 2
        i -= 1
    n = 0
    if first >= 0:
        out[n] = first
        n += 1
    for a in range(n_single):
        k = singles[a]
        seen = 0
        for b in range(n_single):
            seen += singles[b] == k
        known = False
        for b in range(n):
            known = known or out[b] == k
        if seen >= 2 and not known:
            out[n] = k
            n += 1
    return n


@njit(cache=True, nogil=True)
def word_loop_tokens(h, start, end, word_class, key, key_ptr, key_tok, window):
    """The tokens the word-loop rule bans after the history `h[start:end]`: every token that would
    begin a banned word there (a WORD_START token; a WORD_PIECE one only after a token that is no
    word)."""
    loop = np.empty(window, np.int64)
    n = repeated_words(h, start, end, word_class, key, window, loop)
    after_other = end > start and word_class[h[end - 1]] == 0
    size = 0
    for j in range(n):
        size += key_ptr[loop[j] + 1] - key_ptr[loop[j]]
    out = np.empty(size, np.int64)
    m = 0
    for j in range(n):
        for q in range(key_ptr[loop[j]], key_ptr[loop[j] + 1]):
            t = key_tok[q]
            if word_class[t] == 1 or after_other:
                out[m] = t
                m += 1
    return out[:m]


@njit(cache=True, nogil=True, inline="always")
def _repeated(v, penalty):
    """A raw logit under the repetition penalty (CTRL / transformers: divided if positive, else multiplied)."""
    return v / penalty if v > 0 else v * penalty


@njit(cache=True, nogil=True, inline="always")
def _raw(x, t, bias_ids, bias_vals):
    """Token t's logit with its logit bias (`bias_ids` ascending; none: the model's own)."""
    if bias_ids.shape[0] == 0:
        return x[t]
    j = np.searchsorted(bias_ids, t)
    return x[t] + bias_vals[j] if j < bias_ids.shape[0] and bias_ids[j] == t else x[t]


@njit(cache=True, nogil=True, inline="always")
def _bias(x, s, inv_temp, bias_ids, bias_vals, top):
    """The logit bias into `s` (scaled logits, whose max is `top`), on the raw logits before the
    penalties (OpenAI's `logit_bias`, in vLLM's order); returns the row's new max (a negative bias
    can lower it)."""
    if bias_ids.shape[0] == 0:
        return top
    for j in range(bias_ids.shape[0]):
        t = bias_ids[j]
        s[t] = (x[t] + bias_vals[j]) * inv_temp
    return _top(s)


@njit(cache=True, nogil=True)
def _penalise(x, s, inv_temp, h, start, gen, end, penalty, presence, frequency, ngram, bias_ids, bias_vals):
    """Repetition penalty (over the row's tokens from `start`), presence and frequency penalties
    (over its generated ones, from `gen`: minus `presence` once and `frequency` per occurrence, on
    the raw logit, biased by `logit_bias`) and n-gram bans of one row into `s` (scaled logits);
    returns the max penalised value (penalty < 1 or a negative presence can raise a logit above
    the row's max)."""
    top = np.float32(-np.inf)
    if penalty != 1.0:
        for i in range(start, end):
            t = h[i]
            s[t] = _repeated(_raw(x, t, bias_ids, bias_vals), penalty) * inv_temp
            top = max(top, s[t])
    if (presence != 0.0 or frequency != 0.0) and end > gen:
        g = np.sort(h[gen:end])                       # each generated token once, with its count
        a = 0
        while a < g.shape[0]:
            b = a + 1
            while b < g.shape[0] and g[b] == g[a]:
                b += 1
            t = g[a]
            s[t] = (_repeated(_raw(x, t, bias_ids, bias_vals), penalty) - presence
                    - frequency * np.float32(b - a)) * inv_temp
            top = max(top, s[t])
            a = b
    if ngram > 0 and end - start + 1 >= ngram:
        for i in range(start, end - ngram + 1):        # window h[i : i+n-1] then h[i+n-1]
            same = True
            for q in range(ngram - 1):
                if h[i + q] != h[end - ngram + 1 + q]:
                    same = False
                    break
            if same:
                s[h[i + ngram - 1]] = -np.inf
    return top


@njit(cache=True, nogil=True)
def _ban(s, h, start, end, lo, hi, seq_ptr, seq_tok, banned):
    """Banned sequences lo:hi of one row: a one-token sequence's token is never drawn, a longer
    one's last token never right after the rest (the history's end). Returns how many tokens it
    banned (written to `banned`)."""
    n = 0
    for q in range(lo, hi):
        a = seq_ptr[q]
        b = seq_ptr[q + 1]
        m = b - a - 1                                 # tokens that must precede the last
        if m > end - start:
            continue
        same = True
        for i in range(m):
            if h[end - m + i] != seq_tok[a + i]:
                same = False
                break
        if same:
            s[seq_tok[b - 1]] = -np.inf
            banned[n] = seq_tok[b - 1]
            n += 1
    return n


@njit(cache=True, nogil=True, inline="always")
def _mass_change(x, e, inv_temp, top, t):
    """What token t's unguided weight, exp(raw scaled logit - top), differs from its shaped one e[t]."""
    return np.exp(np.float64(x[t] * inv_temp) - top) - np.float64(e[t])


@njit(cache=True, nogil=True)
def _unguided_mass_delta(x, e, inv_temp, top, hs, bs, boost_ids, lo, hi):
    """sum over the distinct modified tokens (the ascending `hs` and `bs`, the history with the
    word-loop bans and the sequence bans, and the ascending boost ids lo:hi, merged) of
    exp(raw scaled logit - top) - e[t]: the unguided mass they lost or gained, added in ascending
    token order. A merge, not a sort of the three together: a ban list can hold most of the
    vocabulary (a glue or healing ban), already ascending."""
    i = 0
    j = 0
    k = lo
    delta = 0.0
    while i < hs.shape[0] or j < bs.shape[0] or k < hi:
        t = np.int64(x.shape[0])
        if i < hs.shape[0]:
            t = min(t, np.int64(hs[i]))
        if j < bs.shape[0]:
            t = min(t, np.int64(bs[j]))
        if k < hi:
            t = min(t, np.int64(boost_ids[k]))
        while i < hs.shape[0] and hs[i] == t:
            i += 1
        while j < bs.shape[0] and bs[j] == t:
            j += 1
        while k < hi and boost_ids[k] == t:
            k += 1
        delta += _mass_change(x, e, inv_temp, top, t)
    return delta


@njit(cache=True, nogil=True)
def _unguided_mass_delta_dense(x, e, inv_temp, top, hs, bs, boost_ids, lo, hi):
    """`_unguided_mass_delta` where `bs` is long and in no order: each token marked once, then the
    marked ones summed in ascending order (the same terms in the same order as the merge's)."""
    mark = np.zeros(x.shape[0], np.bool_)
    for t in hs:
        mark[t] = True
    for t in bs:
        mark[t] = True
    for k in range(lo, hi):
        mark[boost_ids[k]] = True
    delta = 0.0
    for t in range(x.shape[0]):
        if mark[t]:
            delta += _mass_change(x, e, inv_temp, top, t)
    return delta


@njit(cache=True, nogil=True)
def _ascending(v) -> bool:
    """Whether `v` never goes down (a ban list is, as its table lists them)."""
    for i in range(1, v.shape[0]):
        if v[i] < v[i - 1]:
            return False
    return True


@njit(cache=True, nogil=True, inline="always")
def _sub_bucket(top, v, bb):
    """Sub-bucket (0..SUB_BUCKETS-1) of a value of bucket `bb`: the same monotone scale, SUB_BUCKETS
    times finer, clipped (float rounding can put a member a hair outside its bucket's range)."""
    d = (top - v) * np.float32(BUCKETS_PER_NAT * SUB_BUCKETS) - np.float32(bb * SUB_BUCKETS)
    if d >= SUB_BUCKETS:               # compared before the int cast: -inf (banned) is safe
        return SUB_BUCKETS - 1
    return max(int(d), 0)


@njit(cache=True, nogil=True)
def _nucleus_cut(s, e, top, hist, target, bk):
    """(smallest kept value, kept mass) for top-p over values s, weights e, their buckets bk and
    histogram.

    Buckets above the boundary bucket are wholly kept. The boundary bucket's members are
    collected (one compare pass) into SUB_BUCKETS finer buckets, and only the members of the
    finer bucket that straddles top_p are sorted: a flat distribution (high temperature, an
    untrained model) puts thousands of tokens into one bucket, and sorting them all cost 2.4x
    the whole kernel of a peaked one.
    """
    V = s.shape[0]
    cum = 0.0
    bb = 0
    while bb < N_BUCKETS - 1 and cum + hist[bb] < target:
        cum += hist[bb]
        bb += 1
    n = 0
    idx = np.empty(V, np.int32)
    for i in range(V):
        if bk[i] == bb:
            idx[n] = i
            n += 1
    if n == 0:
        return top, cum
    sub = np.zeros(SUB_BUCKETS, np.float64)
    count = np.zeros(SUB_BUCKETS, np.int64)
    q = np.empty(n, np.int32)
    for j in range(n):
        q[j] = _sub_bucket(top, s[idx[j]], bb)
        sub[q[j]] += e[idx[j]]
        count[q[j]] += 1
    qb = 0
    while qb < SUB_BUCKETS - 1 and cum + sub[qb] < target:
        cum += sub[qb]
        qb += 1
    while count[qb] == 0:               # rounding ran the walk past the last member: step back
        qb -= 1
        cum -= sub[qb]
    m = 0
    for j in range(n):                  # the straddling sub-bucket's members, in place
        if q[j] == qb:
            idx[m] = idx[j]
            m += 1
    vals = np.empty(m, np.float32)
    for j in range(m):
        vals[j] = s[idx[j]]
    order = np.argsort(-vals)
    cut = vals[order[m - 1]]
    walk = cum
    for j in range(m):
        walk += e[idx[order[j]]]
        if walk >= target:
            cut = vals[order[j]]
            break
    mass = cum
    for j in range(m):                  # ties with the cut are kept too (a tie shares its sub-bucket)
        if vals[j] >= cut:
            mass += e[idx[j]]
    return cut, mass


@njit(cache=True, nogil=True, fastmath={"reassoc", "nsz", "contract"})
def _block_masses(s, e, cut, out):
    """out[b] = the kept weight (s >= cut) of tokens b*DRAW_BLOCK up to the next block, in float64.
    Branch-free and reassociated, so that LLVM vectorises it: its own function, for its fastmath."""
    V = s.shape[0]
    for b in range(out.shape[0]):
        acc = 0.0
        for i in range(b * DRAW_BLOCK, min(V, (b + 1) * DRAW_BLOCK)):
            acc += np.float64(e[i]) * np.float64(s[i] >= cut)
        out[b] = acc


@njit(cache=True, nogil=True)
def _walk(s, e, cut, bs, u):
    """The first kept token (s >= cut, e > 0; a ban's weight is 0) in id order at which the
    cumulative kept weight exceeds u, or the last kept token if none does (rounding), given the
    kept weight's block sums `bs` (`_block_masses`, which the rows drawing from one distribution
    share).

    Block sums first, then a walk of one block: a flat row keeps a random ~70% of the vocabulary,
    and a token-by-token walk mispredicted its branch on each and waited on one float64 chain of
    adds (105 us per 50257-token row against 10 us this way; a peaked row, 9.5 us either way).
    The block sums round differently from a token-by-token sum, so a draw can differ from it only
    when u lies within float64 rounding of a token's boundary."""
    V = s.shape[0]
    nb = bs.shape[0]
    cum = 0.0
    b = 0
    while b < nb - 1 and cum + bs[b] <= u:
        cum += bs[b]
        b += 1
    chosen = -1
    for i in range(b * DRAW_BLOCK, V):
        if s[i] >= cut and e[i] > 0.0:
            cum += e[i]
            chosen = i
            if cum > u:
                return chosen
    if chosen < 0:                          # nothing kept from block b on: the last kept before it
        for i in range(b * DRAW_BLOCK - 1, -1, -1):
            if s[i] >= cut and e[i] > 0.0:
                return i
    return chosen


@njit(cache=True, nogil=True)
def _likeliest(s, e, cut, K):
    """The kept tokens (s >= cut, e > 0) of the K largest weights, descending (the first in id order
    among equals), and how many tokens are kept: the greedy draws' choices (temperature 0)."""
    best_w = np.zeros(K, np.float32)
    best_i = np.full(K, -1, np.int64)
    n = 0                                    # kept tokens so far
    for i in range(s.shape[0]):
        if s[i] >= cut and e[i] > 0.0:
            n += 1
            w = e[i]
            if n <= K or w > best_w[K - 1]:
                j = min(n, K) - 1
                while j > 0 and best_w[j - 1] < w:
                    best_w[j] = best_w[j - 1]
                    best_i[j] = best_i[j - 1]
                    j -= 1
                best_w[j] = w
                best_i[j] = i
    return best_i, n


@njit(cache=True, nogil=True)
def _mode(best_i, n, rank):
    """A greedy draw: the kept token of the `rank`-th largest weight (0: the largest), counted round
    the `n` kept tokens where there are fewer; `best_i` from `_likeliest` with K > rank."""
    if n == 0:
        return -1
    return best_i[rank % n] if n < best_i.shape[0] else best_i[rank]


@njit(cache=True, nogil=True, fastmath={"reassoc", "nsz", "contract"})
def _boost_kept(s, e, cut, f):
    """e[i] *= f[i] for the kept tokens (s[i] >= cut), f = exp(the row's boost) per token (1.0
    where it has none); returns the weight added, in float64. A dense pass over the vocabulary,
    branch-free and reassociated, so that LLVM vectorises it (its own function, for its fastmath):
    a guide word's boost table holds ~60% of GPT-2's vocabulary (every token with a positive
    similarity), and walking it id by id with one libm exp per kept token cost ~200 us per
    guided flat row, against ~15 us this way."""
    added = 0.0
    for i in range(s.shape[0]):
        old = e[i]
        new = old * f[i] if s[i] >= cut else old
        added += np.float64(new) - np.float64(old)
        e[i] = new
    return added


@njit(cache=True, nogil=True, fastmath={"reassoc", "nsz", "contract"})
def _unboosted_mass(e, f):
    """sum of e[i] / f[i] in float64: a boost-first row's weights without their boosts (f = exp(the
    row's boost), 1.0 where none), i.e. its unguided mass. One vectorised pass; the sparse way
    (subtract each boosted weight, add back one libm exp of its raw logit) cost ~30k exps per
    guided row of GPT-2 and subtracted weights up to e^20 from a mass of order 1."""
    acc = 0.0
    for i in range(e.shape[0]):
        acc += np.float64(e[i]) / np.float64(f[i])
    return acc


@njit(cache=True, nogil=True)
def _top(s):
    """The largest of `s` (-inf where everything is banned)."""
    m = np.float32(-np.inf)
    for i in range(s.shape[0]):
        m = max(m, s[i])
    return m


@njit(cache=True, nogil=True, inline="always")
def _scale(x, inv_temp, s):
    """s = x / T; returns the row's max."""
    m = np.float32(-np.inf)
    for i in range(x.shape[0]):
        s[i] = x[i] * inv_temp
        m = max(m, s[i])
    return m


@njit(cache=True, nogil=True)
def _loop_bans(s, h, start, end, words, window):
    """The word-loop rule into `s`: returns the tokens it banned."""
    if window <= 0:
        return np.empty(0, np.int32)
    word_class, key, key_ptr, key_tok = words
    loops = word_loop_tokens(h, start, end, word_class, key, key_ptr, key_tok, window).astype(np.int32)
    for t in loops:
        s[t] = -np.inf
    return loops


@njit(cache=True, nogil=True)
def _sequence_bans(s, h, start, end, g, bans):
    """The row's ban group `g` (-1: none) into `s`: the tokens it banned."""
    row_ban, ban_ptr, seq_ptr, seq_tok = bans
    if g < 0:
        return np.empty(0, np.int32)
    banned = np.empty(ban_ptr[g + 1] - ban_ptr[g], np.int32)
    n = _ban(s, h, start, end, ban_ptr[g], ban_ptr[g + 1], seq_ptr, seq_tok, banned)
    return banned[:n]


@njit(cache=True, nogil=True)
def _own_top(s, min_p):
    """The largest of the model's own (scaled, shaped, unboosted) logits, which min_p is relative
    to; -inf when min_p is off (nothing read)."""
    return _top(s) if min_p > 0.0 else np.float32(-np.inf)


@njit(cache=True, nogil=True)
def _boost_first(s, top, boost_ids, boost_vals, lo, hi):
    """Boost then filter: the guide word's boosts added to `s`; returns the new max."""
    for j in range(lo, hi):
        t = boost_ids[j]
        s[t] += boost_vals[j]
        top = max(top, s[t])
    return top


@njit(cache=True, nogil=True)
def _min_p_drop(e, f, boosted, floor):
    """min_p: zero the weight of the tokens whose own weight (e, or e / f where `boosted`: f =
    exp(boost) of a boost-first row) is below `floor` (min_p times the top token's own weight).
    `_nucleus_cut` and the draw then read zero weights as gone."""
    for i in range(e.shape[0]):
        if e[i] > 0.0:
            own = np.float64(e[i]) / np.float64(f[i]) if boosted else np.float64(e[i])
            if own < floor:
                e[i] = 0.0


@njit(parallel=True, cache=True)
def _sample_rows(logits, table_row, group_ptr, members, uniforms, guide, history, bans, words, knobs, out_ids,
                 out_logp):
    """One draw per row r of logits[table_row[r]], by named steps: scale, shape (logit bias,
    penalties, word loops, banned sequences), boost (boost-first rows), weigh, the model's own
    log-normaliser, then (unless the token is forced) filter (min-p, then top-p of what it keeps),
    boost the kept (filter-then-boost rows) and draw. Rows that read the same logits under the same rules (the
    group members[group_ptr[g]:group_ptr[g + 1]], `row_groups`) are shaped, weighed and filtered
    once, by the group's first row, and each draws with its own uniform (or takes its forced token).
    The rule groups are tuples (`sample` packs them from a StepRules):
    guide = (row_word, boost_ptr, boost_ids, boost_vals, boost_exp, row_dense, boost_first, force, rank),
    history = (tokens, start, generated start), bans = (row_ban, group_ptr, seq_ptr, seq_tok),
    words = (word_class, key, key_ptr, key_tok), knobs = (1/T, top_p, min_p, penalty, presence,
    frequency (each (R,)), ngram, window, shaped (R,), greedy (R,), the logit-bias sets (ptr, token
    ids ascending per set, biases), each row's set (R,), -1: none); a greedy draw (temperature 0,
    1/T then 1) takes the kept token of the row's `rank`-th largest weight (`_mode`; 0: the largest),
    from the group's likeliest (`_likeliest`, one pass)."""
    row_word, boost_ptr, boost_ids, boost_vals, boost_exp, row_dense, boost_first, force, rank = guide
    hseq, hstart, hgen = history
    row_ban = bans[0]
    row_inv_temp, row_top_p, row_min_p, row_penalty, row_presence, row_frequency, ngram, window, row_shaped, \
        row_greedy, bias_ptr, all_bias_ids, all_bias_vals, row_bias = knobs
    V = logits.shape[1]
    hend = hseq.shape[1]
    for g in prange(group_ptr.shape[0] - 1):
        r = members[group_ptr[g]]            # the group's rules are its first row's
        x = logits[table_row[r]]
        inv_temp, top_p, greedy, shaped = row_inv_temp[r], row_top_p[r], row_greedy[r], row_shaped[r]
        penalty, presence, frequency = row_penalty[r], row_presence[r], row_frequency[r]
        b = row_bias[r]                      # the row's logit-bias set (-1: none)
        b0 = bias_ptr[b] if b >= 0 else 0
        b1 = bias_ptr[b + 1] if b >= 0 else 0
        bias_ids, bias_vals = all_bias_ids[b0:b1], all_bias_vals[b0:b1]
        s = np.empty(V, np.float32)          # scaled, shaped (and, boost-first, boosted) logits
        e = np.empty(V, np.float32)          # exp(s - top): unnormalised weights
        top = _bias(x, s, inv_temp, bias_ids, bias_vals, _scale(x, inv_temp, s))
        w = row_word[r]
        lo = boost_ptr[w] if w >= 0 else 0
        hi = boost_ptr[w + 1] if w >= 0 else 0
        if shaped:
            top = max(top, _penalise(x, s, inv_temp, hseq[r], hstart[r], hgen[r], hend, penalty, presence, frequency,
                                     ngram, bias_ids, bias_vals))
        loops = _loop_bans(s, hseq[r], hstart[r], hend, words, window)
        banned = _sequence_bans(s, hseq[r], hstart[r], hend, row_ban[r], bans)
        min_p = row_min_p[r]
        own_top = _own_top(s, min_p)
        bf = boost_first[r]
        if bf:
            top = _boost_first(s, top, boost_ids, boost_vals, lo, hi)
        hist = np.empty(N_BUCKETS, np.float64)
        bk = np.empty(V, np.int16)           # histogram bucket of each token
        _exp_below(s, top, e, np.empty(V, np.int32), bk)     # weights and buckets (vectorised),
        total = _mass_histogram(bk, e, hist)                 # their sum and histogram
        unguided = total                     # the log-prob returned is the unguided one:
        if shaped or len(banned) > 0 or len(bias_ids) > 0:   # undo the bias, penalties, bans, boost-first boosts
            hs = np.sort(np.concatenate((hseq[r, hstart[r]:hend] if shaped else hseq[r, 0:0], loops, bias_ids)))
            blo = lo if bf else hi           # a boost-first row's boosts changed its weights too
            ascending = _ascending(banned)
            if ascending or banned.shape[0] <= SHORT_BANS:
                unguided += _unguided_mass_delta(x, e, inv_temp, top, hs, banned if ascending else np.sort(banned),
                                                 boost_ids, blo, hi)
            else:                            # runs of bans joined (glue, then sentence ends): by a mark
                unguided += _unguided_mass_delta_dense(x, e, inv_temp, top, hs, banned, boost_ids, blo, hi)
        elif bf and w >= 0:                  # each weight divided by its exp(boost): no cancellation
            unguided = _unboosted_mass(e, boost_exp[row_dense[r]])
        logz = top + np.log(unguided)
        if total < FAR_BELOW:                # every allowed token more than half the span below a banned
            allowed = _top(s)                # or penalised top (at a low temperature their weights
            if allowed > -np.inf:            # underflow): weigh from the best allowed one
                top = allowed
                _exp_below(s, top, e, np.empty(V, np.int32), bk)
                total = _mass_histogram(bk, e, hist)
        free = 0
        for j in range(group_ptr[g], group_ptr[g + 1]):
            m = members[j]
            if force[m] >= 0:                # a forced token (a deadline or a phrase's rest)
                out_ids[m] = force[m]
                out_logp[m] = x[force[m]] * inv_temp - logz
            else:
                free += 1
        if free == 0:
            continue
        if min_p > 0.0:                      # the model's implausible tokens out, then top-p of the rest
            boosted = bf and w >= 0
            _min_p_drop(e, boost_exp[row_dense[r] if boosted else 0], boosted,
                        min_p * np.exp(np.float64(own_top) - np.float64(top)))
            total = _mass_histogram(bk, e, hist)
        if top_p < 1.0:                      # the boundary bucket only + a sort of it
            cut, mass = _nucleus_cut(s, e, top, hist, top_p * total, bk)
        else:
            cut, mass = np.float32(-np.inf), total
        if not bf and w >= 0:                # kept tokens' weights times exp(boost)
            mass += _boost_kept(s, e, cut, boost_exp[row_dense[r]])
        if greedy:                           # the group's likeliest kept tokens, once for its draws
            K = 1
            for j in range(group_ptr[g], group_ptr[g + 1]):
                if force[members[j]] < 0:
                    K = max(K, rank[members[j]] + 1)
            best_i, n_kept = _likeliest(s, e, cut, K)
            bs = np.empty(0, np.float64)
        else:                                # the walk's block sums, once for the group's draws
            best_i, n_kept = np.empty(0, np.int64), 0
            bs = np.empty((V + DRAW_BLOCK - 1) // DRAW_BLOCK, np.float64)
            _block_masses(s, e, cut, bs)
        for j in range(group_ptr[g], group_ptr[g + 1]):
            m = members[j]
            if force[m] < 0:
                chosen = _mode(best_i, n_kept, rank[m]) if greedy else _walk(s, e, cut, bs, uniforms[m] * mass)
                out_ids[m] = chosen
                out_logp[m] = x[chosen] * inv_temp - logz


@njit(parallel=True, cache=True)
def _top_tokens(logits, table_rows, K, out_ids, out_vals):
    """The K largest logits of each row logits[table_rows[r]], largest first (ties: the lower
    id first): one pass over the row with the K best kept in order (K is small)."""
    V = logits.shape[1]
    for r in prange(table_rows.shape[0]):
        x = logits[table_rows[r]]
        n = 0
        for t in range(V):
            v = x[t]
            if n == K and not v > out_vals[r, K - 1]:
                continue
            j = min(n, K - 1)                    # insertion point, from the end
            while j > 0 and v > out_vals[r, j - 1]:
                out_vals[r, j] = out_vals[r, j - 1]
                out_ids[r, j] = out_ids[r, j - 1]
                j -= 1
            out_vals[r, j] = v
            out_ids[r, j] = t
            n = min(n + 1, K)


def top_tokens(logits: np.ndarray, K: int, rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The K likeliest tokens of each row of `logits` (R, V) (with `rows`, of logits[rows[r]]):
    ids (R, K) int64, largest logit first, and those logits (R, K) float32."""
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    table_rows = np.arange(len(logits)) if rows is None else np.asarray(rows, np.int64)
    ids = np.zeros((len(table_rows), K), np.int64)
    vals = np.full((len(table_rows), K), -np.inf, np.float32)
    if K:
        _top_tokens(logits, table_rows, K, ids, vals)
    return ids, vals


@dataclass(frozen=True)
class StepRules:
    """What one step's draw obeys, built once per step by the search (`BeamSearch._draw`) and read
    by every backend's sampler (`sample` here, `TorchBackend.sample`).

    `config`: the search's settings the draw reads (a `DBSConfig`): temperature, top_p, min_p,
    repetition_penalty, presence and frequency penalties, logit_bias, no_repeat_ngram_size,
    no_repeat_word_window, boost_order; `shaped` says which rows' logits the penalties and bans
    shape. Per row
    (R rows):
    - guidance: `row_word[r]` indexes the CSR boost table `boosts` = (ptr, ids ascending per word,
      vals), or is -1 for an unguided row; `boost_exp` is `dense_boosts` of the whole table if the
      caller keeps one (else built per call for the words the rows use); `boost_first`, one bool
      or one per row (None: the config's boost_order); `force[r]` >= 0 makes the row emit that
      token (its returned log-prob is still the model's own; its uniform is then unused);
    - history: `history` (R, H), each row's tokens so far (context + generated), its own from
      `history_start[r]` (left padding before), the ones it generated from `generated_start[r]`
      (None: its own; the presence and frequency penalties count only these); needed only by the
      penalties and by bans of more than one token;
    - bans: `bans` = (group_ptr, seq_ptr, seq_tok): group g holds banned token sequences
      group_ptr[g]:group_ptr[g+1], sequence q is seq_tok[seq_ptr[q]:seq_ptr[q+1]]; `row_ban[r]` is
      the row's group or -1. A banned one-token sequence is never drawn; a longer one's last token
      is never drawn when the history ends with the rest;
    - `words`: the vocabulary's words (`occurrence.WordTable`), for the word-loop rule;
    - `row_min_p` (R,): each row's min_p, its request's (`request.min_p_of`); None: the config's;
    - `row_sampling`: `config.OWN_SAMPLING` name -> (R,) each row's, its request's (temperature
      (0: greedy), top_p, repetition, presence and frequency penalties); one absent: the config's;
    - `bias_sets` (`config.bias_table`: CSR of logit-bias sets) and `row_bias` (R,): each row's
      set, its request's (-1: none); None: the config's `logit_bias` for every row;
    - `rank` (R,): at temperature 0, row r takes the rank[r]-th likeliest kept token (0: the
      likeliest; counted round the kept tokens where there are fewer), so that rows that would
      draw from one distribution take its likeliest tokens in turn (`search.beam.greedy_ranks`);
      None: all 0.
    A new rule is a config field (or a field here) and a helper in the kernel; no signature changes."""

    config: DBSConfig
    row_word: np.ndarray | None = None
    boosts: tuple | None = None
    boost_exp: np.ndarray | None = None
    boost_first: np.ndarray | bool | None = None
    force: np.ndarray | None = None
    history: np.ndarray | None = None
    history_start: np.ndarray | None = None
    bans: tuple | None = None
    row_ban: np.ndarray | None = None
    words: tuple | None = None
    row_min_p: np.ndarray | None = None
    rank: np.ndarray | None = None
    generated_start: np.ndarray | None = None
    row_sampling: dict | None = None
    bias_sets: tuple | None = None
    row_bias: np.ndarray | None = None

    @classmethod
    def given(cls, config: DBSConfig | None = None, **rules) -> "StepRules":
        """Rules from keywords: the config's settings by their names (temperature, top_p, min_p,
        repetition_penalty, ...) over `config` (if None, the default with no penalties), the rest
        as fields."""
        names = {f.name for f in fields(DBSConfig)}
        settings = {k: rules.pop(k) for k in list(rules) if k in names}
        config = config or DBSConfig(repetition_penalty=1.0, no_repeat_ngram_size=0, no_repeat_word_window=0)
        return cls(replace(config, **settings), **rules)

    def boost_firsts(self, R: int) -> np.ndarray:
        """(R,) bool: the rows that boost before filtering."""
        bf = self.config.boost_order == "boost_then_filter" if self.boost_first is None else self.boost_first
        return np.broadcast_to(np.asarray(bf, bool), (R,)).copy()

    def starts(self, R: int) -> tuple[np.ndarray, np.ndarray]:
        """(R,) int32 each: where each row's own tokens start in `history`, and its generated ones."""
        start = np.zeros(R, np.int32) if self.history_start is None else np.asarray(self.history_start, np.int32)
        gen = start if self.generated_start is None else np.maximum(np.asarray(self.generated_start, np.int32), start)
        return start, gen

    def ranks(self, R: int) -> np.ndarray:
        """(R,) int64: each row's rank at temperature 0 (0: the likeliest kept token)."""
        return np.zeros(R, np.int64) if self.rank is None else np.ascontiguousarray(self.rank, np.int64)

    def min_ps(self, R: int) -> np.ndarray:
        """(R,) float64: each row's min_p."""
        if self.row_min_p is None:
            return np.full(R, self.config.min_p, np.float64)
        return np.ascontiguousarray(self.row_min_p, np.float64)

    def per_row(self, name: str, R: int) -> np.ndarray:
        """(R,) float64: each row's setting `name` (one of `config.OWN_SAMPLING`)."""
        v = (self.row_sampling or {}).get(name, getattr(self.config, name))
        return np.broadcast_to(np.asarray(v, np.float64), (R,)).copy()

    def temperatures(self, R: int) -> np.ndarray:
        """(R,) float64: each row's temperature (0: greedy)."""
        return self.per_row("temperature", R)

    def inv_temperatures(self, R: int) -> np.ndarray:
        """(R,) float32: 1 / the temperature each row scales its logits by (`config.inv_temperature`)."""
        return inv_temperature(self.temperatures(R)).astype(np.float32)

    def top_ps(self, R: int) -> np.ndarray:
        """(R,) float64: each row's top_p."""
        return self.per_row("top_p", R)

    def penalties(self, R: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(R,) float32 each: each row's repetition, presence and frequency penalties."""
        return tuple(self.per_row(n, R).astype(np.float32) for n in PENALTIES)

    def biases(self, R: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(ptr, token ids, biases, row_bias (R,) int64): the logit-bias sets and each row's (-1: none)."""
        if self.row_bias is None:
            table = self.config.logit_bias_table
            return *table, np.full(R, 0 if len(table[0]) > 1 else -1, np.int64)
        return (*(np.asarray(a, t) for a, t in zip(self.bias_sets, (np.int64, np.int32, np.float32))),
                np.ascontiguousarray(self.row_bias, np.int64))

    def shaped(self, R: int, penalties: tuple | None = None) -> np.ndarray:
        """(R,) bool: the rows whose logits the penalties, n-gram bans or word loops shape
        (`penalties`: `self.penalties(R)`, if the caller has them)."""
        return np.broadcast_to(self.config.shapes_with(*(penalties or self.penalties(R))), (R,)).copy()

    @property
    def multi_token_bans(self) -> bool:
        """Whether a ban holds a sequence of more than one token (it then reads the history)."""
        if self.bans is None or self.row_ban is None:
            return False
        seq_ptr = self.bans[1]
        return int(seq_ptr[-1] - seq_ptr[0]) > len(seq_ptr) - 1     # more tokens than sequences


def sample(logits: np.ndarray, uniforms: np.ndarray, rules: StepRules,
           rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Draw one token per row of `logits` (R, V) float32 under `rules`, from the given uniforms
    (R,); returns (ids (R,) int64, the model's own log-probs (R,) float32). With `rows` (R,),
    row r's logits are logits[rows[r]] instead (a table that rows with one history share, read in
    place: `backend.RowLogits`)."""
    cfg = rules.config
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    V = logits.shape[1]
    table_row = np.arange(len(logits)) if rows is None else np.asarray(rows, np.int64)
    R = len(table_row)
    guide = _guide(rules, R, V)
    assert uniforms.shape == (R,) and guide[0].shape == (R,)
    history = _history(rules, R)
    if cfg.no_repeat_word_window > 0 and rules.words is None:
        raise ValueError("no_repeat_word_window needs the vocabulary's words (occurrence.WordTable)")
    words = rules.words if rules.words is not None else (np.zeros(1, np.int8), np.full(1, -1, np.int32),
                                                         np.zeros(1, np.int64), np.zeros(0, np.int32))
    words = tuple(np.asarray(a, t) for a, t in zip(words, (np.int8, np.int32, np.int64, np.int32)))
    if rules.bans is None or rules.row_ban is None:
        bans = (np.full(R, -1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(0, np.int32))
    else:
        bans = (np.asarray(rules.row_ban, np.int64), *(np.asarray(a, t) for a, t in zip(rules.bans, (np.int64, np.int64,
                                                                                                      np.int32))))
    temperature, penalties = rules.temperatures(R), rules.penalties(R)     # each read once a step
    knobs = (inv_temperature(temperature).astype(np.float32), rules.top_ps(R), rules.min_ps(R), *penalties,
             int(cfg.no_repeat_ngram_size), int(cfg.no_repeat_word_window),
             rules.shaped(R, penalties), temperature == 0, *rules.biases(R))
    group_ptr, members = row_groups(table_row, guide, history, bans[0], *knobs[:6], *knobs[8:10], knobs[13])
    start_threads()
    out_ids = np.empty(R, np.int64)
    out_logp = np.empty(R, np.float32)
    _sample_rows(logits, table_row, group_ptr, members, uniforms.astype(np.float64), guide, history, bans, words,
                 knobs, out_ids, out_logp)
    return out_ids, out_logp


def warm_up() -> None:
    """One draw on a tiny input, which compiles the sampler into Numba's cache or loads it from
    there: `sample` passes the kernel the same types whatever the rules, so this is the compilation
    that a first generation would do (`numba_runtime.compiled_meanwhile`)."""
    sample(np.zeros((2, 4), np.float32), np.full(2, 0.5), StepRules.given())


def row_groups(table_row, guide, history, row_ban, *row_settings) -> tuple[np.ndarray, np.ndarray]:
    """The rows that draw from one distribution, as CSR groups (group_ptr, members): the same
    logits row under the same rules (guide word, boost order, ban group, each of `row_settings`
    ((R,) arrays: 1/T, top_p, min_p, the penalties, shaped, greedy, the logit-bias set), and the
    history where a rule reads it); a forced token or a uniform does not shape the distribution,
    so rows that differ only there share a group. Each group in the order of its first row."""
    R = len(table_row)
    if R < 2 or len(np.unique(table_row)) == R:        # no logits row shared: a group per row
        return np.arange(R + 1, dtype=np.int64), np.arange(R, dtype=np.int64)
    row_word, boost_first = guide[0], guide[6]
    hseq, hstart, hgen = history
    settings = [np.ascontiguousarray(v, np.float64).view(np.int64) for v in row_settings]
    key = np.column_stack([table_row, row_word, boost_first, *settings, row_ban, hstart, hgen,
                           hseq]).astype(np.int64, copy=False)
    _, first, inverse = np.unique(key, axis=0, return_index=True, return_inverse=True)
    rank = np.empty(len(first), np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first))     # groups by their first row
    group = rank[inverse.reshape(-1)]
    members = np.argsort(group, kind="stable")
    return np.concatenate([[0], np.cumsum(np.bincount(group, minlength=len(first)))]).astype(np.int64), members


def _guide(rules: StepRules, R: int, V: int) -> tuple:
    """The kernel's guidance group: (row_word, boost_ptr, boost_ids, boost_vals, boost_exp, row_dense, boost_first, force,
    rank)."""
    if rules.row_word is None:
        row_word = np.full(R, -1, np.int32)
        ptr, ids, vals = np.zeros(1, np.int64), np.zeros(0, np.int32), np.zeros(0, np.float32)
    else:
        row_word = np.asarray(rules.row_word, np.int32)
        ptr, ids, vals = (np.asarray(a, t) for a, t in zip(rules.boosts, (np.int64, np.int32, np.float32)))
    if rules.boost_exp is None:              # only the words these rows use
        used, row_dense = np.unique(row_word, return_inverse=True)
        row_dense = row_dense.reshape(-1).astype(np.int32)
        if len(used) and used[0] < 0:
            used, row_dense = used[1:], row_dense - 1
        boost_exp = dense_boosts(ptr, ids, vals, V, used)
    else:
        boost_exp, row_dense = rules.boost_exp, row_word
    force = np.full(R, -1, np.int64) if rules.force is None else np.asarray(rules.force, np.int64)
    return row_word, ptr, ids, vals, boost_exp, row_dense, rules.boost_firsts(R), force, rules.ranks(R)


def _history(rules: StepRules, R: int) -> tuple:
    """The kernel's history group (tokens (R, H) int32, start (R,) int32, generated start (R,)
    int32): empty unless a rule reads it."""
    shaped, multi = bool(rules.shaped(R).any()), rules.multi_token_bans
    if shaped and rules.history is None:
        raise ValueError("repetition_penalty / presence_penalty / frequency_penalty / no_repeat_ngram_size / "
                         "no_repeat_word_window need the rows' token history")
    if multi and rules.history is None and (np.asarray(rules.row_ban) >= 0).any():
        raise ValueError("bans of more than one token need the rows' token history")
    if not (shaped or multi) or rules.history is None:
        return np.zeros((R, 0), np.int32), np.zeros(R, np.int32), np.zeros(R, np.int32)
    return np.ascontiguousarray(rules.history, dtype=np.int32), *rules.starts(R)


def dense_boosts(ptr, ids, vals, V: int, words=None, exp: bool = True) -> np.ndarray:
    """The CSR table's rows `words` (all if None) as a dense (len(words), V) float32 table:
    exp(boost) per token, 1.0 where none (`exp`; lambda <= 80, so exp fits), else the boost, 0.0
    where none. The kernel's filter-then-boost pass (`_boost_kept`), its boost-first rows'
    unguided mass (`_unboosted_mass`) and min_p read exp(boost) densely; the PyTorch sampler adds
    the boosts. ~50 us per word to build, so a caller with a fixed table builds it once."""
    words = range(len(ptr) - 1) if words is None else words
    dense = np.full((len(words), V), 1.0 if exp else 0.0, np.float32)
    for k, w in enumerate(words):
        v = vals[ptr[w]:ptr[w + 1]]
        dense[k, ids[ptr[w]:ptr[w + 1]]] = np.exp(v) if exp else v
    return dense


def csr_boosts(boosts) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pack a list of SparseBoost into the kernel's CSR arrays (ptr, ids, vals)."""
    ptr = np.zeros(len(boosts) + 1, np.int64)
    for i, b in enumerate(boosts):
        ptr[i + 1] = ptr[i] + len(b.ids)
    ids = np.concatenate([b.ids for b in boosts]).astype(np.int32) if boosts else np.zeros(0, np.int32)
    vals = np.concatenate([b.values for b in boosts]).astype(np.float32) if boosts else np.zeros(0, np.float32)
    return ptr, ids, vals
