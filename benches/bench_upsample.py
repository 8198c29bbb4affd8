"""The map's way back to the input resolution at a decoder stride: guided (joint bilateral) against bilinear.

- guided: :class:`attr_engine.aha.network.GuidedUpsample`, the softmax over each pixel's 3 x 3 nearest cells
  weighted by distance and colour (what ``AHAConfig.decoder_upsample="guided"`` runs).
- bilinear: ``F.interpolate(..., mode="bilinear")`` of the scores (``decoder_upsample="bilinear"``).

Inference only (``torch.no_grad``), the shapes of one serving call at 224 px: batch 1 and 32, strides 4 and 8.
The decoder's share of a served map is in ``benches/bench_serve.py``; this isolates the upsampling step. Run from
the repository root (``OMP_NUM_THREADS`` sets the threads):
``python -m pytest benches/bench_upsample.py -q --benchmark-min-rounds=5``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from attr_engine.aha.network import GuidedUpsample

SIZE = 224


def _case(upsample: str, stride: int, batch: int) -> Callable[[], torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(batch, 3, SIZE, SIZE, generator=gen)
    low = torch.randn(batch, SIZE // stride, SIZE // stride, generator=gen)
    if upsample == "guided":
        up = GuidedUpsample(stride)
        return lambda: up(low, x)
    return lambda: F.interpolate(low[:, None], size=(SIZE, SIZE), mode="bilinear", align_corners=False)[:, 0]


@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("stride", [4, 8])
@pytest.mark.parametrize("upsample", ["guided", "bilinear"])
def test_upsample(benchmark: pytest.FixtureRequest, upsample: str, stride: int, batch: int) -> None:
    benchmark.group = f"upsample x{stride}, batch {batch}"
    benchmark.extra_info.update({"size": SIZE, "stride": stride, "batch": batch, "threads": torch.get_num_threads()})
    fn = _case(upsample, stride, batch)
    with torch.no_grad():
        fn()  # warm-up: allocator growth stays out of the timing
        benchmark(fn)
