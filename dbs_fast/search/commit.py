"""Fixed-lag commit (`stream_lag`): text that streams before the request ends.

After each chunk, a request's best kept beam (by Q) that goes on commits its tokens older than the
lag (in tokens, `DBSConfig.lag_tokens`: a lag under one chunk commits after the first). A beam that
ended at EOS before its words does not commit (copies of it would end the stream there, without
them; where every kept beam did, `quality.keep_going` has put the best candidate that goes on in
the worst one's place). The kept beams that disagree with the committed tokens are replaced by
copies of the best one, which draw candidates of their own next chunk (scored as it is: a lag
that holds back part of a chunk leaves few beams that agree, and copies scored -inf left the
stream one beam's s candidates, 0.963 of the chat set's words against 0.993 unstreamed), and its
set-aside finished candidates that disagree are dropped. Every row and candidate that can still
be returned then starts with the committed tokens, so they stream at once, and the result never
trims back into them. Off (lag 0) nothing changes."""
from __future__ import annotations

import numpy as np

from .rows import Rows


def agrees(rows: Rows, i: int, prefix: np.ndarray) -> bool:
    """Whether row i's generated tokens start with `prefix`."""
    g = rows.generated(i)
    return len(g) >= len(prefix) and np.array_equal(g[:len(prefix)], prefix)


def commit(rows: Rows, keep: np.ndarray, slots: list, stay: np.ndarray, lag: int):
    """The kept rows `keep` (indices into `rows`) after committing, for each request q with
    `stay[q]`, its best kept beam's tokens but its last `lag` (`slots[q].committed` grows to their
    count; lag 0: nothing)."""
    keep = keep.copy()
    if not lag:
        return keep
    for q in np.flatnonzero(stay):
        at = np.flatnonzero(rows.req[keep] == q)
        live = at[np.isfinite(rows.cum[keep[at]])]
        going = live[~rows.ended[keep[live]]]                # not ended at EOS before the words
        live = going if len(going) else live
        if not len(live):
            continue
        best = keep[live[np.argmax(rows.cum[keep[live]])]]
        g = rows.generated(best)
        n = len(g) - lag
        slot = slots[q]
        if n <= slot.committed:
            continue
        prefix = g[:n]
        for j in at:
            if not agrees(rows, keep[j], prefix):
                keep[j] = best
        slot.drop_pooled(lambda part, i: not agrees(part, i, prefix))
        slot.committed = n
    return keep
