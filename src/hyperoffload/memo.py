"""``per_program``: remember what a function computed from a ``Program`` for as long as that Program lives.

A Program never changes once built, and a planner asks the same questions of one program thousands of times (its
dependencies, each op's storages, its ops' times), so such facts are computed once per program. Each decorated
function owns its results, in a ``WeakKeyDictionary`` keyed by the program: they go when the program does, and no
table is shared between functions or kept at module level.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, TypeVar
from weakref import WeakKeyDictionary

if TYPE_CHECKING:
    from hyperoffload.ir import Program

R = TypeVar("R")


def per_program(function: Callable[..., R]) -> Callable[..., R]:
    """``function(program, *args)``, computed once per program and ``args`` (hashable, compared by equality; no
    keyword arguments) and kept while ``program`` lives. A method of ``Program`` may be decorated too (``self`` is
    the program). The caller gets the object computed the first time, so results should be immutable (tuples,
    frozensets) or treated as such by every caller.

    ``memoized.results`` is the function's own table, for tests: program -> {args: result}."""
    results: WeakKeyDictionary[Program, dict[tuple[Hashable, ...], R]] = WeakKeyDictionary()

    @functools.wraps(function)
    def memoized(program: Program, *args: Any) -> R:
        by_args = results.get(program)
        if by_args is None:
            by_args = results[program] = {}
        if args in by_args:
            return by_args[args]
        result = by_args[args] = function(program, *args)
        return result

    memoized.results = results  # type: ignore[attr-defined]
    return memoized


__all__ = ["per_program"]
