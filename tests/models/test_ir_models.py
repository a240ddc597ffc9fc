"""The IR of a captured torch.nn.Module: ops that draw random numbers keep their captured order."""

import pytest

from hyperoffload.ir import ValueKind
from programs import op, program, value


def test_random_ops_keep_their_captured_order_among_themselves():
    """Two dropouts on independent inputs: no data links them, but each draws from the one global generator,
    so swapping them would give each the other's mask. Only ops marked random are chained."""
    import dataclasses

    import torch

    from hyperoffload.capture import capture_prefill_step

    values = [value(0, 4, ValueKind.INPUT), value(1, 4, ValueKind.INPUT), value(2, 4), value(3, 4), value(4, 4)]
    ops = [dataclasses.replace(op(0, [0], [2]), random=True), dataclasses.replace(op(1, [1], [3]), random=True),
           op(2, [2, 3], [4])]
    prog = program(values, ops, [0, 1], [4])
    assert 0 in prog.dependencies()[1]
    with pytest.raises(ValueError, match="before op0"):
        prog.check_order([1, 0, 2])
    plain = program(values, [op(0, [0], [2]), op(1, [1], [3]), op(2, [2, 3], [4])], [0, 1], [4])
    plain.check_order([1, 0, 2])  # without randomness the two are free to swap

    class TwoDropouts(torch.nn.Module):
        def forward(self, x, y):
            return torch.nn.functional.dropout(x, 0.5) + torch.nn.functional.dropout(y, 0.5)

    captured = capture_prefill_step(TwoDropouts().train(), (torch.ones(8), torch.ones(8)))
    random = [o for o in captured.program.ops if o.random]
    assert len(random) == 2 and random[0].id in captured.program.dependencies()[random[1].id]
