"""What the LP bounds (``flow_bound``, ``traffic_bound``, ``link_bound``'s two-op bound) share: the link's rows
and the margin that keeps a solver's optimum on the side of a lower bound."""

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


__all__ = ["SOLVER_MARGIN", "link_rows"]
