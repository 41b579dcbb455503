"""Interval arithmetic for profiler timelines: how much of a window was communication, computation, both."""

from __future__ import annotations

Interval = tuple[float, float]


def union(intervals: list[Interval]) -> list[Interval]:
    """Merge overlapping intervals (sorted, disjoint result)."""
    merged: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def total(intervals: list[Interval]) -> float:
    return sum(end - start for start, end in union(intervals))


def intersection_total(a: list[Interval], b: list[Interval]) -> float:
    """Length of the time covered by both ``a`` and ``b``."""
    ua, ub = union(a), union(b)
    i = j = 0
    covered = 0.0
    while i < len(ua) and j < len(ub):
        start, end = max(ua[i][0], ub[j][0]), min(ua[i][1], ub[j][1])
        covered += max(0.0, end - start)
        if ua[i][1] < ub[j][1]:
            i += 1
        else:
            j += 1
    return covered


def difference(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The time covered by ``a`` and not by ``b`` (sorted, disjoint)."""
    out: list[Interval] = []
    ub = union(b)
    j = 0
    for start, end in union(a):
        while j < len(ub) and ub[j][1] <= start:
            j += 1
        k, cursor = j, start
        while k < len(ub) and ub[k][0] < end:
            if ub[k][0] > cursor:
                out.append((cursor, ub[k][0]))
            cursor = max(cursor, ub[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def split_window(compute: list[Interval], comm: list[Interval], window: Interval) -> dict[str, float]:
    """Communication, computation, their overlap and idle time within ``window`` (seconds)."""
    clip = [(max(s, window[0]), min(e, window[1])) for s, e in compute]
    clip_comm = [(max(s, window[0]), min(e, window[1])) for s, e in comm]
    compute_s, comm_s = total(clip), total(clip_comm)
    overlap_s = intersection_total(clip, clip_comm)
    busy = compute_s + comm_s - overlap_s
    return {
        "total_s": window[1] - window[0],
        "compute_s": compute_s,
        "comm_s": comm_s,
        "overlap_s": overlap_s,
        "idle_s": max(0.0, (window[1] - window[0]) - busy),
    }
