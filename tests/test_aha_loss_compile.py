"""The soft-AUC objective traces as one graph (no host synchronisation, no graph break) and equals eager.

``torch.compile(fullgraph=True)`` fails on any graph break: a tensor read on the host (``.item()``, ``bool(t)``),
a data-dependent branch or an untraceable call. Passing it on the CPU reference path shows the step has none of
those, which on a GPU is what keeps it free of host-device synchronisations; the CUDA test below checks the same
with ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import torch

import attr_engine_kernels as kernels
from attr_engine.aha.loss import soft_auc_loss
from tests.aha_helpers import colour_classifier, colour_images
from tests.conftest import requires_cuda


def _loss_and_grad(fn, clf, x, maps, target, reference, seed: int):
    maps = maps.detach().clone().requires_grad_()
    fractions = torch.linspace(0.0, 1.0, 8)
    res = fn(clf, x, maps, target, reference, grid=4, fractions=fractions, tau=0.3, n_iters=5, generator=seed,
             offset=(0.25, 0.5), peak_weight=0.1)  # fmt: skip
    (grad,) = torch.autograd.grad(res.loss, maps)
    return res.loss.detach(), res.deletion.detach(), res.insertion.detach(), grad


def test_soft_auc_loss_compiles_fullgraph_and_equals_eager() -> None:
    clf = colour_classifier()
    x, target = colour_images(3, size=16)
    maps = torch.randn(3, 16, 16)
    reference = torch.full_like(x, 0.5)
    compiled = torch.compile(soft_auc_loss, fullgraph=True, backend="aot_eager")
    with kernels.set_backend("reference"):
        eager = _loss_and_grad(soft_auc_loss, clf, x, maps, target, reference, seed=5)
        for seed in (5, 6):  # a new sorter seed each step, as in training: no graph break, no recompile error
            got = _loss_and_grad(compiled, clf, x, maps, target, reference, seed=seed)
            if seed == 5:
                for e, o in zip(eager, got, strict=True):
                    torch.testing.assert_close(o, e, rtol=1e-5, atol=1e-6)
    assert not torch.equal(got[3], eager[3])  # another seed draws other noise, so the graph really ran again


def _sync_warnings(run) -> int:
    """Number of synchronising CUDA calls ``run`` makes (sync debug mode "warn" records each as a warning)."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@requires_cuda
def test_engine_hot_loops_never_synchronise_on_cuda() -> None:  # pragma: no cover - needs a GPU
    """The AHA step's objective makes no synchronising call at all (sync debug mode "error"); Pullback Ascent and
    deletion/insertion validate their inputs once at entry (a few synchronisations by design), so their count must
    not grow with the number of ascent steps or curve points."""
    from attr_engine.metrics import deletion_insertion
    from attr_engine.pullback import SemanticPullback

    clf = colour_classifier().cuda()
    x, target = colour_images(4, size=32)
    x, target = x.cuda(), target.cuda()
    maps = torch.randn(4, 32, 32, device="cuda", requires_grad=True)
    reference = torch.full_like(x, 0.5)
    fractions = torch.linspace(0.0, 1.0, 8, device="cuda")

    def step() -> None:
        res = soft_auc_loss(clf, x, maps, target, reference, grid=4, fractions=fractions, tau=0.3, n_iters=5,
                            generator=3)  # fmt: skip
        res.loss.backward()

    step()  # warm-up: kernel compilation and the cached grid geometry's host-to-device copies
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    sp = SemanticPullback(clf)
    ascent = [_sync_warnings(lambda k=k: sp.attribute(x, target, method="ascent", steps=k)) for k in (2, 2, 8)]
    assert ascent[2] == ascent[1]
    # batch_size 8: 3 classifier chunks at 5 points, 20 at 40 points; no chunk may synchronise.
    del_ins = lambda k: deletion_insertion(clf, x, maps.detach(), target, steps=k, batch_size=8)
    curves = [_sync_warnings(lambda k=k: del_ins(k)) for k in (5, 5, 40)]
    assert curves[2] == curves[1]
