"""``whole_step.read_written_back``: readers of a value written back into a step input read the input instead,
with the same results, and only where the input holds that value."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from hyperoffload.compile.whole_step import read_written_back

COPY = torch.ops.aten.copy_.default


def _update(m, g, p):
    new = m * 0.9 + g  # a moment's new value
    return new, p - new  # ... read by the parameter's update


def _with_write_backs(fn, *inputs, write_back_at=((0, 0),)) -> torch.fx.GraphModule:
    """``fn`` traced, with ``copy_(inputs[i], outputs[k])`` inserted right after the node computing ``outputs[k]``
    for each ``(k, i)`` of ``write_back_at``, and ``copy_`` of the last output into the last input at the end, as a
    functionalized step's write-backs; the graph returns nothing."""
    gm = make_fx(fn)(*inputs)
    graph = gm.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    output = next(iter(graph.find_nodes(op="output")))
    results = list(output.args[0])
    for index, to in write_back_at:
        value = results[index]
        with graph.inserting_after(value):
            graph.call_function(COPY, (placeholders[to], value))
    with graph.inserting_before(output):
        graph.call_function(COPY, (placeholders[-1], results[-1]))
    output.args = ((),)
    graph.lint()
    gm.recompile()
    return gm


def _inputs():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(4, 8, generator=gen) for _ in range(3)]


def _run(gm, inputs):
    copies = [t.clone() for t in inputs]
    gm(*copies)
    return copies


def test_a_reader_after_the_write_back_reads_the_input_with_the_same_results():
    gm = _with_write_backs(_update, *_inputs())
    rewritten = read_written_back(gm)
    m = next(iter(rewritten.graph.find_nodes(op="placeholder")))
    sub = next(n for n in rewritten.graph.nodes if n.target is torch.ops.aten.sub.Tensor)
    assert m in sub.args  # the parameter's update reads the moment, not its new value
    before, after = _run(gm, _inputs()), _run(rewritten, _inputs())
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_nothing_is_replaced_where_the_new_value_has_another_dtype():
    def update(m, g, p):
        new = (m * 0.9 + g).double()
        return new, p - new.float()

    gm = _with_write_backs(update, *_inputs())
    rewritten = read_written_back(gm)
    m = next(iter(rewritten.graph.find_nodes(op="placeholder")))
    converted = [n for n in rewritten.graph.nodes if n.target is torch.ops.aten._to_copy.default]
    assert converted and all(m not in n.args for n in converted[1:])  # the float64 value is still what is read
    before, after = _run(gm, _inputs()), _run(rewritten, _inputs())
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_a_reader_after_a_second_write_back_of_the_input_keeps_reading_the_value():
    def update(m, g, p):
        new = m * 0.9 + g
        other = new * 2
        return new, other, p - new

    inputs = _inputs()
    # copy_(m, new) right after new, then copy_(m, other) right after other: the parameter's update comes after
    # both, where m no longer holds new.
    gm = _with_write_backs(update, *inputs, write_back_at=((0, 0), (1, 0)))
    rewritten = read_written_back(gm)
    sub = next(n for n in rewritten.graph.nodes if n.target is torch.ops.aten.sub.Tensor)
    new = next(n for n in rewritten.graph.nodes if n.target is torch.ops.aten.add.Tensor)
    assert new in sub.args
    before, after = _run(gm, _inputs()), _run(rewritten, _inputs())
    assert all(torch.equal(a, b) for a, b in zip(before, after))
