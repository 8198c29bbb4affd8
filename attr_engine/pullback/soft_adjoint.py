"""The soft adjoint of a whole network (Semantic Pullback, arXiv 2507.22832) as a context manager.

``with soft_adjoint(model):`` leaves every forward value bit-identical and replaces the backward of the layers that
carry *state* (gates, routing, normalisation statistics, attention weights) by the paper's soft adjoint:

=====================  =========================================================================================
layer                  backward inside the context
=====================  =========================================================================================
ReLU                   ``grad * Phi(z / relu_tau)`` (:func:`attr_engine_kernels.soft_gates.soft_gate`)
ReLU6                  ``grad * (Phi(z / relu_tau) - Phi((z - 6) / relu_tau))``: the same soft step at both kinks
GELU (erf, tanh)       ``grad * Phi(z / gelu_tau)``; transformers' GELU variants (``GELUActivation``, ``NewGELU``,
                       ``QuickGELU``, ...) keep their own value and take the same gate
SiLU                   ``grad * sigmoid(z / silu_tau)`` (also transformers' ``SiLUActivation``)
MaxPool2d              spread over each window by ``softmax(window / maxpool_tau)`` (``soft_maxpool2d``)
LayerNorm              mean and variance held constant: ``grad * gamma / sigma`` per token (also timm's and
                       torchvision's channel LayerNorm2d)
softmax attention      attention weights held constant: the gradient flows through the values only (timm attention,
                       ``nn.MultiheadAttention`` of torchvision's ViT, transformers attention in its "eager" or
                       "sdpa" implementation; others, e.g. "flash_attention_2", are reported)
BatchNorm, linear ops  unchanged (affine in eval mode, already their own adjoint)
=====================  =========================================================================================

How layers are reached (the full mechanism: docs/soft_adjoint.md): modules by type through ``named_modules()``,
given a per-thread dispatcher ``forward`` while a context covering them is open (module objects, flags, parameters,
buffers and hooks are never touched); functional calls (``F.relu``, ``F.gelu``, ``F.silu``, ``F.max_pool2d``,
``F.scaled_dot_product_attention``, ``F.softmax`` inside attention, ...) by patching ``torch.nn.functional`` /
``torch`` while a context is open, soft only in the thread that entered it. Unknown modules that may carry gates keep
their plain backward and are listed in one warning. Without a gradient every soft layer runs its plain forward.
Contexts nest (the innermost sets the temperatures), exit in any order and may be open in several threads at once.
"""

from __future__ import annotations

import functools
import re
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ParamSpec, cast

import torch
import torch.nn.functional as F
from timm.layers import GELU as TimmGELU
from timm.layers import Attention as TimmAttention
from timm.layers import AttentionRope as TimmAttentionRope
from timm.layers import GELUTanh as TimmGELUTanh
from timm.layers import LayerNorm as TimmLayerNorm
from timm.layers import LayerNorm2d as TimmLayerNorm2d
from timm.layers import LayerNorm2dFp32 as TimmLayerNorm2dFp32
from timm.layers import LayerNormFp32 as TimmLayerNormFp32
from timm.layers.pool2d_same import MaxPool2dSame
from timm.models.pvt_v2 import Attention as PvtAttention
from torch import nn
from torch.autograd.function import once_differentiable

from attr_engine_kernels import compute_dtype
from attr_engine_kernels.soft_gates import DEFAULT_POOL_TAU, DEFAULT_TAU, soft_gate, soft_maxpool2d
from attr_engine_kernels.validate import check_bool, check_positive

_P = ParamSpec("_P")

__all__ = ["GELU_TAU", "MAXPOOL_TAU", "RELU_TAU", "SILU_TAU", "SoftAdjoint", "soft_adjoint"]

# The paper's soft-adjoint temperatures. Their one definition is the kernels' (kernels import nothing of
# attr_engine); every default here and in PullbackConfig reads these names.
RELU_TAU: float = DEFAULT_TAU["relu"]
GELU_TAU: float = DEFAULT_TAU["gelu"]
SILU_TAU: float = DEFAULT_TAU["silu"]
MAXPOOL_TAU: float = DEFAULT_POOL_TAU

