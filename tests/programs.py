"""Small Programs built directly in the IR, for unit and property tests."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

from hyperoffload.hardware import Hardware
from hyperoffload.ir import Collective, CollectiveKind, Op, Phase, Program, Value, ValueKind


def value(vid: int, nbytes: int, kind: ValueKind = ValueKind.TEMPORARY, storage: int | None = None,
          name: str | None = None) -> Value:
    owner = vid if storage is None else storage
    return Value(id=vid, name=name or f"v{vid}", shape=(nbytes // 4,), dtype="float32", nbytes=nbytes, kind=kind,
                 storage=owner, alloc_bytes=nbytes if owner == vid else 0)


def op(oid: int, inputs: Sequence[int], outputs: Sequence[int], mutates: Sequence[int] = (),
       flops: int = 1) -> Op:
    return Op(id=oid, name=f"op{oid}", target="test.op", inputs=tuple(inputs), outputs=tuple(outputs),
              mutates=tuple(mutates), phase=Phase.FORWARD, flops=flops, bytes_read=1, bytes_written=1)


def program(values: Sequence[Value], ops: Sequence[Op], inputs: Sequence[int], outputs: Sequence[int]) -> Program:
    return Program(name="test", mode="test", values=tuple(values), ops=tuple(ops), inputs=tuple(inputs),
                   outputs=tuple(outputs))


def two_peaks() -> Program:
    """x (written by op0, 1000 bytes) idles until op4 reads it; op2 and op3 are over the budget by 1000 and
    900 bytes, and only x can leave."""
    values = [value(0, 0), value(1, 1000), value(2, 200), value(3, 4000), value(4, 100), value(5, 100)]
    ops = [op(0, [0], [1], flops=1000),
           op(1, [0], [2], flops=2000),
           op(2, [2], [3], flops=3000),  # live: x + 200 + 4000 = 5200 (the peak)
           op(3, [3], [4], flops=4000),  # live: x + 4000 + 100 = 5100
           op(4, [1, 4], [5], flops=5000)]
    return program(values, ops, [0], [5])


@st.composite
def random_programs(draw):
    """Random DAGs with inputs, views and unused outputs."""
    n_inputs = draw(st.integers(1, 3))
    values = [value(i, draw(st.integers(0, 64)) * 4, ValueKind.INPUT) for i in range(n_inputs)]
    ops = []
    for oid in range(draw(st.integers(1, 12))):
        k = draw(st.integers(1, min(3, len(values))))
        reads = sorted(set(draw(st.lists(st.integers(0, len(values) - 1), min_size=k, max_size=k))))
        outs = []
        for _ in range(draw(st.integers(1, 2))):
            vid = len(values)
            if draw(st.booleans()) and draw(st.booleans()):
                src = values[reads[0]]
                values.append(value(vid, src.nbytes, storage=src.storage))  # a view of the first input
            else:
                values.append(value(vid, draw(st.integers(0, 64)) * 4))
            outs.append(vid)
        ops.append(op(oid, reads, outs))
    outputs = draw(st.lists(st.integers(n_inputs, len(values) - 1), min_size=1, max_size=2, unique=True))
    return program(values, ops, list(range(n_inputs)), outputs)


def simple_hardware(*, bw=1e9, latency=0.0, duplex=1.0) -> Hardware:
    """1 GFLOP/s compute, so an op of F FLOPs takes F / 1e9 s; no launch cost; memory traffic free."""
    return Hardware(name="test", description="", memory_bytes=10**15, peak_flops={"float32": 1e9}, hbm_bw=1e30,
                    h2d_bw=bw, d2h_bw=bw, h2d_latency_s=latency, d2h_latency_s=latency, duplex_share=duplex,
                    launch_s=0.0, compute_efficiency=1.0, memory_efficiency=1.0)


def two_rank_hardware(*, bw=1e9, latency=0.0, duplex=1.0, network_bw=1e4) -> Hardware:
    """``simple_hardware`` as two devices of one node, ``network_bw`` bytes/s between them."""
    import dataclasses

    return dataclasses.replace(simple_hardware(bw=bw, latency=latency, duplex=duplex), devices_per_node=2,
                               intra_node_bw=network_bw)


@st.composite
def random_training_programs(draw, sharded: bool = False):
    """Random steps shaped like training: state inputs (parameters, optimizer state) that ops update in place,
    forward, backward and optimizer phases, views, ops that draw random numbers, and activations and gradients
    that later ops read; so plans may keep state in remote memory between steps. ``sharded``: some ops that make a
    new tensor are collectives over 2 ranks instead (gathers, reductions; run them on ``two_rank_hardware``)."""
    state_kinds = [ValueKind.PARAMETER, ValueKind.OPTIMIZER_STATE, ValueKind.INPUT]
    n_inputs = draw(st.integers(1, 4))
    values = [value(i, draw(st.integers(1, 64)) * 4, draw(st.sampled_from(state_kinds))) for i in range(n_inputs)]
    n_ops = draw(st.integers(2, 12))
    ops = []
    for oid in range(n_ops):
        phase = Phase.FORWARD if oid < n_ops // 2 else Phase.BACKWARD if oid < n_ops - 2 else Phase.OPTIMIZER
        reads = sorted(set(draw(st.lists(st.integers(0, len(values) - 1), min_size=1, max_size=3))))
        outs, mutates = [], []
        writable = [r for r in reads if values[values[r].storage].kind is not ValueKind.INPUT]
        if writable and draw(st.booleans()) and draw(st.booleans()):  # an in-place update: its result is a view
            target = draw(st.sampled_from(writable))
            mutates.append(target)
            vid = len(values)
            values.append(value(vid, values[target].nbytes, values[target].kind, storage=values[target].storage))
            outs.append(vid)
        for _ in range(draw(st.integers(0 if outs else 1, 2))):
            vid = len(values)
            if draw(st.integers(0, 4)) == 0:
                source = values[reads[0]]
                values.append(value(vid, source.nbytes, source.kind, storage=source.storage))
            else:
                kind = draw(st.sampled_from([ValueKind.ACTIVATION, ValueKind.TEMPORARY, ValueKind.GRADIENT]))
                values.append(value(vid, draw(st.integers(0, 64)) * 4, kind))
            outs.append(vid)
        collective = None
        if sharded and not mutates and draw(st.integers(0, 2)) == 0:
            kind = draw(st.sampled_from(list(CollectiveKind)))
            collective = Collective(kind=kind, full_bytes=draw(st.sampled_from([8, 800, 8000, 80000])), group_size=2)
        ops.append(Op(id=oid, name=f"op{oid}", target="test.op", inputs=tuple(reads), outputs=tuple(outs),
                      mutates=tuple(mutates), phase=phase, flops=draw(st.sampled_from([1, 10, 100, 1000, 10000])),
                      bytes_read=1, bytes_written=1, random=draw(st.integers(0, 9)) == 0, collective=collective))
    made = list(range(n_inputs, len(values)))
    outputs = draw(st.lists(st.sampled_from(made), min_size=1, max_size=2, unique=True))
    return program(values, ops, list(range(n_inputs)), sorted(outputs))
