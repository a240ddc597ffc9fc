"""What the LP bounds (``flow_bound``, ``traffic_bound``, ``link_bound``) share: the link's rows, the margin that
keeps a solver's optimum on the side of a lower bound, how a solve's outcome is read, and a sparse program built
up block by block."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

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


class SparseProgram:
    """A linear program ``min c x`` over ``lower <= x <= upper`` and ``A x <= b``, built up as it is read off a
    bound's argument: variables a block at a time (each block's index is where it starts in ``x``), rows one at a
    time as sparse ``(variable, coefficient)`` entries. Solved with HiGHS's interior point method, which on an
    8B training step is far faster than simplex; equality rows, where a bound has them, come with the solve."""

    __slots__ = ("_lower", "_upper", "_rows", "_cols", "_vals", "_rhs", "_variables")

    def __init__(self) -> None:
        self._lower: list[np.ndarray] = []
        self._upper: list[np.ndarray] = []
        self._rows: list[int] = []
        self._cols: list[int] = []
        self._vals: list[float] = []
        self._rhs: list[float] = []
        self._variables = 0

    @property
    def variables(self) -> int:
        """Variables added so far."""
        return self._variables

    @property
    def constraints(self) -> int:
        """Inequality rows added so far."""
        return len(self._rhs)

    def add_variables(self, count: int, *, upper, lower=0.0) -> int:
        """Adds ``count`` variables within ``[lower, upper]`` (each a number, or one per variable); returns the
        index of the first."""
        first = self._variables
        self._lower.append(np.broadcast_to(np.asarray(lower, dtype=np.float64), (count,)))
        self._upper.append(np.broadcast_to(np.asarray(upper, dtype=np.float64), (count,)))
        self._variables += count
        return first

    def add_row(self, entries: Iterable[tuple[int, float]], bound: float) -> None:
        """Adds ``sum of coefficient * x[variable] over entries <= bound``."""
        r = len(self._rhs)
        for c, v in entries:
            self._rows.append(r)
            self._cols.append(c)
            self._vals.append(v)
        self._rhs.append(bound)

    def bounds(self) -> np.ndarray:
        """``(lower, upper)`` of each variable, one row per variable."""
        return np.column_stack([np.concatenate([np.zeros(0), *self._lower]),
                                np.concatenate([np.zeros(0), *self._upper])])

    def solve(self, objective: np.ndarray, *, a_eq=None, b_eq=None):
        """``scipy.optimize.linprog``'s result for ``min objective x`` (read it with ``solved``), with the rows
        ``a_eq x = b_eq`` besides, where given."""
        from scipy.optimize import linprog
        from scipy.sparse import coo_matrix

        matrix = coo_matrix((self._vals, (self._rows, self._cols)), shape=(len(self._rhs), self._variables)).tocsr()
        return linprog(objective, A_ub=matrix, b_ub=np.asarray(self._rhs), A_eq=a_eq, b_eq=b_eq,
                       bounds=self.bounds(), method="highs-ipm")


__all__ = ["SOLVER_MARGIN", "SparseProgram", "link_rows", "solved"]