# ----------------------------------------------------------------------------------------------------------------
# Which module types are softened, and how
# ----------------------------------------------------------------------------------------------------------------

# Classes whose own forward is the plain layer; a subclass counts only if it keeps that forward.
_MODULE_KINDS: dict[type[nn.Module], str] = {
    nn.ReLU: "relu",
    nn.ReLU6: "relu6",
    nn.GELU: "gelu",  # approximate="tanh" is read per module
    TimmGELU: "gelu",
    TimmGELUTanh: "gelu_tanh",
    nn.SiLU: "silu",
    nn.MaxPool2d: "maxpool",
    nn.LayerNorm: "layernorm",  # over the trailing normalized_shape dims
    TimmLayerNorm: "layernorm",
    TimmLayerNormFp32: "layernorm",
    TimmLayerNorm2d: "layernorm2d",  # over the channels of (B, C, H, W)
    TimmLayerNorm2dFp32: "layernorm2d",
    TimmAttention: "attention",
    TimmAttentionRope: "attention",
    PvtAttention: "attention",
    nn.MultiheadAttention: "held_softmax",  # torchvision's ViT: SDPA, or F.softmax with need_weights
}
_HF_GELUS = (
    "GELUActivation",
    "GELUTanh",
    "PytorchGELUTanh",
    "NewGELUActivation",
    "FastGELUActivation",
    "QuickGELUActivation",
    "AccurateGELUActivation",
)
# Layers of libraries attr-engine does not import (torchvision, transformers), matched by (module, class name): an
# instance can only exist once its library is imported, so nothing is imported here to know them.
_NAMED_KINDS: dict[tuple[str, str], str] = {
    # permute -> F.layer_norm over the channels -> permute back: a LayerNorm over C of (B, C, H, W).
    ("torchvision.models.convnext", "LayerNorm2d"): "layernorm2d",
    # transformers' activations compute GELU (erf, or one of its tanh / sigmoid approximations) or SiLU their own
    # way: the value is the module's own, bit for bit, and the backward the gate of the function it approximates.
    **{("transformers.activations", name): "gelu_exact" for name in _HF_GELUS},
    ("transformers.activations", "SiLUActivation"): "silu_exact",
}
# transformers' attention implementations whose softmax the functional patches reach (eager: F.softmax; sdpa:
# F.scaled_dot_product_attention); flash / flex / paged kernels compute it out of reach.
_HF_COVERED_ATTENTION = ("eager", "sdpa")
# Subclasses with their own forward that only call functions the functional patches cover.
_COVERED_BY_FUNCTIONAL_PATCH: tuple[type[nn.Module], ...] = (MaxPool2dSame,)
# Class names of normalisation layers (LayerNorm2d, RmsNorm2dFp32, GroupNormAct, GlobalResponseNorm, ...).
_NORM_NAME = re.compile(r"Norm(\d*d)?(Act)?(\d*d)?(Fp32)?$")


def _hf_attention_implementation(module: nn.Module) -> str | None:
    """The ``config._attn_implementation`` of a transformers attention module ("eager", "sdpa", ...), "eager" for
    one without a config (older modules that compute their softmax inline), None for any other module."""
    cls = type(module)
    if not cls.__module__.startswith("transformers.") or "Attention" not in cls.__name__:
        return None
    implementation = getattr(getattr(module, "config", None), "_attn_implementation", None)
    return implementation if isinstance(implementation, str) else "eager"


def _module_kind(module: nn.Module) -> str | None:
    cls = type(module)
    for base in cls.__mro__:
        kind = _MODULE_KINDS.get(base) or _NAMED_KINDS.get((base.__module__, base.__qualname__))
        if kind is not None and issubclass(base, nn.Module):  # always a Module (a key); narrows base for .forward
            # A subclass that overrides forward may do anything (e.g. LayerNorm + activation): not this kind.
            return kind if cls.forward is base.forward else None
    if _hf_attention_implementation(module) in _HF_COVERED_ATTENTION:
        return "held_softmax"
    return None


