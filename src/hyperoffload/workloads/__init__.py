"""Built-in workloads, built from configs with random weights (nothing is downloaded)."""

from hyperoffload.lazy import lazy_package

_WHERE = {
    "MODES": "hyperoffload.workloads.build",
    "capture_workload": "hyperoffload.workloads.build",
    "with_nsa_block": "hyperoffload.workloads.build",
    "DeepSeek": "hyperoffload.workloads.deepseek",
    "DeepSeekConfig": "hyperoffload.workloads.deepseek",
    "Generated": "hyperoffload.workloads.generate",
    "greedy_generate": "hyperoffload.workloads.generate",
    "greedy_generate_uncached": "hyperoffload.workloads.generate",
    "Llama": "hyperoffload.workloads.llama",
    "LlamaConfig": "hyperoffload.workloads.llama",
    "WORKLOADS": "hyperoffload.workloads.presets",
    "UnknownWorkload": "hyperoffload.workloads.presets",
    "Workload": "hyperoffload.workloads.presets",
    "get_workload": "hyperoffload.workloads.presets",
}
"""Where each attribute of the package lives (imported on first use)."""

lazy_package(__name__, _WHERE)

__all__ = ["MODES", "WORKLOADS", "DeepSeek", "DeepSeekConfig", "Generated", "Llama", "LlamaConfig", "UnknownWorkload",
           "Workload", "capture_workload", "get_workload", "greedy_generate", "greedy_generate_uncached", "with_nsa_block"]
