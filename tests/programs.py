"""Small Programs built directly in the IR, for unit and property tests."""

from __future__ import annotations

from collections.abc import Sequence

from hyperoffload.ir import Op, Phase, Program, Value, ValueKind


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
