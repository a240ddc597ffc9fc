"""``keep_freed_host_memory``: freed host memory is handed out again instead of faulted in anew."""

from __future__ import annotations

import platform
import resource

import pytest
import torch

from hyperoffload.runtime.host_malloc import keep_freed_host_memory

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")


def _faults_of(make_and_free, repeats: int = 20) -> int:
    make_and_free()  # the first round may map the memory
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(repeats):
        make_and_free()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_buffers_freed_and_made_again_touch_no_new_pages():
    assert keep_freed_host_memory()

    def make_and_free():  # 4 MiB, over glibc's default mmap threshold: each would be new pages by default
        for _ in range(4):
            torch.empty(1 << 20).fill_(1.0)

    pages = 4 * 4 * (1 << 20) * 20 // 4096
    assert _faults_of(make_and_free) < pages // 20  # 5120 new pages each round by default; now (nearly) none
