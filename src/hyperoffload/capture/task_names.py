"""What the Hugging Face task adapters (``hf_tasks.TASKS``) are called, without importing torch or transformers: the
command line's ``--hf-task`` choices. A test checks that the names agree with the adapters."""

TASK_NAMES = ("speech-seq2seq", "seq2seq-lm", "masked-lm", "causal-lm", "image-classification")
"""In ``hf_tasks.TASKS`` order (the order a model's architecture is matched in)."""
