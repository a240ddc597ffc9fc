"""Build models and inputs without allocating their memory."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Create floating-point tensors as ``dtype`` inside the block."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@contextlib.contextmanager
def fake_build(dtype: torch.dtype = torch.float32) -> Iterator[FakeTensorMode]:
    """Inside the block, modules and tensors are fake: shapes and dtypes only, no memory.

    Build a model (any ``nn.Module``, Hugging Face ones included) and its example
    inputs here, then capture as usual: ``capture_train_step`` and friends notice the
    fake tensors and trace in the same mode. An 8B or 70B model costs kilobytes.
    """
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode, default_dtype(dtype):
        yield mode


def is_fake(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, FakeTensor)
