"""What the LP bounds (``flow_bound``, ``traffic_bound``, ``link_bound``) share: the link's rows, the margin that
keeps a solver's optimum on the side of a lower bound, and how a solve's outcome is read."""

from __future__ import annotations

SOLVER_MARGIN = 1e-7
"""Relative: HiGHS's feasibility tolerance. Each LP bound reduces its optimum (or the stall above compute it
finds) by this share, so that solver tolerance does not put the bound above a plan that meets it exactly."""


def link_rows(duplex_share: float) -> tuple[tuple[float, float, float], ...]:
    """Rows ``(a, b, c)``: a link of this ``duplex_share`` copies what takes ``X`` seconds one way and ``Y`` the
    other (each at full speed alone) within ``L`` seconds only if ``a X + b Y <= c L`` for every row (either way
    round: the rows are symmetric). While both directions copy each gets ``duplex_share`` of its bandwidth, so
    ``(X, Y) / L`` lies in the convex hull of (0, 0), (1, 0), (0, 1) and (share, share): two rows for a share of
    one half or more, else ``X + Y <= L``."""
    share = duplex_share
    if share >= 0.5:
        return (share, 1.0 - share, share), (1.0 - share, share, share)
    return ((1.0, 1.0, 1.0),)


def solved(result, what: str):
    """``result`` (``scipy.optimize.linprog``'s) where the LP has an optimum, None where it is infeasible (no plan
    meets the budget); a solver failure of any other kind raises, naming ``what`` was solved."""
    if result.status == 2:
        return None
    if result.status != 0:
        raise RuntimeError(f"{what} LP: {result.message}")
    return result


__all__ = ["SOLVER_MARGIN", "link_rows", "solved"]