def _unknown_reason(module: nn.Module) -> str | None:
    """Why a module the soft adjoint does not handle may carry a gate, or None if it is harmless."""
    cls = type(module)
    name = cls.__name__
    if isinstance(module, _COVERED_BY_FUNCTIONAL_PATCH):
        return None
    implementation = _hf_attention_implementation(module)
    if implementation is not None:  # not covered, or _module_kind would have matched it
        return f"attention (attn_implementation={implementation!r}; only 'eager' and 'sdpa' are covered)"
    if isinstance(module, nn.modules.batchnorm._BatchNorm) or "BatchNorm" in name:
        return None  # affine in eval mode: the plain backward is its adjoint
    if cls.__module__ == "torch.nn.modules.activation" or cls.__module__.startswith(
        ("timm.layers.activations", "transformers.activations")
    ):
        return "activation"
    norm_types = (nn.GroupNorm, nn.LocalResponseNorm, nn.LayerNorm, nn.RMSNorm, nn.modules.instancenorm._InstanceNorm)
    if isinstance(module, norm_types) or _NORM_NAME.search(name):
        return "normalisation"
    if "Attention" in name or name.endswith("Attn"):
        return "attention"
    pool_types = (
        nn.modules.pooling._MaxPoolNd,
        nn.modules.pooling._AdaptiveMaxPoolNd,
        nn.modules.pooling._LPPoolNd,
        nn.FractionalMaxPool2d,
        nn.FractionalMaxPool3d,
    )
    if isinstance(module, pool_types) or "MaxPool" in name or "AvgMax" in name:
        return "max pooling"
    return None


# ----------------------------------------------------------------------------------------------------------------
# Soft layers (exact forward value, soft backward)
# ----------------------------------------------------------------------------------------------------------------

_THREAD = threading.local()  # .stack: open SoftAdjoint contexts of this thread; .suspended: nesting depth


def _stack() -> list[SoftAdjoint]:
    stack = getattr(_THREAD, "stack", None)
    if stack is None:
        stack = _THREAD.stack = []
    return stack


@contextmanager
def _suspended() -> Iterator[None]:
    """While a soft layer computes, functional patches fall through to the plain functions (no recursion)."""
    _THREAD.suspended = getattr(_THREAD, "suspended", 0) + 1
    try:
        yield
    finally:
        _THREAD.suspended -= 1


def _active() -> SoftAdjoint | None:
    if getattr(_THREAD, "suspended", 0):
        return None
    stack = _stack()
    return stack[-1] if stack else None


def _needs_grad(*tensors: Any) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _soft_relu6(x: torch.Tensor, tau: float) -> torch.Tensor:
    # relu6(z) = relu(z) - relu(z - 6): both kinks get the ReLU's soft step. The gradient rides on a term that is
    # exactly zero in the forward ((x - x) * g), so the value is hardtanh's own, bit for bit.
    xd = x.detach()
    xf = xd.to(torch.float64 if xd.dtype == torch.float64 else torch.float32)
    gate = torch.special.ndtr(xf / tau) - torch.special.ndtr((xf - 6.0) / tau)
    return F.hardtanh(xd, 0.0, 6.0) + (x - xd) * gate.to(x.dtype)


def _held_rstd(xd: torch.Tensor, dims: tuple[int, ...], eps: float) -> torch.Tensor:
    """Per-token ``1 / sqrt(var + eps)`` of a LayerNorm over ``dims`` (trailing dims, or ``(1,)``: the channels of
    (B, C, ...)), keepdim-shaped, in float32 (float64 for float64 input).

    From ``torch.native_layer_norm``, the kernel ``F.layer_norm`` itself runs: on the CPU several times faster than
    ``torch.var_mean`` over the last dim (benches/README.md, "Measurements moved from docstrings").
    """
    cd = compute_dtype(xd.dtype)
    if dims == (1,):
        t = xd.to(cd).movedim(1, -1)
        _, _, rstd = torch.native_layer_norm(t, (t.shape[-1],), None, None, eps)
        return rstd.movedim(-1, 1)
    t = xd.to(cd)
    _, _, rstd = torch.native_layer_norm(t, t.shape[t.ndim - len(dims) :], None, None, eps)
    return rstd


