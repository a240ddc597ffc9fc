"""``memo.per_program``: a result computed once per program (and arguments), kept while the program lives, in a
table of the decorated function's own."""

import gc

from programs import op, program, value

from hyperoffload.ir import Program, ValueKind
from hyperoffload.memo import per_program


def chain() -> Program:
    values = [value(0, 100, ValueKind.INPUT), value(1, 10), value(2, 20)]
    return program(values, [op(0, [0], [1]), op(1, [1], [2])], [0], [2])


def test_a_result_is_computed_once_per_program_and_arguments():
    calls = []

    @per_program
    def ops_times(prog: Program, factor: int = 1) -> tuple[int, ...]:
        """Each op id times ``factor``."""
        calls.append((prog, factor))
        return tuple(o.id * factor for o in prog.ops)

    first, second = chain(), chain()
    assert ops_times(first) == (0, 1) and ops_times(first) is ops_times(first)
    assert ops_times(first, 3) == (0, 3) and ops_times(first, 3) is ops_times(first, 3)
    assert ops_times(second) == (0, 1) and ops_times(second) is not ops_times(first)
    assert calls == [(first, 1), (first, 3), (second, 1)]
    assert ops_times.__name__ == "ops_times" and ops_times.__doc__ == "Each op id times ``factor``."


def test_results_go_with_their_program_and_each_function_keeps_its_own():
    @per_program
    def op_count(prog: Program) -> int:
        return len(prog.ops)

    @per_program
    def value_count(prog: Program) -> int:
        return len(prog.values)

    prog = chain()
    assert op_count(prog) == 2 and value_count(prog) == 3
    assert list(op_count.results) == [prog] and list(value_count.results) == [prog]
    assert op_count.results is not value_count.results
    del prog
    gc.collect()
    assert len(op_count.results) == 0 and len(value_count.results) == 0


def test_program_methods_are_memoized_per_program():
    prog = chain()
    assert prog.dependencies() is prog.dependencies() and prog.dependents() is prog.dependents()
    assert prog.dependencies() == ((), (0,)) and prog.dependents() == ((1,), ())
    assert prog.dependencies() is not chain().dependencies()
