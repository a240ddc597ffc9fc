"""Analyses over a Program: lifetimes, the device-memory profile, and the window, flow, traffic and link bounds on
step time."""

from hyperoffload.analysis.flow_bound import FlowBound, flow_bound
from hyperoffload.analysis.lifetimes import LiveRange, MemoryProfile, live_ranges, memory_profile, storage_ranges
from hyperoffload.analysis.link_bound import LinkBound, link_bound
from hyperoffload.analysis.traffic_bound import TrafficBound, traffic_bound
from hyperoffload.analysis.window_bound import WindowBound, free_offload_budget, window_bound

__all__ = ["FlowBound", "LinkBound", "LiveRange", "MemoryProfile", "TrafficBound", "WindowBound", "flow_bound",
           "free_offload_budget", "link_bound", "live_ranges", "memory_profile", "storage_ranges", "traffic_bound",
           "window_bound"]
