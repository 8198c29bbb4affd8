"""The map's way back to the input resolution at a decoder stride: guided (joint bilateral) against bilinear.

- guided: :class:`attr_engine.aha.network.GuidedUpsample`, the softmax over each pixel's 3 x 3 nearest cells
  weighted by distance and colour (what ``AHAConfig.decoder_upsample="guided"`` runs: in eager PyTorch its
  ``all_cells`` form a few images at a time).
- guided all cells / guided cell by cell: its two forms of the same map, each over the whole batch
  (``GuidedUpsample.all_cells``, one (B, 9, s^2, h, w) softmax; ``GuidedUpsample.cell_by_cell``, the exported one).
- bilinear: ``F.interpolate(..., mode="bilinear")`` of the scores (``decoder_upsample="bilinear"``).
- onnx all cells / onnx cell by cell: the two guided forms exported (``torch.onnx.export(dynamo=True)``, the batch
  dimension symbolic) and run in onnxruntime with as many threads as torch has.

Inference only (``torch.no_grad``), the shapes of one serving call at 224 px: batch 1 and 32, strides 4 and 8.
The decoder's share of a served map is in ``benches/bench_serve.py``; this isolates the upsampling step. Run from
the repository root (``OMP_NUM_THREADS`` sets the threads):
``python -m pytest benches/bench_upsample.py -q --benchmark-min-rounds=5``.
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from attr_engine.aha.network import GuidedUpsample
from benches.bench_serve import session

SIZE = 224
EAGER = ("guided", "guided all cells", "guided cell by cell", "bilinear")
ONNX = ("onnx all cells", "onnx cell by cell")


class _Form(torch.nn.Module):
    """One guided form as a module of its own, so the exporter records that form and no other."""

    def __init__(self, up: GuidedUpsample, form: str) -> None:
        super().__init__()
        self.up, self.form = up, form

    def forward(self, maps: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.up.all_cells(maps, x) if self.form == "all cells" else self.up.cell_by_cell(maps, x)


@functools.cache
def _session(form: str, stride: int):  # -> onnxruntime.InferenceSession
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")  # torch.onnx.export(dynamo=True) needs it
    maps, x = torch.randn(2, SIZE // stride, SIZE // stride), torch.rand(2, 3, SIZE, SIZE)
    batch = torch.export.Dim("batch")
    program = torch.onnx.export(
        _Form(GuidedUpsample(stride), form),
        (maps, x),
        dynamo=True,
        input_names=["maps", "x"],
        dynamic_shapes={"maps": {0: batch}, "x": {0: batch}},
        verbose=False,
    )
    with tempfile.TemporaryDirectory() as tmp:  # the session holds the graph: the file can go
        path = Path(tmp) / "upsample.onnx"
        program.save(str(path))
        return session(path, torch.get_num_threads())


def _case(upsample: str, stride: int, batch: int) -> Callable[[], object]:
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(batch, 3, SIZE, SIZE, generator=gen)
    low = torch.randn(batch, SIZE // stride, SIZE // stride, generator=gen)
    up = GuidedUpsample(stride)
    if upsample in ONNX:
        exported, feed = _session(upsample.removeprefix("onnx "), stride), {"maps": low.numpy(), "x": x.numpy()}
        return lambda: exported.run(None, feed)
    if upsample == "guided":
        return lambda: up(low, x)
    if upsample == "guided all cells":
        return lambda: up.all_cells(low, x)
    if upsample == "guided cell by cell":
        return lambda: up.cell_by_cell(low, x)
    return lambda: F.interpolate(low[:, None], size=(SIZE, SIZE), mode="bilinear", align_corners=False)[:, 0]


@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("stride", [4, 8])
@pytest.mark.parametrize("upsample", EAGER + ONNX)
def test_upsample(benchmark: pytest.FixtureRequest, upsample: str, stride: int, batch: int) -> None:
    benchmark.group = f"upsample x{stride}, batch {batch}"
    benchmark.extra_info.update({"size": SIZE, "stride": stride, "batch": batch, "threads": torch.get_num_threads()})
    fn = _case(upsample, stride, batch)
    with torch.no_grad():
        fn()  # warm-up: allocator growth stays out of the timing
        benchmark(fn)
