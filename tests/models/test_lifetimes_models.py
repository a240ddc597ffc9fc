"""Lifetimes of a captured tiny-llama training step: the memory profile shared between callers stays as captured."""


def test_the_shared_captured_profile_cannot_be_changed_by_a_caller_and_pickles():
    import pickle

    from hyperoffload.analysis import memory_profile
    from hyperoffload.workloads import capture_workload, get_workload

    program = capture_workload(get_workload("tiny-llama"), "train").program
    first = memory_profile(program)
    ranges = dict(first.storage_ranges)
    first.storage_ranges.clear()  # the caller's own copy
    again = memory_profile(program)
    assert again.storage_ranges == ranges and again.peak_bytes == first.peak_bytes
    assert pickle.loads(pickle.dumps(again)) == again
