"""Distinct rows: the candidates of a beam that drew the same tokens so far are one sequence, with
the same logits and the same next K/V, so a decode step computes one row per distinct history.

A slot's history is named by a group id that follows from its parent's group and the token it
draws (no hashing of whole histories): at a chunk boundary the copies of one kept candidate share
a group; at each step, the slots that share a group and draw the same token share the next one.
"""
from __future__ import annotations

import numpy as np


def distinct_rows(group: np.ndarray, ids: np.ndarray, need: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows a decode step computes for slots in history groups `group` (N,) (-1: a slot whose
    history no row holds any more) taking tokens `ids` (N,), of which the slots in `need` (N,)
    bool read their logits. Returns `new_group` (N,): each slot's group after the step, the index
    of the row that computes it (-1: none); `slot_row` (N,): the row whose values each slot takes
    (its own group's, else row 0: a slot nobody reads); `row_slot` (n,): one slot of each row, the
    first one that needs it. Rows come in the order of their first slot."""
    group = np.asarray(group, np.int64)
    ids = np.asarray(ids, np.int64)
    if need.any() and (group[need] < 0).any():
        raise ValueError("a slot whose logits are read has no history group")
    width = int(ids.max(initial=0)) + 1
    keys = np.where(group >= 0, group * width + ids, -1)
    needed = np.flatnonzero(need)
    uniq, first = np.unique(keys[needed], return_index=True)
    order = np.argsort(first, kind="stable")                 # rows in the order of their first slot
    row_slot = needed[first[order]]
    if not len(uniq):
        return np.full(len(keys), -1, np.int64), np.zeros(len(keys), np.int64), row_slot
    rank = np.empty(len(uniq), np.int64)
    rank[order] = np.arange(len(uniq))
    pos = np.minimum(np.searchsorted(uniq, keys), len(uniq) - 1)
    new_group = np.where((keys >= 0) & (uniq[pos] == keys), rank[pos], -1)
    return new_group, np.maximum(new_group, 0), row_slot
