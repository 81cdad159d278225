"""Fixed-lag commit (`stream_lag`): text that streams before the request ends.

After each chunk, a request's best kept beam (by Q) that goes on commits its tokens older than the
lag (in tokens, `DBSConfig.lag_tokens`: a lag under one chunk commits after the first), and none
of the last tokens of its budget that an answer the budget ends may be cut back into
(`DBSConfig.commit_within`: a text that stops at EOS is then cut back to a sentence end as an
unstreamed one is, where the streams of the chat set had ended in the last third of the budget at
their first sentence end after their words, at 1.61x the judge's perplexity of the model's own
answers against 1.43x unstreamed, where the message leaves the words out). A beam that
ended at EOS before its words does not commit (copies of it would end the stream there, without
them; where every kept beam did, `quality.keep_going` has put the best candidate that goes on in
the worst one's place). The kept beams that disagree with the committed tokens are replaced by
copies of the best one, which draw candidates of their own next chunk (scored as it is: a lag
that holds back part of a chunk leaves few beams that agree, and copies scored -inf left the
stream one beam's s candidates, 0.963 of the chat set's words against 0.993 unstreamed), and its
set-aside finished candidates and copies near the budget that disagree are dropped. Once a
request has set a finished answer aside, nothing more is committed, so that the pick among its
finished answers is made at the end, as unstreamed (committing on dropped the answers that ended
before the best beam that went on, and streamed chat answers ran 1.1x as long as unstreamed). Every row and candidate that can still
be returned then starts with the committed tokens, so they stream at once, and the result never
trims back into them. Off (lag 0) nothing changes."""
from __future__ import annotations

import numpy as np

from .rows import Rows


def agrees(rows: Rows, i: int, prefix: np.ndarray) -> bool:
    """Whether row i's generated tokens start with `prefix`."""
    g = rows.generated(i)
    return len(g) >= len(prefix) and np.array_equal(g[:len(prefix)], prefix)


def commit(rows: Rows, keep: np.ndarray, slots: list, stay: np.ndarray, lag: int, upto: np.ndarray):
    """The kept rows `keep` (indices into `rows`) after committing, for each request q with
    `stay[q]`, its best kept beam's tokens but its last `lag`, and no more than `upto[q]`
    (`slots[q].committed` grows to their count; lag 0: nothing)."""
    keep = keep.copy()
    if not lag:
        return keep
    for q in np.flatnonzero(stay):
        slot = slots[q]
        if slot.pool:           # a finished answer set aside: the pick among them is made at the end
            continue
        at = np.flatnonzero(rows.req[keep] == q)
        live = at[np.isfinite(rows.cum[keep[at]])]
        going = live[~rows.ended[keep[live]]]                # not ended at EOS before the words
        live = going if len(going) else live
        if not len(live):
            continue
        best = keep[live[np.argmax(rows.cum[keep[live]])]]
        g = rows.generated(best)
        n = min(len(g) - lag, int(upto[q]))
        if n <= slot.committed:
            continue
        prefix = g[:n]
        for j in at:
            if not agrees(rows, keep[j], prefix):
                keep[j] = best
        slot.drop_kept(lambda part, i: not agrees(part, i, prefix))
        slot.committed = n
    return keep
