"""Capture a training or inference step of an ``nn.Module`` into a Program."""

from hyperoffload.capture.fake import default_dtype, fake_build, is_fake
from hyperoffload.capture.graph_to_program import CaptureError, program_from_graph
from hyperoffload.capture.hf import capture_hf
from hyperoffload.capture.steps import (AdamW, Captured, adamw_update, capture_decode_step, capture_prefill_step,
                                        capture_train_step, lm_loss)

__all__ = ["AdamW", "CaptureError", "Captured", "adamw_update", "capture_decode_step", "capture_hf", "capture_prefill_step",
           "capture_train_step", "default_dtype", "fake_build", "is_fake", "lm_loss", "program_from_graph"]
