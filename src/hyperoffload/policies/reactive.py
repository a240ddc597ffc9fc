"""``reactive``: runtime-driven swapping. A value is fetched, blocking, when an op first needs it; the
least-recently-used resident storage is evicted when an allocation would exceed the budget.

This is the condition of the HyperOffload paper's motivation (section 3.1, ``docs/references.md``):
a runtime that only reacts to what the next op needs, as unified-memory paging, a swapping caching
allocator or an on-demand ZeRO-3 fetch without a trace does. It is expressed as a Plan, the decisions
such a runtime would take replayed in captured order, so the simulator and the executors run it:

* before an op, every input not on the device is fetched: PREFETCH immediately followed by WAIT;
* when the fetched inputs or the op's outputs would take the device over the budget, resident
  storages not used by the op are evicted, least recently used first: OFFLOAD + RELEASE, or RELEASE
  alone if the remote copy is still current (not written since its last offload); the memory is
  reused once the copy has landed, so the op behind it waits (a memory stall), as a runtime would;
* the step's outputs and the graph's constants are not evicted (the caller receives the outputs
  at the end of the step);
* with ``lookahead = k`` the inputs of the next ``k`` ops are also fetched ahead (not waited for) when
  that fits after evicting storages none of those ops use.

The step starts with the state the previous step left: step inputs most recently used at the end of
a step stay on the device, up to the budget, and the rest start in remote memory.

Budget: a reactive runtime meets any budget that holds one op's inputs and outputs. Below that it
would run out of memory; the plan then goes over the budget (still evicting everything else) and is
returned without one: its peak is what the policy needs.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from hyperoffload.hardware import Hardware
from hyperoffload.ir import Program
from hyperoffload.plans import Instr, Kind, Plan, held_storages
from hyperoffload.policies.common import fit_budget

POLICY = "reactive"


@dataclass(frozen=True, slots=True, kw_only=True)
class ReactiveConfig:
    """Knobs of the swapping runtime."""

    lookahead: int = 0
    """How many ops after the current one have their missing inputs fetched ahead (0: on demand only)."""
    steady_state_passes: int = 3
    """How many more times the step is replayed from the residency the last replay ended with, until the two
    agree (a count): what a runtime reaches after a few steps, which the plan then repeats every step."""


def plan_reactive(program: Program, hardware: Hardware, budget_bytes: int,
                  config: ReactiveConfig = ReactiveConfig()) -> Plan:
    """Fetch on first use, evict least recently used; see the module docstring."""
    if config.lookahead < 0:
        raise ValueError(f"lookahead must be 0 or more ops, got {config.lookahead}")
    runtime = _Runtime(program, budget_bytes, config.lookahead, None)
    runtime.run()
    # Steady state: start from the residency the step ends with, until the two agree; whatever still
    # differs is put back at the end, so that step after step replays the same plan.
    for _ in range(config.steady_state_passes):
        ends_with = runtime.resident_inputs()
        if ends_with == runtime.starts_with:
            break
        runtime = _Runtime(program, budget_bytes, config.lookahead, ends_with)
        runtime.run()
    return runtime.plan()


class _Runtime:
    """The swapping runtime's state while it replays the step in captured order (bytes)."""

    def __init__(self, program: Program, budget: int, lookahead: int, starts_with: frozenset[int] | None) -> None:
        self.program, self.budget, self.lookahead = program, budget, lookahead
        values = program.values
        self.size = [v.alloc_bytes for v in values]
        self.held = held_storages(program)
        self.touches: list[tuple[int, ...]] = []
        self.reads: list[tuple[int, ...]] = []
        self.writes: list[frozenset[int]] = []
        last_use: dict[int, int] = {}
        for p, op in enumerate(program.ops):
            reads = tuple(sorted({values[v].storage for v in op.inputs}))
            produced = {o for o in op.outputs if values[o].owns_storage}
            self.reads.append(reads)
            self.touches.append(tuple(sorted(set(reads) | produced)))
            self.writes.append(frozenset({values[v].storage for v in op.mutates} | produced))
            for s in self.touches[-1]:
                last_use[s] = p
        self.last_use = last_use
        self.constants = {values[v].storage for v in program.constants}
        self.inputs = {values[v].storage for v in program.inputs} - self.constants
        # The step's outputs and the graph's constants stay: they belong to the caller and to the graph.
        self.pinned = self.held - self.inputs
        self.resident: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.pending: set[int] = set()  # prefetched, not yet waited for
        self.used = 0
        self.instructions: list[Instr] = []
        self.starts_with = self._initial_guess() if starts_with is None else starts_with
        for s in sorted(self.constants | self.starts_with, key=lambda s: self.last_use.get(s, -1)):
            self.resident[s] = None
            self.used += self.size[s]
        self.current = self.inputs - self.starts_with  # storages whose remote copy equals the device copy
        self.away = set(self.current)  # storages in remote memory only

    def _initial_guess(self) -> frozenset[int]:
        """A first guess of the inputs on the device when a step starts: those used last in the step are
        the most recently used when the next one starts, kept while they fit. Graph constants stay."""
        used = sum(self.size[s] for s in self.constants)
        kept = set()
        for s in sorted(self.inputs, key=lambda s: -self.last_use.get(s, -1)):
            if used + self.size[s] <= self.budget:
                used += self.size[s]
                kept.add(s)
        return frozenset(kept)

    def resident_inputs(self) -> frozenset[int]:
        return frozenset(s for s in self.resident if s in self.inputs)

    def plan(self) -> Plan:
        """The plan, ending with the inputs on the device that it started with."""
        ends_with = self.resident_inputs()
        for s in sorted(ends_with - self.starts_with):
            self.evict(s)
        for s in sorted(self.starts_with - ends_with):
            self.fetch(s)
            self.emit(Kind.WAIT, s)
            self.pending.discard(s)
        plan = Plan(program=self.program, instructions=tuple(self.instructions), policy=POLICY,
                    initial_remote=frozenset(self.inputs - self.starts_with))
        return fit_budget(plan, self.budget)

    def emit(self, kind: Kind, s: int) -> None:
        self.instructions.append(Instr(kind, s))

    def evict_for(self, nbytes: int, protected: set[int] | tuple[int, ...]) -> bool:
        """Evict least-recently-used storages not in ``protected`` until ``nbytes`` more fit; False if they
        cannot (everything evictable has gone)."""
        while self.used + nbytes > self.budget:
            victim = next((s for s in self.resident if s not in protected and s not in self.pending
                           and s not in self.pinned and self.size[s] > 0), None)
            if victim is None:
                return False
            self.evict(victim)
        return True

    def evict(self, s: int) -> None:
        if s not in self.current:
            self.emit(Kind.OFFLOAD, s)
            self.current.add(s)
        self.emit(Kind.RELEASE, s)
        self.away.add(s)
        del self.resident[s]
        self.used -= self.size[s]

    def fetch(self, s: int) -> None:
        self.emit(Kind.PREFETCH, s)
        self.pending.add(s)
        self.away.discard(s)
        self.resident[s] = None
        self.used += self.size[s]

    def run(self) -> None:
        n = len(self.program.ops)
        for p in range(n):
            window = set()
            for q in range(p, min(p + 1 + self.lookahead, n)):
                window.update(self.touches[q])
            for q in range(p, min(p + 1 + self.lookahead, n)):
                for s in self.reads[q]:
                    if s not in self.away:  # on the device, or made by an op before q
                        continue
                    # The op's own inputs are fetched whatever it takes (over the budget if nothing is left
                    # to evict); inputs of the ops ahead only if they fit without evicting what the
                    # window needs.
                    if self.evict_for(self.size[s], window if q > p else self.touches[p]) or q == p:
                        self.fetch(s)
            for s in self.reads[p]:
                if s in self.pending:
                    self.emit(Kind.WAIT, s)
                    self.pending.discard(s)
            produced = [s for s in self.touches[p] if s not in self.resident]
            self.evict_for(sum(self.size[s] for s in produced), self.touches[p])
            self.emit(Kind.COMPUTE, p)
            for s in produced:
                self.used += self.size[s]
                self.resident[s] = None
            for s in self.touches[p]:
                self.resident.move_to_end(s)
            self.current -= self.writes[p]
            for s in self.touches[p]:  # freed after its last use, as the lifetime analysis assumes
                if self.last_use[s] == p and s not in self.held:
                    del self.resident[s]
                    self.used -= self.size[s]
