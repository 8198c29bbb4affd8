"""Fused attribution kernels with pure-PyTorch references.

Public ops (each differentiable where it matters; see each docstring for shapes):

- :func:`sinkhorn` - batched log-domain Sinkhorn normalisation.
- :func:`soft_topk_masks` - Gumbel-Sinkhorn soft top-k membership masks (the AHA soft-rank sorter).
- :func:`region_pool` / :func:`soft_mask_blend` - grid pooling of maps and blending of images under grid masks
  (optionally Gaussian-smoothed, as AHA trains).
- :func:`soft_gate` / :func:`soft_maxpool2d` - exact activations whose backward uses a softened gate.

:func:`set_backend` chooses between the Triton kernels and the references (see :mod:`attr_engine_kernels._backend`);
:func:`compute_dtype` is the arithmetic dtype every op uses for an I/O dtype, for code that mirrors an op outside
``attr_engine_kernels``. Input checks shared with ``attr_engine`` live in :mod:`attr_engine_kernels.validate`.
"""

from attr_engine_kernels._backend import get_backend, set_backend
from attr_engine_kernels._tl_helpers import compute_dtype
from attr_engine_kernels.region import region_pool, soft_mask_blend
from attr_engine_kernels.sinkhorn import sinkhorn
from attr_engine_kernels.soft_gates import soft_gate, soft_maxpool2d
from attr_engine_kernels.soft_rank import soft_topk_masks

__all__ = [
    "compute_dtype",
    "get_backend",
    "region_pool",
    "set_backend",
    "sinkhorn",
    "soft_gate",
    "soft_mask_blend",
    "soft_maxpool2d",
    "soft_topk_masks",
]
