"""``instructions.RULES`` against what its readers do: the checker's live bytes and rules, the simulator's streams and
waits, the baselines' emission order, the lowering's operators and the backend's operator table.

Each kind's facts are checked on a small program whose round trip of one storage uses every kind. The checker and
the simulator read some of the facts themselves, so the expectations are also stated by hand where that matters
(live bytes, lanes, emission order, operator names), and the rest are checked through what the registry does not
drive: the checker's per-kind rules (what an op may read, what a prefetch or a release needs), the simulator's
timeline, and the lowering, which tracks what is on the device and in flight itself."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from hyperoffload import cache_ops
from hyperoffload.capture import program_from_graph
from hyperoffload.instructions import COMPUTE, COPIES, D2H, H2D, OUTPUTS, RULES, TARGET, Kind, Tier, WaitsOn
from hyperoffload.ir import ValueKind
from hyperoffload.lower import lower_plan
from hyperoffload.plans import Instr, Plan, PlanError, check_plan, owned_outputs
from hyperoffload.policies.common import Placed, emit_plan
from hyperoffload.simulate import simulate
from programs import op, program, simple_hardware, value

GB = 10**9
A = 1
"""The storage every cache instruction below moves: ``a``, 1000 bytes, made by op 0, read by ops 1 and 2 and
returned (so it is never freed behind the instructions' backs)."""


def round_trip_program():
    """x (input, 4 B) -> a = op0(x) (1000 B); b = op1(a) (8 B); c = op2(a, b) (4 B); returns c and a; each op 1 s."""
    values = [value(0, 4, ValueKind.INPUT), value(1, 1000), value(2, 8), value(3, 4)]
    ops = [op(0, [0], [1], flops=GB), op(1, [1], [2], flops=GB), op(2, [1, 2], [3], flops=GB)]
    return program(values, ops, [0], [3, A])


PROGRAM = round_trip_program()
C0, C1, C2 = (Instr(Kind.COMPUTE, i) for i in range(3))
O, W, R, P = (Instr(kind, A) for kind in (Kind.OFFLOAD, Kind.WAIT, Kind.RELEASE, Kind.PREFETCH))

DEVICE_ONLY = [C0]
"""``a`` on the device, with no remote copy."""
REMOTE_ONLY = [C0, O, W, R]
"""``a`` in remote memory only."""
ONLY = {Tier.DEVICE: DEVICE_ONLY, Tier.REMOTE: REMOTE_ONLY}

SETUPS: dict[Kind, tuple[list[Instr], Instr, list[Instr]]] = {
    Kind.COMPUTE: ([], C0, [C1, C2]),
    Kind.OFFLOAD: ([C0], O, [C1, C2]),
    Kind.WAIT: ([C0, O], W, [C1, C2]),
    Kind.RELEASE: ([C0, O, W], R, [P, W, C1, C2]),
    Kind.PREFETCH: ([C0, O, W, R], P, [W, C1, C2]),
}
"""Per kind: a valid prefix, an instruction of the kind, and the rest of a complete valid plan."""

USES = {Tier.REMOTE: [R, P, W, C1, C2], Tier.DEVICE: [W, C1]}
"""Instructions that are valid only if a usable copy of ``a`` is in that tier (a release of ``a``, read later, needs
its remote copy; op 1 reads the device copy, once the transfer that brought it is waited for)."""


def _step(x):
    """``PROGRAM`` as a torch function: a = x * 2; b = a + 1; c = a * b; returns c and a."""
    a = x * 2
    b = a + 1
    return a * b, a


@pytest.fixture(scope="module")
def twin():
    """``lower(instructions)``: ``instructions`` of ``PROGRAM`` lowered onto ``_step``'s graph, checked to compute
    what ``_step`` does; returns the GraphModule."""
    x = torch.randn(4, 3)
    gm = make_fx(_step, tracing_mode="fake")(x)
    prog = program_from_graph(gm, [ValueKind.INPUT], name="registry", mode="inference")
    ops = [o.id for o in sorted(prog.ops, key=lambda o: ["mul", "add", "mul_1"].index(o.name))]
    a = prog.values[prog.node_values["mul"]].storage

    def lower(instructions) -> torch.fx.GraphModule:
        twin_instructions = tuple(Instr(i.kind, ops[i.target] if i.kind is Kind.COMPUTE else a) for i in instructions)
        lowered = lower_plan(Plan(program=prog, instructions=twin_instructions, policy="test"))
        with torch.no_grad():
            got, want = lowered(x.clone()), _step(x)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        return lowered

    return lower


def plan_of(instructions, **kwargs) -> Plan:
    return Plan(program=PROGRAM, instructions=tuple(instructions), policy="test", **kwargs)


def accepted(instructions) -> bool:
    """Whether the checker accepts every instruction of ``instructions`` (the plan may stop before its end)."""
    try:
        check_plan(plan_of(instructions))
    except PlanError as error:
        return error.index == -1  # only the plan as a whole is unfinished
    return True


def on_device(instructions) -> bool:
    """Whether ``a`` is on the device after ``instructions`` (a prefetch of it is refused for that)."""
    try:
        check_plan(plan_of([*instructions, P]))
    except PlanError as error:
        return "already on the device" in str(error)
    return False


# --- the registry itself -------------------------------------------------------------------------------------------

def test_every_kind_has_one_rule_and_a_setup_here():
    assert set(RULES) == set(Kind) == set(SETUPS)
    assert all(rule.kind is kind for kind, rule in RULES.items())


def test_the_registry_is_importable_without_torch():
    """It names its operators by their ``torch.library`` names, so that the planner's modules stay free of torch."""
    code = "import sys, hyperoffload.instructions, hyperoffload.plans; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_copies_run_on_the_lane_toward_the_tier_they_write():
    assert COPIES == {Kind.OFFLOAD, Kind.PREFETCH}
    for kind in COPIES:
        rule = RULES[kind]
        assert rule.stream == {Tier.DEVICE: H2D, Tier.REMOTE: D2H}[rule.writes]
        assert rule.reads is not rule.writes


# --- the checker ---------------------------------------------------------------------------------------------------

def test_live_bytes_of_a_round_trip_by_hand():
    check = check_plan(plan_of([C0, O, W, R, P, W, C1, C2]))
    assert check.live_bytes == (1004, 1004, 1004, 4, 1004, 1004, 1012, 1016)


@pytest.mark.parametrize("kind", list(Kind))
def test_live_bytes_move_as_the_registry_says(kind):
    prefix, instr, rest = SETUPS[kind]
    check = check_plan(plan_of([*prefix, instr, *rest]))
    k = len(prefix)
    before = check.initial_bytes if k == 0 else check.live_bytes[k - 1] - sum(
        PROGRAM.values[s].alloc_bytes for s in check.frees_after[k - 1])
    rule, values = RULES[kind], PROGRAM.values
    allocated = {OUTPUTS: sum(values[o].alloc_bytes for o in owned_outputs(PROGRAM)[instr.target]),
                 TARGET: values[instr.target].alloc_bytes, None: 0}[rule.allocates]
    freed = {TARGET: values[instr.target].alloc_bytes, None: 0}[rule.frees]
    assert check.live_bytes[k] - before == allocated - freed
    if rule.allocates is not None or rule.frees is not None:
        assert allocated - freed, "the setup moves bytes, so that the check means something"


@pytest.mark.parametrize("kind", [k for k in Kind if k is not Kind.COMPUTE])
def test_where_the_target_is_after_it(kind):
    prefix, instr, _ = SETUPS[kind]
    expected = RULES[kind].on_device_after
    assert on_device([*prefix, instr]) is (on_device(prefix) if expected is None else expected)


@pytest.mark.parametrize("kind", [k for k, rule in RULES.items() if rule.allocates is not None])
def test_what_it_allocates_is_readable_at_once_only_if_ready_at_issue(kind, twin):
    prefix, instr, rest = SETUPS[kind]
    rest = list(rest)
    rest.remove(C1)
    instructions = [*prefix, instr, C1, *rest]
    assert accepted(instructions) is RULES[kind].ready_at_issue
    if RULES[kind].ready_at_issue:  # the lowering, which tracks what is readable itself, agrees
        twin(instructions)


@pytest.mark.parametrize("kind", sorted(COPIES))
def test_a_copy_reads_and_writes_the_tiers_the_registry_names(kind):
    rule, instr = RULES[kind], Instr(kind, A)
    source = ONLY[rule.reads]
    assert accepted([*source, instr])
    assert not accepted([*ONLY[rule.writes], instr])  # nothing to read there
    assert accepted([*source, instr, *USES[rule.writes]])
    assert not accepted([*source, *USES[rule.writes]])  # the usable copy is the one it wrote


# --- the simulator -------------------------------------------------------------------------------------------------

def _waited(plan, timeline, i):
    """The end of what instruction ``i`` waits on (``KindRule.waits_on``), per the plan; None: nothing."""
    instrs, ends = plan.instructions, {iv.instruction: iv.end for iv in timeline.intervals}
    ins, rule = instrs[i], RULES[instrs[i].kind]
    earlier = range(i - 1, -1, -1)
    if rule.waits_on is WaitsOn.PREVIOUS:
        j = next((j for j in earlier if RULES[instrs[j].kind].stream == rule.stream and j in ends), None)
    elif rule.waits_on is WaitsOn.WRITER:
        j = next(j for j in earlier if instrs[j].kind is Kind.COMPUTE
                 and ins.target in PROGRAM.ops[instrs[j].target].outputs)
    elif rule.waits_on is WaitsOn.FILLER:
        j = next((j for j in earlier if instrs[j].target == ins.target
                  and instrs[j].kind in COPIES and RULES[instrs[j].kind].writes is rule.reads), None)
    elif rule.waits_on is WaitsOn.TRANSFER:
        j = next(j for j in earlier if instrs[j].target == ins.target and instrs[j].kind in COPIES)
    else:
        assert rule.waits_on is WaitsOn.NOTHING
        j = None
    return None if j is None else ends[j]


def test_every_instruction_starts_after_what_the_registry_says_it_waits_on():
    # The prefetch follows the offload unwaited, so only what it waits on orders the two lanes (1 s copies).
    plan = plan_of([C0, O, R, P, W, C1, C2])
    timeline = simulate(plan, simple_hardware(bw=1000.0))
    assert {RULES[i.kind].waits_on for i in plan.instructions} == set(WaitsOn)
    starts = {iv.instruction: iv.start for iv in timeline.intervals}
    for i, ins in enumerate(plan.instructions):
        waited = _waited(plan, timeline, i)
        if waited is None:
            continue
        if RULES[ins.kind].waits_on is WaitsOn.TRANSFER:  # the compute stream stops until the transfer has landed
            start = min(iv.start for iv in timeline.intervals if iv.stream == COMPUTE and iv.instruction > i)
        else:
            start = starts[i]
        assert start >= waited - 1e-12, (i, ins)
    copies = {iv.instruction: (iv.stream, iv.start, iv.end) for iv in timeline.intervals if iv.stream != COMPUTE}
    assert copies == {1: (D2H, pytest.approx(1.0), pytest.approx(2.0)),
                      3: (H2D, pytest.approx(2.0), pytest.approx(3.0))}


def test_each_instruction_occupies_its_kinds_stream():
    plan = plan_of([C0, O, W, R, P, W, C1, C2])
    timeline = simulate(plan, simple_hardware(bw=1000.0))
    streams = {iv.instruction: iv.stream for iv in timeline.intervals}
    for i, ins in enumerate(plan.instructions):
        assert streams.get(i) == RULES[ins.kind].stream or (i not in streams and ins.kind is Kind.WAIT), (i, ins)


# --- the baselines' emission ---------------------------------------------------------------------------------------

def test_baselines_emit_the_cache_instructions_of_one_position_in_rank_order():
    # Before op 1, a goes out and comes back, which is valid in one order only; placed in the reverse of it.
    placed = [Placed(1, kind, A) for kind in (Kind.WAIT, Kind.PREFETCH, Kind.RELEASE, Kind.OFFLOAD)]
    plan = emit_plan(PROGRAM, placed, policy="test", budget_bytes=10**6)
    at_one = [i.kind for i in plan.instructions[1:5]]
    assert at_one == sorted(at_one, key=lambda k: RULES[k].emit_rank)
    assert at_one == [Kind.OFFLOAD, Kind.RELEASE, Kind.PREFETCH, Kind.WAIT]
    assert plan.budget_bytes == 10**6  # checked, and within the budget


# --- the lowering and the backend ----------------------------------------------------------------------------------

def test_lowering_calls_each_kinds_registered_operator(twin):
    instructions = [C0, O, W, R, P, W, C1, C2]
    gm = twin(instructions)
    called = [n.target for n in gm.graph.nodes
              if n.op == "call_function" and getattr(n.target, "namespace", None) == cache_ops.NAMESPACE]
    cache = [i.kind for i in instructions if i.kind is not Kind.COMPUTE]
    assert set(cache) == {kind for kind, rule in RULES.items() if rule.operator is not None}
    assert [target.name() for target in called] == [RULES[k].operator for k in cache]
    assert [target.name() for target in called] == ["hyperoffload::offload", "hyperoffload::wait",
                                                    "hyperoffload::release", "hyperoffload::prefetch",
                                                    "hyperoffload::wait"]
    assert called == [cache_ops.KIND_OPERATORS[k] for k in cache]


@pytest.mark.parametrize("kind", list(Kind))
def test_the_lowering_runs_every_plan_the_checker_accepts_here(kind, twin):
    """The lowering tracks what is on the device and in flight itself (one method per kind): it lowers each
    setup's complete plan, which the checker accepts."""
    prefix, instr, rest = SETUPS[kind]
    twin([*prefix, instr, *rest])


def test_backend_reads_the_operators_from_the_registry():
    from hyperoffload.compile.backend import CACHE_OPERATORS

    assert {kind: op.name() for op, kind in CACHE_OPERATORS.items()} == {
        kind: rule.operator for kind, rule in RULES.items() if rule.operator is not None}
    assert set(cache_ops.KIND_OPERATORS) == {kind for kind, rule in RULES.items() if rule.operator is not None}
