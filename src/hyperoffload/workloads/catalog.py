"""What the built-in workloads and their steps are called, and the step options' defaults, without building anything:
the command line's flags and ``--help`` read them without importing torch. ``presets.WORKLOADS`` holds the
workloads themselves (a test checks that the names agree)."""

WORKLOAD_NAMES = ("tiny-llama", "llama3-8b", "llama3-70b", "tiny-deepseek", "deepseek-v2-lite", "deepseek-v3")
"""The built-in workloads, in ``presets.WORKLOADS`` order."""

MODES = ("train", "prefill", "decode")
"""The steps a workload is captured for."""

DEFAULT_RESELECTION = 0.75
"""Share of a decode step's selected blocks that the same layer selected for the same sequence one step
before: the stated statistic simulations of a pooled remote cache use. Measured on ``tiny-deepseek``
decode with random weights (``bench/remote_kv.py``, ``RemoteKVStats.reselection_rate``): 0.786 after a
100-token prompt, 0.745 after 1000 tokens. Trained models' selections are likely stickier."""
