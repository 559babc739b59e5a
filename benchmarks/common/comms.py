"""Collectives recorded at the c10d level (``tests/_c10d.py``'s ``C10dRecorder``: a
list of ``(kind, unsharded buffer bytes)``) summed per kind, with the bytes each rank
sends with a ring algorithm."""


def ring_wire_bytes(kind: str, nbytes: float, world: int) -> float:
    """What each rank sends with a ring algorithm: (W-1)/W of the buffer for an
    all-gather, a reduce-scatter or an all-to-all, 2(W-1)/W for an all-reduce (a
    reduce-scatter, then an all-gather)."""
    factor = 2 if kind == "all_reduce" else 1
    return factor * (world - 1) / world * nbytes


def summarize(records: list[tuple[str, int]], world: int) -> dict[str, dict[str, float]]:
    """kind -> {"count", "nbytes", "wire_bytes"} over ``records``."""
    out: dict[str, dict[str, float]] = {}
    for kind, nbytes in records:
        entry = out.setdefault(kind, {"count": 0, "nbytes": 0, "wire_bytes": 0.0})
        entry["count"] += 1
        entry["nbytes"] += nbytes
        entry["wire_bytes"] += ring_wire_bytes(kind, nbytes, world)
    return out