class _HeldStatistics(torch.autograd.Function):
    """A LayerNorm with its mean and variance held constant: the module's own value in the forward, bit for bit,
    and ``grad * gamma / sigma`` (per token) in the backward.

    A custom function rather than ``exact + (x - x.detach()) * scale``: that zero-valued term costs three passes
    over x in the forward and keeps a full-size scale alive; this saves only the per-token ``1 / sigma`` and gamma.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        plain: Callable[[torch.Tensor], torch.Tensor],
        dims: tuple[int, ...],
        gamma: torch.Tensor | None,
        eps: float,
    ) -> torch.Tensor:
        exact = plain(x)  # the module's own forward (autograd is off inside a custom function's forward)
        rstd = _held_rstd(x, dims, eps)
        ctx.save_for_backward(rstd, None if gamma is None else gamma.to(rstd.dtype))
        ctx.dtype = x.dtype
        return exact

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        rstd, gamma = ctx.saved_tensors
        g = grad.to(rstd.dtype) * rstd
        if gamma is not None:
            g = g.mul_(gamma)
        return g.to(ctx.dtype), None, None, None, None


def _soft_layer_norm(
    x: torch.Tensor,
    plain: Callable[[torch.Tensor], torch.Tensor],
    dims: tuple[int, ...],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """The module's own value ``plain(x)`` with the gradient of a LayerNorm whose mean and variance are constant.

    With mu and sigma constant, LN(x) = (x - mu) / sigma * gamma + beta is linear in x with slope gamma / sigma (per
    token): :class:`_HeldStatistics` passes exactly that slope back. Trainable affine parameters keep their true
    gradient (x_hat * grad, grad) through terms that are exactly zero in the forward.
    """
    # gamma / beta broadcast against x: trailing dims as they are, or (C,) -> (1, C, 1, ...) for channel norms.
    shape = (-1,) + (1,) * (x.ndim - 2) if dims == (1,) else None
    gamma = None if weight is None else weight.detach().view(shape) if shape else weight.detach()
    y = _HeldStatistics.apply(x, plain, dims, gamma, eps)
    if weight is not None and weight.requires_grad:
        xd = x.detach()
        cd = compute_dtype(xd.dtype)
        var, mean = torch.var_mean(xd.to(cd), dim=dims, keepdim=True, correction=0)
        dw = weight - weight.detach()
        y = y + (dw.view(shape) if shape else dw) * ((xd.to(cd) - mean) * (var + eps).rsqrt()).to(x.dtype)
    if bias is not None and bias.requires_grad:
        db = bias - bias.detach()
        y = y + (db.view(shape) if shape else db)
    return y


def _gate_forward(module: nn.Module, plain: Callable[..., Any], kind: str, tau: float) -> Callable[..., Any]:
    if kind == "gelu" and getattr(module, "approximate", "none") == "tanh":
        kind = "gelu_tanh"

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not _needs_grad(x):
            return plain(x)
        with _suspended():
            if kind == "relu6":
                return _soft_relu6(x, tau)
            # Out of place even for inplace=True modules: the soft backward needs the pre-activation.
            return soft_gate(x, kind, tau)

    return forward


def _exact_gate_forward(plain: Callable[..., Any], kind: str, tau: float) -> Callable[..., Any]:
    """The module's own value, bit for bit, with the soft gate of ``kind`` ("gelu": ``Phi(z / tau)``, "silu":
    ``sigmoid(z / tau)``) as its gradient: for activations that compute a GELU or SiLU their own way."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not _needs_grad(x):
            return plain(x)
        with _suspended():
            with torch.no_grad():
                exact = plain(x)
            xd = x.detach()
            xf = xd.to(torch.float64 if xd.dtype == torch.float64 else torch.float32)
            gate = torch.sigmoid(xf / tau) if kind == "silu" else torch.special.ndtr(xf / tau)
            # The gradient rides on a term that is exactly zero in the forward, as in _soft_relu6.
            return exact + (x - xd) * gate.to(x.dtype)

    return forward


