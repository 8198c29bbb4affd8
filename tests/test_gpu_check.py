"""benches/gpu_check.py --smoke: the one GPU script runs end to end on the CPU (tiny sizes, interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_smoke_runs_every_part_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the script sets it itself
    proc = subprocess.run(
        [sys.executable, "benches/gpu_check.py", "--smoke", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert {k["op"] for k in record["kernels"]} == {
        "sinkhorn", "soft_topk_masks", "region_pool", "soft_mask_blend", "soft_gate", "soft_maxpool2d"
    }  # fmt: skip
    assert all(k["ok"] for k in record["kernels"])
    engine = {(r["workload"], r["model"]): r for r in record["engine"]}
    want = {
        ("AHA training step", "test_vit"), ("AHA attribute T=0", "test_vit"), ("AHA attribute T=3", "test_vit"),
        ("AHA training step", "test_convnext"), ("AHA attribute T=3", "test_convnext"),
        ("Soft pullback (SfP)", "test_resnet"), ("Pullback ascent K=5", "test_vit"),
        ("deletion + insertion (21 points)", "test_vit"),
    }  # fmt: skip
    assert want <= set(engine)
    for r in engine.values():
        assert "error" not in r, r
        assert r["images_per_s"] > 0 and 0.0 <= r["engine_share"] <= 1.0
        assert r["classifier_images"] > 0  # the classifier's own passes were seen and replayed
    # A training step pushes 2 x S blended copies of every image through the classifier, refinement T times that.
    assert engine[("AHA training step", "test_vit")]["classifier_images"] > 2 * 4
    assert "| workload | model |" in proc.stdout
