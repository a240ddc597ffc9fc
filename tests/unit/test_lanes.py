"""A copy lane's reservations: searches for free positions, resumed across reservations."""

from hypothesis import given, settings
from hypothesis import strategies as st

from hyperoffload.policies.lanes import Lane


def _free(lane: Lane, begin: float, duration: float) -> bool:
    return all(end <= begin or start >= begin + duration for start, end in zip(lane.starts, lane.ends))


def _earliest(lane, op_start, lowest, duration, limit):
    return next((q for q in range(lowest, limit) if _free(lane, op_start[q], duration)), -1)


def _latest(lane, op_start, highest, duration, deadline, lowest):
    return next((q for q in range(highest, lowest - 1, -1)
                 if op_start[q] + duration <= deadline and _free(lane, op_start[q], duration)), -1)


@settings(max_examples=60, deadline=None)
@given(gaps=st.lists(st.integers(1, 5), min_size=8, max_size=40), data=st.data())
def test_searches_answer_as_from_scratch_while_reservations_are_added(gaps, data):
    """The lane remembers how far each search got; asked again after more reservations, with other bounds,
    every answer is the first (last) free position a scan of every position finds."""
    op_start = [float(sum(gaps[:k])) for k in range(len(gaps))]
    n = len(op_start)
    lane = Lane(min_gap=1.0)
    searches = [(data.draw(st.integers(0, n - 1)), float(data.draw(st.integers(1, 6)))) for _ in range(4)]
    for _ in range(12):
        for anchor, duration in searches:
            limit = data.draw(st.integers(anchor, n))
            assert (lane.earliest(op_start, anchor, duration, limit)
                    == _earliest(lane, op_start, anchor, duration, limit))
            deadline = op_start[anchor]
            lowest = data.draw(st.integers(0, anchor))
            assert (lane.latest(op_start, anchor, duration, deadline, lowest)
                    == _latest(lane, op_start, anchor, duration, deadline, lowest))
        begin = float(data.draw(st.integers(0, int(op_start[-1]))))
        lane.reserve(begin, begin + float(data.draw(st.integers(1, 4))))
