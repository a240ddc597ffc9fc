"""HyperOffload for PyTorch: compiler-planned offloading of a step's tensors to remote memory."""

from hyperoffload.analysis import LiveRange, MemoryProfile, live_ranges, memory_profile, storage_ranges
from hyperoffload.capture import (AdamW, CaptureError, Captured, capture_decode_step, capture_prefill_step,
                                  capture_train_step, fake_build)
from hyperoffload.ir import Op, Phase, Program, Value, ValueKind, verify_program

__version__ = "0.1.0"

__all__ = ["AdamW", "CaptureError", "Captured", "LiveRange", "MemoryProfile", "Op", "Phase", "Program", "Value",
           "ValueKind", "capture_decode_step", "capture_prefill_step", "capture_train_step", "fake_build",
           "live_ranges", "memory_profile", "storage_ranges", "verify_program"]
