"""Capture a training or inference step of an ``nn.Module`` into a Program."""

from hyperoffload.lazy import lazy_package

_WHERE = {
    "default_dtype": "hyperoffload.capture.fake",
    "fake_build": "hyperoffload.capture.fake",
    "is_fake": "hyperoffload.capture.fake",
    "CaptureError": "hyperoffload.capture.graph_to_program",
    "program_from_graph": "hyperoffload.capture.graph_to_program",
    "capture_hf": "hyperoffload.capture.hf",
    "AdamW": "hyperoffload.capture.steps",
    "Captured": "hyperoffload.capture.steps",
    "adamw_update": "hyperoffload.capture.steps",
    "capture_decode_step": "hyperoffload.capture.steps",
    "capture_prefill_step": "hyperoffload.capture.steps",
    "capture_train_step": "hyperoffload.capture.steps",
    "capture_sharded_prefill_step": "hyperoffload.capture.sharded",
    "capture_sharded_train_step": "hyperoffload.capture.sharded",
    "lm_loss": "hyperoffload.capture.steps",
}
"""Where each attribute of the package lives (imported on first use)."""

lazy_package(__name__, _WHERE)

__all__ = ["AdamW", "CaptureError", "Captured", "adamw_update", "capture_decode_step", "capture_hf", "capture_prefill_step",
           "capture_sharded_prefill_step", "capture_sharded_train_step", "capture_train_step", "default_dtype", "fake_build", "is_fake", "lm_loss", "program_from_graph"]