def _held_softmax_forward(plain: Callable[..., Any]) -> Callable[..., Any]:
    """Run an attention module's own forward with every ``F.softmax`` / ``torch.softmax`` in it held constant
    (transformers' eager attention, nn.MultiheadAttention with ``need_weights``); its SDPA path is held by the
    ``F.scaled_dot_product_attention`` patch. Inside an attention module the softmax is the attention softmax."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        _THREAD.held = getattr(_THREAD, "held", 0) + 1
        try:
            return plain(*args, **kwargs)
        finally:
            _THREAD.held -= 1

    return forward


def _maxpool_forward(module: nn.MaxPool2d, plain: Callable[..., Any], tau: float) -> Callable[..., Any]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        if not _needs_grad(x) or x.ndim != 4:
            return plain(x)
        with _suspended():
            m = module
            return soft_maxpool2d(x, m.kernel_size, m.stride, m.padding, tau, m.dilation, m.ceil_mode)

    return forward


def _layer_norm_forward(module: nn.LayerNorm, plain: Callable[..., Any], channels: bool) -> Callable[..., Any]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        if not _needs_grad(x, module.weight, module.bias):
            return plain(x)
        with _suspended():
            dims = (1,) if channels else tuple(range(-len(module.normalized_shape), 0))
            return _soft_layer_norm(x, plain, dims, module.weight, module.bias, module.eps)

    return forward


def _detached_forward(plain: Callable[..., Any]) -> Callable[..., Any]:
    # Applied to an attention module's attn_drop: the softmax weights enter `attn @ v` as constants.
    def forward(attn: torch.Tensor) -> torch.Tensor:
        return plain(attn).detach()

    return forward


# ----------------------------------------------------------------------------------------------------------------
# Functional patches (torch.nn.functional / torch attributes), soft only in threads with an open context
# ----------------------------------------------------------------------------------------------------------------

_PATCH_LOCK = threading.Lock()
_PATCH_USERS = 0
_ORIGINALS: dict[tuple[Any, str], Callable[..., Any]] = {}
_FUNCTIONAL_TARGETS: tuple[tuple[Any, str], ...] = (
    (F, "relu"),
    (torch, "relu"),
    (F, "relu6"),
    (F, "gelu"),
    (F, "silu"),
    (F, "max_pool2d"),
    (F, "scaled_dot_product_attention"),
    (F, "softmax"),
    (torch, "softmax"),
)


def _original(owner: Any, name: str) -> Callable[..., Any]:
    return _ORIGINALS.get((owner, name)) or getattr(owner, name)


def _soft_relu_fn(input: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    ctx = _active()
    if ctx is None or not _needs_grad(input):
        return _original(F, "relu")(input, inplace=inplace)
    with _suspended():
        return soft_gate(input, "relu", ctx.relu_tau)


def _soft_torch_relu(input: torch.Tensor) -> torch.Tensor:
    ctx = _active()
    if ctx is None or not _needs_grad(input):
        return _original(torch, "relu")(input)
    with _suspended():
        return soft_gate(input, "relu", ctx.relu_tau)


def _soft_relu6_fn(input: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    ctx = _active()
    if ctx is None or not _needs_grad(input):
        return _original(F, "relu6")(input, inplace=inplace)
    with _suspended():
        return _soft_relu6(input, ctx.relu_tau)


def _soft_gelu_fn(input: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    ctx = _active()
    if ctx is None or not _needs_grad(input):
        return _original(F, "gelu")(input, approximate=approximate)
    with _suspended():
        return soft_gate(input, "gelu_tanh" if approximate == "tanh" else "gelu", ctx.gelu_tau)


def _soft_silu_fn(input: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    ctx = _active()
    if ctx is None or not _needs_grad(input):
        return _original(F, "silu")(input, inplace=inplace)
    with _suspended():
        return soft_gate(input, "silu", ctx.silu_tau)


def _soft_max_pool2d_fn(
    input: torch.Tensor,
    kernel_size: Any,
    stride: Any = None,
    padding: Any = 0,
    dilation: Any = 1,
    ceil_mode: bool = False,
    return_indices: bool = False,
) -> Any:
    ctx = _active()
    if ctx is None or return_indices or input.ndim != 4 or not _needs_grad(input):
        return _original(F, "max_pool2d")(input, kernel_size, stride, padding, dilation, ceil_mode, return_indices)
    if stride is not None and not isinstance(stride, int) and len(stride) == 0:
        stride = None  # torch reads an empty stride as "same as the kernel"
    with _suspended():
        return soft_maxpool2d(input, kernel_size, stride, padding, ctx.maxpool_tau, dilation, ceil_mode)


def _soft_sdpa_fn(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    ctx = _active()
    if ctx is None or not ctx.attention or not _needs_grad(query, key, value):
        return _original(F, "scaled_dot_product_attention")(query, key, value, *args, **kwargs)
    # softmax(q k^T + mask) enters as a constant: detach everything that feeds it. The kernel, its inputs' values
    # and "does any input need grad" (which steers the backend choice) are unchanged, so the output is bit-identical.
    if args and isinstance(args[0], torch.Tensor):
        args = (args[0].detach(), *args[1:])
    if isinstance(kwargs.get("attn_mask"), torch.Tensor):
        kwargs["attn_mask"] = kwargs["attn_mask"].detach()
    with _suspended():
        return _original(F, "scaled_dot_product_attention")(query.detach(), key.detach(), value, *args, **kwargs)


def _held(input: torch.Tensor) -> bool:
    """Whether a softmax of ``input`` is held constant: inside an attention module's soft forward (this thread)."""
    return bool(getattr(_THREAD, "held", 0)) and _active() is not None and _needs_grad(input)


