"""Figures of a list of step times."""


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (0 <= q <= 1), the nearest sample: no
    interpolation between two steps' times."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]
