"""Analyses over a Program: lifetimes and the device-memory profile."""

from hyperoffload.analysis.lifetimes import LiveRange, MemoryProfile, live_ranges, memory_profile, storage_ranges

__all__ = ["LiveRange", "MemoryProfile", "live_ranges", "memory_profile", "storage_ranges"]