def _soft_softmax_fn(input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    out = _original(F, "softmax")(input, *args, **kwargs)
    return out.detach() if _held(input) else out


def _soft_torch_softmax(input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    out = _original(torch, "softmax")(input, *args, **kwargs)
    return out.detach() if _held(input) else out


_SOFT_FUNCTIONS: dict[tuple[Any, str], Callable[..., Any]] = {
    (F, "relu"): _soft_relu_fn,
    (torch, "relu"): _soft_torch_relu,
    (F, "relu6"): _soft_relu6_fn,
    (F, "gelu"): _soft_gelu_fn,
    (F, "silu"): _soft_silu_fn,
    (F, "max_pool2d"): _soft_max_pool2d_fn,
    (F, "scaled_dot_product_attention"): _soft_sdpa_fn,
    (F, "softmax"): _soft_softmax_fn,
    (torch, "softmax"): _soft_torch_softmax,
}


def _install_functional_patches() -> None:
    global _PATCH_USERS
    with _PATCH_LOCK:
        if _PATCH_USERS == 0:
            for owner, name in _FUNCTIONAL_TARGETS:
                _ORIGINALS[(owner, name)] = getattr(owner, name)
                setattr(owner, name, _SOFT_FUNCTIONS[(owner, name)])
        _PATCH_USERS += 1


def _remove_functional_patches() -> None:
    global _PATCH_USERS
    with _PATCH_LOCK:
        _PATCH_USERS -= 1
        if _PATCH_USERS == 0:
            for (owner, name), fn in _ORIGINALS.items():
                setattr(owner, name, fn)
            _ORIGINALS.clear()


# ----------------------------------------------------------------------------------------------------------------
# The context manager
# ----------------------------------------------------------------------------------------------------------------


class _Installed:
    """One module's dispatcher: installed by the first context covering the module, removed by the last."""

    __slots__ = ("had_own", "module", "own", "plain", "users")

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.had_own = "forward" in module.__dict__
        self.own = module.__dict__.get("forward")
        self.plain: Callable[..., Any] = module.forward  # the module's own forward, before any dispatcher
        self.users = 0


# id(module) -> its dispatcher record. The record holds the module, so the id cannot be reused while it is here.
_INSTALLED: dict[int, _Installed] = {}
_INSTALL_LOCK = threading.Lock()


def _dispatcher(key: int, plain: Callable[..., Any]) -> Callable[..., Any]:
    """The instance forward of a covered module: soft for the innermost open context of *this* thread covering it."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not getattr(_THREAD, "suspended", 0):
            for ctx in reversed(_stack()):
                if key in ctx._forwards:
                    soft = ctx._forwards[key]
                    return plain(*args, **kwargs) if soft is None else soft(*args, **kwargs)
        return plain(*args, **kwargs)

    return forward


def _plain_forward(module: nn.Module) -> Callable[..., Any]:
    """The module's own forward, even while a dispatcher of another context is installed on it."""
    with _INSTALL_LOCK:
        record = _INSTALLED.get(id(module))
        return record.plain if record is not None else module.forward


def _acquire(module: nn.Module) -> None:
    with _INSTALL_LOCK:
        key = id(module)
        record = _INSTALLED.get(key)
        if record is None:
            record = _INSTALLED[key] = _Installed(module)
            # Written into __dict__ directly: an instance attribute shadows the class forward for __call__, and
            # nn.Module.__setattr__ bookkeeping (parameters, buffers, submodules) is not involved.
            module.__dict__["forward"] = _dispatcher(key, record.plain)
        record.users += 1


def _release(module: nn.Module) -> None:
    with _INSTALL_LOCK:
        key = id(module)
        record = _INSTALLED.get(key)
        if record is None:
            return
        record.users -= 1
        if record.users > 0:
            return
        del _INSTALLED[key]
        if record.had_own:
            module.__dict__["forward"] = record.own
        else:
            module.__dict__.pop("forward", None)


class SoftAdjoint:
    """Context manager (also called as :func:`soft_adjoint`): ``model``'s forward unchanged, its backward the
    Semantic Pullback soft adjoint.

    Inside ``with soft_adjoint(model):`` the logits are bit-identical to the plain model's and
    ``torch.autograd.grad(logit, x)`` is the soft pullback ``W(x)^T u`` (see the module docstring for the layer
    table). On exit, normal or by exception, the model is exactly as before: same module objects, flags, state
    dict and hooks, and the functional patches are undone once the last open context closes.

    After ``__enter__``: ``softened`` lists ``(name, kind)`` of the modules given a soft forward, ``unknown`` lists
    ``(name, reason)`` of the modules reported as possibly gated but left plain. Single use, not re-entrant; any
    number of contexts (on the same model or not, in one thread or several) may be open at once and exited in any
    order.

    Args:
        model: any ``nn.Module`` (a :class:`~attr_engine.classifier.Classifier` or the network inside it).
        relu_tau: temperature of the ReLU (and ReLU6) gate ``Phi(z / tau)``; paper default 0.6.
        gelu_tau: temperature of the GELU gate ``Phi(z / tau)`` (erf and tanh GELU); paper default 1.0.
        silu_tau: temperature of the SiLU gate ``sigmoid(z / tau)``; paper default 1.6.
        maxpool_tau: temperature of the max-pool window softmax; paper default 0.3.
        layernorm: hold LayerNorm statistics constant in the backward (False: plain LayerNorm gradient).
        attention: hold softmax attention weights constant in the backward (False: plain attention gradient).
        warn_unknown: warn, listing them, about modules that may carry gates but are not handled.

    Example:
        >>> with soft_adjoint(classifier):  # doctest: +SKIP
        ...     logits = classifier(x.requires_grad_())
        ...     (pullback,) = torch.autograd.grad(logits[:, k].sum(), x)
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        relu_tau: float = RELU_TAU,
        gelu_tau: float = GELU_TAU,
        silu_tau: float = SILU_TAU,
        maxpool_tau: float = MAXPOOL_TAU,
        layernorm: bool = True,
        attention: bool = True,
        warn_unknown: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        for name, flag in (("layernorm", layernorm), ("attention", attention), ("warn_unknown", warn_unknown)):
            check_bool(flag, name)
        self.model = model
        self.relu_tau = check_positive(relu_tau, "relu_tau")
        self.gelu_tau = check_positive(gelu_tau, "gelu_tau")
        self.silu_tau = check_positive(silu_tau, "silu_tau")
        self.maxpool_tau = check_positive(maxpool_tau, "maxpool_tau")
        self.layernorm = layernorm
        self.attention = attention
        self.warn_unknown = warn_unknown
        self.softened: list[tuple[str, str]] = []
        self.unknown: list[tuple[str, str]] = []
        # id(module) -> this context's soft forward for it (None: this context keeps it plain). Read by the
        # dispatchers of the thread that entered this context; never written after __enter__.
        self._forwards: dict[int, Callable[..., Any] | None] = {}
        self._acquired: list[nn.Module] = []
        self._stack: list[SoftAdjoint] | None = None
        self._state = "new"

    def _soft_forward(self, module: nn.Module, kind: str) -> Callable[..., Any] | None:
        plain = _plain_forward(module)
        gate_taus = {
            "relu": self.relu_tau,
            "relu6": self.relu_tau,
            "gelu": self.gelu_tau,
            "gelu_tanh": self.gelu_tau,
            "silu": self.silu_tau,
        }
        if kind in gate_taus:
            return _gate_forward(module, plain, kind, gate_taus[kind])
        if kind in ("gelu_exact", "silu_exact"):
            return _exact_gate_forward(plain, kind.removesuffix("_exact"), gate_taus[kind.removesuffix("_exact")])
        if kind == "held_softmax":
            return _held_softmax_forward(plain) if self.attention else None
        if kind == "maxpool":
            pool = cast(nn.MaxPool2d, module)  # _module_kind matched its class
            return None if pool.return_indices else _maxpool_forward(pool, plain, self.maxpool_tau)
        if kind in ("layernorm", "layernorm2d"):
            norm = cast(nn.LayerNorm, module)  # _module_kind matched its class (timm's norms subclass LayerNorm)
            return _layer_norm_forward(norm, plain, kind == "layernorm2d") if self.layernorm else None
        drop = getattr(module, "attn_drop", None)
        if kind == "attention" and self.attention and isinstance(drop, nn.Module):
            return _detached_forward(_plain_forward(drop))
        return None

    def _plan(self) -> list[tuple[nn.Module, Callable[..., Any] | None]]:
        plan: list[tuple[nn.Module, Callable[..., Any] | None]] = []
        # named_modules() yields a module used twice (a shared ReLU) once, so it is planned once.
        for name, module in self.model.named_modules():
            kind = _module_kind(module)
            if kind is None:
                reason = _unknown_reason(module)
                if reason is not None:
                    self.unknown.append((name, f"{type(module).__name__}: {reason}"))
                continue
            forward = self._soft_forward(module, kind)
            if kind == "maxpool" and forward is None:
                self.unknown.append((name, "MaxPool2d: return_indices=True keeps the hard max"))
            if kind == "attention" and getattr(module, "gate", None) is not None:
                self.unknown.append((name, f"{type(module).__name__}: sigmoid output gate keeps its plain gradient"))
            target = getattr(module, "attn_drop", None) if kind == "attention" else module
            if not isinstance(target, nn.Module):
                continue
            # A module this context keeps plain is still claimed (None): an outer context covering the same module
            # must not make it soft while this, the innermost, is open.
            plan.append((target, forward))
            if forward is not None:
                self.softened.append((name, kind))
        return plan

    def __enter__(self) -> SoftAdjoint:
        if self._state != "new":
            raise RuntimeError("a soft_adjoint context can be entered once; create a new one with soft_adjoint(model)")
        self._state = "open"
        try:
            for module, forward in self._plan():
                if id(module) in self._forwards:
                    continue
                self._forwards[id(module)] = forward
                _acquire(module)
                self._acquired.append(module)
            _install_functional_patches()
            self._state = "patched"
            self._stack = _stack()
            self._stack.append(self)
        except BaseException:
            self._restore()
            raise
        if self.warn_unknown and self.unknown:
            listed = "; ".join(f"{name or '<root>'} ({reason})" for name, reason in self.unknown)
            warnings.warn(
                f"soft_adjoint: {len(self.unknown)} layer(s) of a kind it does not handle; they may carry gates whose "
                f"backward stays plain, so the pullback is not fully soft: {listed}",
                stacklevel=2,
            )
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore()

    def _restore(self) -> None:
        # The stack of the thread that entered: removing there is right even if another thread exits the context.
        if self._stack is not None and self in self._stack:
            self._stack.remove(self)
        if self._state == "patched":
            _remove_functional_patches()
        while self._acquired:
            _release(self._acquired.pop())
        self._state = "closed"


def _function_of(cls: Callable[_P, SoftAdjoint]) -> Callable[_P, SoftAdjoint]:
    """``cls`` called as a function, with its parameters (declared once, in ``__init__``) and docstring."""

    @functools.wraps(cls)
    def make(*args: _P.args, **kwargs: _P.kwargs) -> SoftAdjoint:
        return cls(*args, **kwargs)

    make.__name__ = make.__qualname__ = "soft_adjoint"
    return make


soft_adjoint = _function_of(SoftAdjoint)
