"""Built-in workloads, built from configs with random weights (nothing is downloaded)."""

from hyperoffload.workloads.build import MODES, capture_workload, with_nsa_block
from hyperoffload.workloads.deepseek import DeepSeek, DeepSeekConfig
from hyperoffload.workloads.generate import Generated, greedy_generate, greedy_generate_uncached
from hyperoffload.workloads.llama import Llama, LlamaConfig
from hyperoffload.workloads.presets import WORKLOADS, UnknownWorkload, Workload, get_workload

__all__ = ["MODES", "WORKLOADS", "DeepSeek", "DeepSeekConfig", "Generated", "Llama", "LlamaConfig", "UnknownWorkload",
           "Workload", "capture_workload", "get_workload", "greedy_generate", "greedy_generate_uncached", "with_nsa_block"]
