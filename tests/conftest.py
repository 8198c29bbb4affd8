"""Test-suite set-up: Triton kernels run through the CPU interpreter, so no GPU is needed.

TRITON_INTERPRET must be in the environment before triton is imported (triton.jit reads it when a kernel is
decorated), hence it is set here, at the very top, before anything imports torch, triton or kernels.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("ATTR_ENGINE_BACKEND", "auto")

import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def _deterministic_seed() -> None:
    torch.manual_seed(0)
