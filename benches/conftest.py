"""Benchmarks run the real (compiled) kernels on CUDA when present and the references on CPU."""

import pytest

from benches._common import DEVICE


@pytest.fixture
def device() -> str:
    return DEVICE
