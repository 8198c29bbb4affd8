"""Every tolerance the kernel tests use, in one table: fused (Triton) vs reference, per op and dtype.

Values are (atol, rtol) for ``torch.testing.assert_close``. Inputs are made in the listed dtype; the reference is
evaluated in float64 from the same inputs, and the fused path in the listed dtype with float32 accumulation, so the
tolerance is about the I/O precision of the dtype, not about the op's algorithm.
"""

import torch

FP64, FP32, FP16, BF16 = torch.float64, torch.float32, torch.float16, torch.bfloat16

TOLERANCES: dict[tuple[str, torch.dtype], tuple[float, float]] = {
    ("sinkhorn", FP32): (1e-5, 1e-4),
    ("sinkhorn", FP16): (2e-3, 1e-2),
    ("sinkhorn", BF16): (1e-2, 5e-2),
    # float64 rows: the structured reference against the dense definition, two float64 algorithms.
    ("soft_topk_masks", FP64): (1e-6, 1e-6),
    ("soft_topk_masks", FP32): (2e-5, 1e-4),
    ("soft_topk_masks", FP16): (2e-3, 1e-2),
    ("soft_topk_masks", BF16): (1e-2, 5e-2),
    ("region_pool", FP32): (1e-6, 1e-5),
    ("region_pool", FP16): (1e-3, 1e-2),
    ("region_pool", BF16): (8e-3, 5e-2),
    ("soft_mask_blend", FP32): (1e-6, 1e-5),
    ("soft_mask_blend", FP16): (1e-3, 1e-2),
    ("soft_mask_blend", BF16): (8e-3, 5e-2),
    ("soft_gate", FP32): (1e-6, 1e-5),
    ("soft_gate", FP16): (1e-3, 1e-2),
    ("soft_gate", BF16): (8e-3, 5e-2),
    ("soft_maxpool2d", FP32): (1e-6, 1e-5),
    ("soft_maxpool2d", FP16): (1e-3, 1e-2),
    ("soft_maxpool2d", BF16): (8e-3, 5e-2),
    # Semantic Pullback (attr_engine.pullback): float64 models against float64 hand-written references.
    ("pullback", FP64): (1e-12, 1e-9),
    # Evaluation suite (attr_engine.metrics / baselines) against Quantus 0.6.0 and Captum on float32 models: both
    # sides run the same float32 forward passes; Quantus reduces in float32 numpy where we reduce in float64.
    ("infidelity", FP32): (1e-5, 1e-4),
    ("max_sensitivity", FP32): (1e-6, 1e-5),
    ("random_logit", FP32): (1e-5, 1e-4),
    ("baselines", FP32): (1e-6, 1e-5),
}


def tol(op: str, dtype: torch.dtype) -> dict[str, float]:
    """Keyword arguments for ``torch.testing.assert_close`` for ``op`` at ``dtype``."""
    atol, rtol = TOLERANCES[(op, dtype)]
    return {"atol": atol, "rtol": rtol}
