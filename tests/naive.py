"""Plain NumPy references of the kernels (full sort, float64), compared with them in tests."""
import numpy as np


def sample_ref(logits, uniforms, temperature=1.0, top_p=0.9, dense_boosts=None, boost_first=False):
    """dense_boosts: list per row of a (V,) boost vector or None."""
    R, V = logits.shape
    ids = np.empty(R, np.int64)
    logp = np.empty(R, np.float64)
    inv_t = np.float32(1.0 / temperature)
    for r in range(R):
        s = (logits[r].astype(np.float32) * inv_t)
        m = s.max()
        logz = float(m) + np.log(np.exp((s - m).astype(np.float64)).sum())
        b = None if dense_boosts is None else dense_boosts[r]
        key = s.astype(np.float64) + (b if (b is not None and boost_first) else 0.0)
        key = key.astype(np.float32) if (b is not None and boost_first) else s
        if top_p < 1.0:
            w = np.exp(key.astype(np.float64) - float(m))
            order = np.argsort(-key, kind="stable")
            cum = np.cumsum(w[order])
            k = int(np.searchsorted(cum, top_p * cum[-1]))
            cut = key[order[min(k, V - 1)]]
            kept = key >= cut
        else:
            kept = np.ones(V, bool)
        final = key.astype(np.float64)
        if b is not None and not boost_first:
            final = final + np.where(kept, b, 0.0)
        w = np.where(kept, np.exp(final - float(m)), 0.0)
        c = np.cumsum(w)
        ids[r] = min(int(np.searchsorted(c, uniforms[r] * c[-1], side="right")), V - 1)
        logp[r] = float(s[ids[r]]) - logz
    return ids, logp
