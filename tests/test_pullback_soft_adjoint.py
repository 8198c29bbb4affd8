"""soft_adjoint(model): bit-identical forwards, each layer's soft backward against a hand-written reference, and an
exact restore of the model and of torch.nn.functional afterwards."""

import threading
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from timm.layers import GELU as TimmGELU
from timm.layers import Attention as TimmAttention
from timm.layers import GELUTanh as TimmGELUTanh
from timm.layers import LayerNorm as TimmLayerNorm
from timm.layers import LayerNorm2d
from timm.layers.pool2d_same import MaxPool2dSame
from timm.models.pvt_v2 import Attention as PvtAttention
from torch import nn

from attr_engine.classifier import load_classifier
from attr_engine.pullback.soft_adjoint import soft_adjoint
from attr_engine_kernels.soft_gates import soft_maxpool2d_reference
from tests.tolerances import tol

F64 = torch.float64
TOL = tol("pullback", F64)
FUNCTIONALS = [
    (F, "relu"),
    (torch, "relu"),
    (F, "relu6"),
    (F, "gelu"),
    (F, "silu"),
    (F, "max_pool2d"),
    (F, "scaled_dot_product_attention"),
]


class Lambda(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def input_grad(model: nn.Module, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, d<output, g>/dx) for a fresh leaf copy of x."""
    x = x.detach().clone().requires_grad_(True)
    y = model(x)
    (dx,) = torch.autograd.grad(y, x, g)
    return y.detach(), dx


def soft_vs_plain(model: nn.Module, x: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Output (asserted bit-identical inside and outside) and the input gradients outside and inside the context."""
    y = model(x)
    g = torch.randn_like(y)
    y_plain, dx_plain = input_grad(model, x, g)
    with soft_adjoint(model, **kwargs):
        y_soft, dx_soft = input_grad(model, x, g)
    assert torch.equal(y_plain, y_soft)
    return g, dx_plain, dx_soft


# ---------------------------------------------------------------------------------------------------------------
# Whole timm models: forward values bit for bit
# ---------------------------------------------------------------------------------------------------------------

TIMM_CASES = {
    "resnet18": (dict(), 32, {"relu", "maxpool"}),
    "vgg11_bn": (dict(mlp_ratio=1 / 64), 32, {"relu", "maxpool"}),
    "convnext_atto": (dict(), 32, {"gelu", "layernorm2d"}),  # conv_mlp: channels-first norms only
    "vit_tiny_patch16_224": (dict(img_size=32, patch_size=8, depth=2), 32, {"gelu", "layernorm", "attention"}),
    "deit_tiny_patch16_224": (dict(img_size=32, patch_size=8, depth=2), 32, {"gelu", "layernorm", "attention"}),
    "pvt_v2_b0": (dict(depths=(1, 1, 1, 1)), 64, {"gelu", "layernorm", "attention"}),
}


def _reference_grad(
    reference: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, g: torch.Tensor
) -> torch.Tensor:
    """d<g, reference(x)>/dx: the input gradient a float64 reference function gives for the same output gradient."""
    x_ref = x.clone().requires_grad_(True)
    return torch.autograd.grad(reference(x_ref), x_ref, g)[0]


@pytest.mark.parametrize("name", list(TIMM_CASES))
def test_timm_forward_bit_identical_and_backward_soft(name: str) -> None:
    kwargs, size, kinds = TIMM_CASES[name]
    clf = load_classifier(name, num_classes=5, **kwargs)
    x = torch.rand(2, 3, size, size)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none of these architectures has a layer soft_adjoint does not know
        with soft_adjoint(clf) as ctx:
            y_soft, dx_soft = input_grad(clf, x, torch.eye(5)[[0, 3]])
    y_plain, dx_plain = input_grad(clf, x, torch.eye(5)[[0, 3]])
    assert torch.equal(y_soft, y_plain)
    assert {kind for _, kind in ctx.softened} == kinds
    # The backward did change (by a lot: these are random networks far from their linear regime).
    assert (dx_soft - dx_plain).norm() > 0.05 * dx_plain.norm()
    assert torch.isfinite(dx_soft).all()


def test_vit_explicit_softmax_path_matches_fused_path() -> None:
    """fused_attn=False computes softmax(q k^T) itself; holding it constant at attn_drop must give the SDPA result."""
    clf = load_classifier("vit_tiny_patch16_224", num_classes=4, img_size=32, patch_size=8, depth=2).double()
    x = torch.rand(2, 3, 32, 32, dtype=F64)
    g = torch.randn(2, 4, dtype=F64)
    with soft_adjoint(clf):
        y_fused, dx_fused = input_grad(clf, x, g)
    attns = [m for m in clf.modules() if isinstance(m, TimmAttention)]
    for m in attns:
        m.fused_attn = False
    y_manual_plain, _ = input_grad(clf, x, g)
    with soft_adjoint(clf):
        y_manual, dx_manual = input_grad(clf, x, g)
    assert torch.equal(y_manual, y_manual_plain)
    torch.testing.assert_close(y_manual, y_fused, **TOL)
    torch.testing.assert_close(dx_manual, dx_fused, **TOL)
    assert all(m.fused_attn is False for m in attns)


# ---------------------------------------------------------------------------------------------------------------
# Each layer's rule against a hand-written reference (float64)
# ---------------------------------------------------------------------------------------------------------------

_PHI = torch.special.ndtr
GATES = {
    "nn.ReLU": (nn.ReLU(), "relu", _PHI),
    "nn.ReLU(inplace)": (nn.ReLU(inplace=True), "relu", _PHI),
    # Functionals are looked up at call time, as model code does (a name bound at import time is out of reach).
    "F.relu": (Lambda(lambda z: F.relu(z)), "relu", _PHI),
    "torch.relu": (Lambda(lambda z: torch.relu(z)), "relu", _PHI),
    "nn.ReLU6": (nn.ReLU6(), "relu", lambda u: _PHI(u) - _PHI(u - 6 / 0.45)),
    "F.relu6": (Lambda(lambda z: F.relu6(z)), "relu", lambda u: _PHI(u) - _PHI(u - 6 / 0.45)),
    "nn.GELU": (nn.GELU(), "gelu", _PHI),
    "nn.GELU(tanh)": (nn.GELU(approximate="tanh"), "gelu", _PHI),
    "timm.GELU": (TimmGELU(), "gelu", _PHI),
    "timm.GELUTanh": (TimmGELUTanh(), "gelu", _PHI),
    "F.gelu(tanh)": (Lambda(lambda z: F.gelu(z, approximate="tanh")), "gelu", _PHI),
    "nn.SiLU": (nn.SiLU(), "silu", torch.sigmoid),
    "nn.SiLU(inplace)": (nn.SiLU(inplace=True), "silu", torch.sigmoid),
    "F.silu": (Lambda(lambda z: F.silu(z)), "silu", torch.sigmoid),
}
TAUS = {"relu_tau": 0.45, "gelu_tau": 0.7, "silu_tau": 1.3}


@pytest.mark.parametrize("case", list(GATES))
def test_gate_layer_backward_is_grad_times_gate(case: str) -> None:
    layer, kind, gate = GATES[case]
    tau = TAUS[f"{kind}_tau"]
    z = torch.randn(4, 5, 6, dtype=F64) * 4
    # The leading x * 1 keeps in-place layers off the leaf input.
    g, dx_plain, dx_soft = soft_vs_plain(nn.Sequential(Lambda(lambda t: t * 1.0), layer), z, **TAUS)
    torch.testing.assert_close(dx_soft, g * gate(z / tau), **TOL)
    assert not torch.allclose(dx_soft, dx_plain)


@pytest.mark.parametrize(
    "pool",
    [nn.MaxPool2d(3, 2, 1), nn.MaxPool2d(2, ceil_mode=True), Lambda(lambda x: F.max_pool2d(x, 3, 2, 1)), None],
    ids=["nn", "nn_ceil", "functional", "timm_same"],
)
def test_maxpool_backward_matches_soft_maxpool2d(pool: nn.Module | None) -> None:
    x = torch.randn(2, 3, 9, 9, dtype=F64)
    if pool is None:  # TF-"SAME" padding by -inf, then the functional max pool
        pool = MaxPool2dSame(3, 2)
        args, x_ref = ((3, 2, 0), F.pad(x, (1, 1, 1, 1), value=float("-inf")))
    else:
        m = pool if isinstance(pool, nn.MaxPool2d) else nn.MaxPool2d(3, 2, 1)
        args, x_ref = ((m.kernel_size, m.stride, m.padding), x)
    g, _, dx_soft = soft_vs_plain(nn.Sequential(pool), x, maxpool_tau=0.25)
    x_ref = x_ref.detach().requires_grad_(True)
    ceil = getattr(pool, "ceil_mode", False)
    (dx_ref,) = torch.autograd.grad(soft_maxpool2d_reference(x_ref, *args, tau=0.25, ceil_mode=ceil), x_ref, g)
    if dx_ref.shape != x.shape:
        dx_ref = dx_ref[..., 1:-1, 1:-1]
    torch.testing.assert_close(dx_soft, dx_ref, **TOL)


def _layer_norm_reference(x, dims, weight, bias, eps):
    var, mean = torch.var_mean(x, dim=dims, keepdim=True, correction=0)
    return (x - mean.detach()) / (var.detach() + eps).sqrt() * weight + bias


@pytest.mark.parametrize("kind", ["nn", "timm", "timm2d"])
def test_layernorm_backward_holds_statistics_constant(kind: str) -> None:
    if kind == "timm2d":
        ln, x, dims, shape = LayerNorm2d(6), torch.randn(2, 6, 3, 4, dtype=F64), (1,), (-1, 1, 1)
    else:
        ln = nn.LayerNorm((3, 6), eps=1e-3) if kind == "nn" else TimmLayerNorm(6)
        x, dims, shape = torch.randn(2, 5, 3, 6, dtype=F64), ((-2, -1) if kind == "nn" else (-1,)), None
    ln = ln.double()
    with torch.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()
    # The affine parameters are trainable here: their gradients must survive too.
    x = x * 3 + 1
    g = torch.randn_like(x)
    x_soft = x.clone().requires_grad_(True)
    with soft_adjoint(ln):
        y_soft = ln(x_soft)
        dx_soft, dw_soft, db_soft = torch.autograd.grad(y_soft, (x_soft, ln.weight, ln.bias), g)
    assert torch.equal(y_soft, ln(x))
    x_ref = x.clone().requires_grad_(True)
    w, b = (ln.weight.view(shape), ln.bias.view(shape)) if shape else (ln.weight, ln.bias)
    y_ref = _layer_norm_reference(x_ref, dims, w, b, ln.eps)
    dx_ref, dw_ref, db_ref = torch.autograd.grad(y_ref, (x_ref, ln.weight, ln.bias), g)
    torch.testing.assert_close(dx_soft, dx_ref, **TOL)
    torch.testing.assert_close(dw_soft, dw_ref, **TOL)
    torch.testing.assert_close(db_soft, db_ref, **TOL)
    dx_plain, _ = torch.autograd.grad(ln(x_ref), (x_ref, ln.weight), g)
    assert not torch.allclose(dx_soft, dx_plain)
    _, dx_plain, dx_off = soft_vs_plain(ln, x, layernorm=False)
    torch.testing.assert_close(dx_off, dx_plain, **TOL)


def _timm_attention_reference(attn: TimmAttention, x: torch.Tensor) -> torch.Tensor:
    B, N, C = x.shape
    q, k, v = attn.qkv(x).reshape(B, N, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
    weights = torch.softmax((q * attn.scale) @ k.transpose(-2, -1), dim=-1).detach()
    return attn.proj((weights @ v).transpose(1, 2).reshape(B, N, C))


def _pvt_attention_reference(attn: PvtAttention, x: torch.Tensor) -> torch.Tensor:
    B, N, C = x.shape
    q = attn.q(x).reshape(B, N, attn.num_heads, -1).permute(0, 2, 1, 3)
    k, v = attn.kv(x).reshape(B, N, 2, attn.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
    weights = torch.softmax((q * attn.scale) @ k.transpose(-2, -1), dim=-1).detach()
    return attn.proj((weights @ v).transpose(1, 2).reshape(B, N, C))


@pytest.mark.parametrize("arch", ["timm", "pvt"])
@pytest.mark.parametrize("fused", [True, False])
def test_attention_backward_skips_the_softmax(arch: str, fused: bool) -> None:
    if arch == "timm":
        attn, reference = TimmAttention(12, num_heads=3, qkv_bias=True), _timm_attention_reference
        model = Lambda(attn)
    else:
        attn, reference = PvtAttention(12, num_heads=3, sr_ratio=1), _pvt_attention_reference
        model = Lambda(attn)
        model.forward = lambda t: attn(t, [2, 3])  # PVT attention takes the token grid size
    attn.double().eval()
    attn.fused_attn = fused
    x = torch.randn(2, 6, 12, dtype=F64) * 2
    g, dx_plain, dx_soft = soft_vs_plain(model, x)
    dx_ref = _reference_grad(lambda t: reference(attn, t), x, g)
    torch.testing.assert_close(dx_soft, dx_ref, **TOL)
    assert not torch.allclose(dx_soft, dx_plain)
    _, dx_plain, dx_off = soft_vs_plain(model, x, attention=False)  # (a new random g)
    torch.testing.assert_close(dx_off, dx_plain, **TOL)


def test_relu_network_with_tiny_taus_gives_the_plain_gradient() -> None:
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1),
        nn.Conv2d(8, 8, 3), Lambda(F.relu), nn.Flatten(), nn.Linear(8 * 6 * 6, 5),
    ).double().eval()  # fmt: skip
    x = torch.randn(3, 3, 16, 16, dtype=F64)
    _, dx_plain, dx_soft = soft_vs_plain(net, x, relu_tau=1e-12, maxpool_tau=1e-12)
    torch.testing.assert_close(dx_soft, dx_plain, **TOL)
    _, _, dx_default = soft_vs_plain(net, x)
    assert not torch.allclose(dx_default, dx_plain)


# ---------------------------------------------------------------------------------------------------------------
# Restoration, unknown layers, threads
# ---------------------------------------------------------------------------------------------------------------


class Mixed(nn.Module):
    """A bit of everything: conv/BN/ReLU(inplace)/max-pool, LayerNorm2d, timm attention, GELU, functional relu."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True))
        self.pool = nn.MaxPool2d(2)
        self.norm = LayerNorm2d(8)
        self.attn = TimmAttention(8, num_heads=2)
        self.act = nn.GELU()
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.norm(self.pool(self.stem(x))).flatten(2).transpose(1, 2)
        t = t + self.attn(t)
        return self.head(F.relu(self.act(t)).mean(1))


def _snapshot(model: nn.Module) -> dict:
    return {
        name: (
            id(m),
            m.training,
            "forward" in m.__dict__,
            getattr(m, "inplace", None),
            getattr(m, "fused_attn", None),
            dict(m._forward_hooks),
            dict(m._forward_pre_hooks),
            dict(m._backward_hooks),
        )
        for name, m in model.named_modules()
    }


def test_restores_model_and_functionals_after_an_exception() -> None:
    model = Mixed().eval()
    model.attn.fused_attn = False
    model.stem[2].register_forward_hook(lambda *args: None)  # a user hook, which must stay
    state = {k: v.clone() for k, v in model.state_dict().items()}
    before = _snapshot(model)
    functionals = {key: getattr(*key) for key in FUNCTIONALS}
    x = torch.rand(2, 3, 8, 8, requires_grad=True)

    with pytest.raises(RuntimeError, match="boom"):
        with soft_adjoint(model):
            model(x).sum().backward()
            assert F.relu is not functionals[(F, "relu")]
            raise RuntimeError("boom")
    # An error raised inside a soft layer's forward must not leave anything behind either.
    with pytest.raises(RuntimeError):
        with soft_adjoint(model):
            model.norm(torch.rand(2, 5, 4, 4, requires_grad=True))  # 5 channels, LayerNorm2d(8)

    assert _snapshot(model) == before
    assert {k: torch.equal(v, state[k]) for k, v in model.state_dict().items()} == dict.fromkeys(state, True)
    assert {key: getattr(*key) for key in FUNCTIONALS} == functionals
    # And the soft adjoint still works afterwards (a leaked "suspended" state would silently make it plain).
    _, dx_plain, dx_soft = soft_vs_plain(model, x.detach())
    assert not torch.allclose(dx_soft, dx_plain)


def test_context_is_single_use() -> None:
    ctx = soft_adjoint(nn.ReLU())
    with ctx:
        pass
    with pytest.raises(RuntimeError, match="entered once"):
        with ctx:
            pass


def test_unknown_gated_layers_are_reported() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Hardswish(), nn.ELU(), nn.ReLU(), nn.GroupNorm(2, 4))
    with pytest.warns(UserWarning, match=r"1 \(Hardswish: activation\).*2 \(ELU: activation\).*4 \(GroupNorm"):
        with soft_adjoint(model) as ctx:
            pass
    assert [name for name, _ in ctx.unknown] == ["1", "2", "4"]
    assert ctx.softened == [("3", "relu")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with soft_adjoint(model, warn_unknown=False):
            pass


def test_functional_patches_are_soft_only_in_the_entering_thread() -> None:
    z = torch.randn(50, dtype=F64)
    results = {}

    def relu_grad(key: str) -> None:
        zz = z.clone().requires_grad_(True)
        (results[key],) = torch.autograd.grad(F.relu(zz).sum(), zz)

    with soft_adjoint(nn.Identity(), relu_tau=0.5):
        worker = threading.Thread(target=relu_grad, args=("other",))
        worker.start()
        worker.join()
        relu_grad("this")
    torch.testing.assert_close(results["other"], (z > 0).to(F64), **TOL)
    torch.testing.assert_close(results["this"], _PHI(z / 0.5), **TOL)


# ---------------------------------------------------------------------------------------------------------------
# Nesting, out-of-order exits and concurrent threads: no state leaks between contexts or threads
# ---------------------------------------------------------------------------------------------------------------


def _relu_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1)).double()


def _relu_preacts(net: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    z1 = net[0](x)
    return z1, net[2](torch.relu(z1))


def _grad(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    xx = x.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(net(xx).sum(), xx)
    return g


def _soft_grad_reference(net: nn.Module, x: torch.Tensor, tau: float) -> torch.Tensor:
    """d/dx of the two-ReLU net with each ReLU's derivative replaced by Phi(z / tau), by hand."""
    z1, z2 = _relu_preacts(net, x)
    g2 = net[4].weight * _PHI(z2 / tau)  # (B, 16)
    g1 = (g2 @ net[2].weight) * _PHI(z1 / tau)
    return g1 @ net[0].weight


def test_contexts_nest_and_exit_in_any_order_leaving_nothing_behind() -> None:
    net = _relu_net()
    x = torch.randn(4, 6, dtype=F64)
    plain = _grad(net, x)
    before = _snapshot(net)
    outer, inner = soft_adjoint(net, relu_tau=0.5), soft_adjoint(net, relu_tau=2.0)
    outer.__enter__()
    torch.testing.assert_close(_grad(net, x), _soft_grad_reference(net, x, 0.5), **TOL)
    inner.__enter__()  # the innermost context sets the temperatures
    torch.testing.assert_close(_grad(net, x), _soft_grad_reference(net, x, 2.0), **TOL)
    outer.__exit__(None, None, None)  # out of order: the outer one closes first
    torch.testing.assert_close(_grad(net, x), _soft_grad_reference(net, x, 2.0), **TOL)
    inner.__exit__(None, None, None)
    assert _snapshot(net) == before
    assert torch.equal(_grad(net, x), plain)
    # An inner context that keeps a module plain wins over an outer one that softens it.
    ln = nn.LayerNorm(6).double()
    y = torch.randn(3, 6, dtype=F64)
    ln_plain = _grad(ln, y)
    with soft_adjoint(ln):
        ln_soft = _grad(ln, y)
        with soft_adjoint(ln, layernorm=False):
            assert torch.equal(_grad(ln, y), ln_plain)
        assert torch.equal(_grad(ln, y), ln_soft)
    assert not torch.allclose(ln_soft, ln_plain)


def test_other_threads_keep_the_plain_module_backward_while_a_context_is_open() -> None:
    net = _relu_net()
    x = torch.randn(4, 6, dtype=F64)
    plain = _grad(net, x)
    results = {}
    worker = threading.Thread(target=lambda: results.setdefault("other", _grad(net, x)))
    with soft_adjoint(net, relu_tau=0.5):
        worker.start()
        worker.join()
        results["this"] = _grad(net, x)
        assert torch.equal(net(x), net(x.clone()))  # forward values are untouched in either thread
    assert torch.equal(results["other"], plain)
    torch.testing.assert_close(results["this"], _soft_grad_reference(net, x, 0.5), **TOL)


def test_concurrent_pullbacks_on_one_classifier_leave_no_soft_forward_behind() -> None:
    """Issue #10.1: two threads (2 and 40 ascent steps) on one classifier used to leave soft forwards installed."""
    from attr_engine.classifier import Classifier
    from attr_engine.pullback import SemanticPullback

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(6, 6, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(6 * 4 * 4, 3),
    ).double()  # fmt: skip
    clf = Classifier(model, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
    x = torch.rand(2, 3, 8, 8, dtype=F64)
    target = torch.tensor([0, 2])
    before = _snapshot(clf)
    plain = _grad(clf, x)
    sp = SemanticPullback(clf)
    alone = {steps: sp.attribute(x, target, steps=steps) for steps in (2, 40)}

    # Each thread waits at its first forward until the other has entered its context too, so the two contexts
    # overlap for sure; the 40-step one then waits at its second forward until the 2-step one has returned, so the
    # context entered first is also the first to close, while the other is still running.
    barrier, calls, short_done = threading.Barrier(2, timeout=30), {}, threading.Event()

    def meet(_module, _inputs):
        me = threading.current_thread().name
        calls[me] = calls.get(me, 0) + 1
        if calls[me] == 1:
            barrier.wait()
        elif calls[me] == 2 and me == "steps40":
            assert short_done.wait(timeout=30)

    handle = clf.register_forward_pre_hook(meet)
    results, errors = {}, []

    def run(steps: int) -> None:
        try:
            results[steps] = sp.attribute(x, target, steps=steps)
        except BaseException as err:  # surfaced below: a failing thread must fail the test
            errors.append(err)
        finally:
            if steps == 2:
                short_done.set()

    threads = [threading.Thread(target=run, args=(steps,), name=f"steps{steps}") for steps in (2, 40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    handle.remove()
    assert not errors, errors
    assert _snapshot(clf) == before  # no module keeps an instance forward
    assert torch.equal(_grad(clf, x), plain)  # the plain gradient is bit-identical to before
    for steps in (2, 40):
        torch.testing.assert_close(results[steps], alone[steps], **TOL)


def test_every_soft_adjoint_default_temperature_is_the_kernels_one() -> None:
    from attr_engine.pullback import PullbackConfig
    from attr_engine.pullback.soft_adjoint import SoftAdjoint
    from attr_engine_kernels.soft_gates import DEFAULT_POOL_TAU, DEFAULT_TAU

    expected = {"relu_tau": 0.6, "gelu_tau": 1.0, "silu_tau": 1.6, "maxpool_tau": 0.3}  # the paper's
    assert {"relu_tau": DEFAULT_TAU["relu"], "gelu_tau": DEFAULT_TAU["gelu"], "silu_tau": DEFAULT_TAU["silu"],
            "maxpool_tau": DEFAULT_POOL_TAU} == expected  # fmt: skip
    ctx = soft_adjoint(nn.Identity())
    config = PullbackConfig()
    for name, value in expected.items():
        assert getattr(ctx, name) == value and getattr(config, name) == value
        assert getattr(SoftAdjoint(nn.Identity()), name) == value


# ---------------------------------------------------------------------------------------------------------------
# torchvision and transformers models (the shared tiny classifiers of conftest.py)
# ---------------------------------------------------------------------------------------------------------------

FOREIGN_CASES = {
    "tv_resnet": {"relu", "maxpool"},
    "tv_vit": {"gelu", "layernorm", "held_softmax"},
    "hf_vit": {"gelu_exact", "layernorm", "held_softmax"},
}


@pytest.mark.parametrize("name", list(FOREIGN_CASES))
def test_torchvision_and_hf_forward_bit_identical_and_backward_soft(name: str, request) -> None:
    clf = request.getfixturevalue(name)
    x, g = torch.rand(2, 3, 32, 32), torch.eye(5)[[0, 3]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every layer of these models is known
        with soft_adjoint(clf) as ctx:
            y_soft, dx_soft = input_grad(clf, x, g)
    y_plain, dx_plain = input_grad(clf, x, g)
    assert torch.equal(y_soft, y_plain)
    assert {kind for _, kind in ctx.softened} == FOREIGN_CASES[name]
    assert (dx_soft - dx_plain).norm() > 0.05 * dx_plain.norm()


def test_torchvision_layernorm2d_holds_statistics_constant() -> None:
    from torchvision.models.convnext import LayerNorm2d as TvLayerNorm2d

    ln = TvLayerNorm2d(6).double()
    with torch.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()
    ln.requires_grad_(False)
    x = torch.randn(2, 6, 3, 4, dtype=F64) * 3 + 1
    g, dx_plain, dx_soft = soft_vs_plain(ln, x)
    w, b = ln.weight.view(-1, 1, 1), ln.bias.view(-1, 1, 1)
    dx_ref = _reference_grad(lambda t: _layer_norm_reference(t, (1,), w, b, ln.eps), x, g)
    torch.testing.assert_close(dx_soft, dx_ref, **TOL)
    assert not torch.allclose(dx_soft, dx_plain)


def _hf_activations() -> dict:
    from transformers import activations as A

    phi = _PHI
    return {
        "GELUActivation": (A.GELUActivation(), "gelu", phi),
        "GELUActivation(python)": (A.GELUActivation(use_gelu_python=True), "gelu", phi),
        "NewGELUActivation": (A.NewGELUActivation(), "gelu", phi),
        "QuickGELUActivation": (A.QuickGELUActivation(), "gelu", phi),
        "GELUTanh": (A.GELUTanh(), "gelu", phi),
        "SiLUActivation": (A.SiLUActivation(), "silu", torch.sigmoid),
    }


@pytest.mark.parametrize("case", list(_hf_activations()))
def test_hf_activation_keeps_its_value_and_takes_the_soft_gate(case: str) -> None:
    layer, kind, gate = _hf_activations()[case]
    tau = TAUS[f"{kind}_tau"]
    z = torch.randn(4, 5, 6, dtype=F64) * 4
    g, dx_plain, dx_soft = soft_vs_plain(nn.Sequential(Lambda(lambda t: t * 1.0), layer), z, **TAUS)
    torch.testing.assert_close(dx_soft, g * gate(z / tau), **TOL)
    assert not torch.allclose(dx_soft, dx_plain)


def _mha_reference(mha: nn.MultiheadAttention, x: torch.Tensor) -> torch.Tensor:
    B, N, D = x.shape
    heads = mha.num_heads
    q, k, v = F.linear(x, mha.in_proj_weight, mha.in_proj_bias).chunk(3, dim=-1)
    q, k, v = (t.reshape(B, N, heads, -1).transpose(1, 2) for t in (q, k, v))
    weights = torch.softmax(q @ k.transpose(-2, -1) / (D // heads) ** 0.5, dim=-1).detach()
    return mha.out_proj((weights @ v).transpose(1, 2).reshape(B, N, D))


@pytest.mark.parametrize("need_weights", [False, True], ids=["sdpa", "softmax"])
def test_multihead_attention_backward_skips_the_softmax(need_weights: bool) -> None:
    mha = nn.MultiheadAttention(12, 3, batch_first=True).double().eval()
    model = Lambda(mha)  # mha a submodule, so soft_adjoint finds it
    model.forward = lambda t: mha(t, t, t, need_weights=need_weights)[0]
    x = torch.randn(2, 6, 12, dtype=F64) * 2
    g, dx_plain, dx_soft = soft_vs_plain(model, x)
    dx_ref = _reference_grad(lambda t: _mha_reference(mha, t), x, g)
    torch.testing.assert_close(dx_soft, dx_ref, **TOL)
    assert not torch.allclose(dx_soft, dx_plain)


def _hf_attention_reference(attn: nn.Module, x: torch.Tensor, softmax_dtype: torch.dtype) -> torch.Tensor:
    B, N, _ = x.shape
    heads = attn.num_attention_heads
    q, k, v = (p(x).reshape(B, N, heads, -1).transpose(1, 2) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    scores = q @ k.transpose(-2, -1) * attn.scaling
    weights = torch.softmax(scores, dim=-1, dtype=softmax_dtype).to(x.dtype).detach()
    return attn.o_proj((weights @ v).transpose(1, 2).reshape(B, N, -1))


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_hf_attention_backward_skips_the_softmax(implementation: str) -> None:
    from tests.conftest import tiny_hf_vit

    attn = tiny_hf_vit(implementation).double().eval().vit.layers[0].attention
    model = Lambda(attn)
    model.forward = lambda t: attn(t)[0]
    x = torch.randn(2, 17, 32, dtype=F64)
    g, dx_plain, dx_soft = soft_vs_plain(model, x)
    # transformers' eager attention takes its softmax in float32 (then casts back); SDPA stays in float64.
    softmax_dtype = torch.float32 if implementation == "eager" else F64
    dx_ref = _reference_grad(lambda t: _hf_attention_reference(attn, t, softmax_dtype), x, g)
    torch.testing.assert_close(dx_soft, dx_ref, **TOL)
    assert not torch.allclose(dx_soft, dx_plain)
    _, dx_plain, dx_off = soft_vs_plain(model, x, attention=False)
    torch.testing.assert_close(dx_off, dx_plain, **TOL)


def test_hf_layers_out_of_reach_are_reported() -> None:
    from transformers.activations import MishActivation

    from tests.conftest import tiny_hf_vit

    model = tiny_hf_vit("eager")
    model.vit.layers[1].mlp.activation_fn = MishActivation()
    model.config._attn_implementation = "flash_attention_2"  # a kernel the functional patches cannot reach
    with pytest.warns(UserWarning, match=r"MishActivation: activation.*attn_implementation='flash_attention_2'|"
                      r"attn_implementation='flash_attention_2'.*MishActivation: activation") as record:  # fmt: skip
        with soft_adjoint(model):
            pass
    assert "only 'eager' and 'sdpa' are covered" in str(record[0].message)
