"""What the subcommands share: user errors, config files, classifier / data / method loading, output checks."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

# attr_engine.guards imports only the standard library: the checks that need no model refuse before torch loads.
from attr_engine.guards import (
    check_checkpoint_file,
    check_img_size,
    check_model_name_path,
    check_num_classes,
    split_source,
)

# torch, timm and the engine are imported inside the functions that need them: building the parser (and so
# `attr-engine --help`) must not pay for them, nor a refusal of a flag that needs no model.
if TYPE_CHECKING:
    import torch

    from attr_engine.classifier import Classifier


__all__ = [
    "EMBEDDED",
    "HELD_OUT_SEED",
    "SMALL_MODELS",
    "UsageError",
    "add_classifier_args",
    "add_cost_arg",
    "add_device_arg",
    "check_classifier_args",
    "check_cost",
    "check_device_runs",
    "check_input_side",
    "check_model_flags",
    "check_writable_dir",
    "classifier_args",
    "config_defaults",
    "load_config_file",
    "machine_summary",
    "parse_key_values",
    "resolve_device",
    "resolve_method",
    "warn_if_untrained",
    "work_started",
]

# Small timm configurations that train on a CPU in minutes (attr_engine.classifier_training.small_model_config).
SMALL_MODELS = {"small-resnet": "resnet", "small-vit": "vit"}
# The embedded dataset by name, and the seed offset of its held-out images (never the training seed's images).
EMBEDDED = "shapes"
HELD_OUT_SEED = 1_000_003


class UsageError(Exception):
    """A mistake the user can fix (bad flag value, missing file, unknown name): reported as one line, no traceback."""


# Whether the command has started its work (see attr_engine.cli): an error the user can fix exits 2 either way, but
# one raised after the work started says that the outputs finished so far are kept. Each command calls
# work_started() once its settings, inputs and outputs are checked; main() resets the flag before every command.
_PHASE = {"working": False}


def work_started() -> None:
    """Mark the end of a command's set-up: from here on outputs may exist that a failure leaves in place."""
    _PHASE["working"] = True


def reset_phase() -> None:
    _PHASE["working"] = False


def is_working() -> bool:
    """Whether the running command has finished its set-up (see :func:`work_started`)."""
    return _PHASE["working"]


# ---------------------------------------------------------------------------------------------------------------
# Config files: YAML / JSON mappings of option names to values, overridden by flags given on the command line.
# ---------------------------------------------------------------------------------------------------------------


def load_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML or JSON config file into a mapping (JSON is valid YAML, so one parser reads both)."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise UsageError(f"config file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise UsageError(f"{p} is not valid YAML/JSON: {' '.join(str(err).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"{p} must hold a mapping of option names to values, got a {type(data).__name__}")
    return data


def config_defaults(
    parser: argparse.ArgumentParser, config: Mapping[str, Any], *, sections: Sequence[str] = ()
) -> dict[str, Any]:
    """Turn a config mapping into parser defaults, so that flags on the command line override the file.

    Keys are option names with ``-`` or ``_`` (``batch-size`` / ``batch_size``); values are checked and converted
    exactly as the flag's own value would be. Keys named in ``sections`` (nested mappings such as ``aha:``) are
    passed through as ``<section>_section``.

    Raises:
        UsageError: an unknown key (with close matches) or a value the option rejects.
    """
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
    defaults: dict[str, Any] = {}
    for raw_key, value in config.items():
        key = str(raw_key).replace("-", "_")
        if key in sections:
            if not isinstance(value, dict):
                raise UsageError(f"config key {raw_key!r} must be a mapping, got {value!r}")
            defaults[f"{key}_section"] = value
            continue
        action = actions.get(key)
        if action is None:
            close = difflib.get_close_matches(key, list(actions) + list(sections), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise UsageError(f"unknown config key {raw_key!r}{hint}")
        defaults[key] = _convert(action, value, raw_key)
    return defaults


def _convert(action: argparse.Action, value: Any, key: str) -> Any:
    def one(v: Any) -> Any:
        if isinstance(v, (dict, list)):
            raise UsageError(f"config key {key!r}: expected a single value, got {v!r}")
        try:
            converted = action.type(str(v)) if callable(action.type) else v
        except (TypeError, ValueError, argparse.ArgumentTypeError) as err:
            raise UsageError(f"config key {key!r}: invalid value {v!r} ({err})") from None
        if action.choices is not None and converted not in action.choices:
            raise UsageError(f"config key {key!r}: {v!r} is not one of {', '.join(map(str, action.choices))}")
        return converted

    if action.nargs == 0:  # store_true / store_false
        if not isinstance(value, bool):
            raise UsageError(f"config key {key!r} is a switch: use true or false, got {value!r}")
        return value
    if action.nargs in ("*", "+") or isinstance(action, argparse._AppendAction):
        values = value if isinstance(value, list) else [value]
        return [one(v) for v in values]
    return one(value)


def parse_key_values(items: Sequence[str] | None, what: str) -> dict[str, Any]:
    """``["n_masks=500", "grid=8"]`` -> ``{"n_masks": 500, "grid": 8}``; values are read as YAML scalars/lists."""
    import yaml

    out: dict[str, Any] = {}
    for item in items or ():
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"{what} must be KEY=VALUE, got {item!r}")
        try:
            out[key.strip().replace("-", "_")] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            raise UsageError(f"{what} {item!r}: cannot read the value {raw!r}") from None
    return out


# ---------------------------------------------------------------------------------------------------------------
# Classifier, device, methods
# ---------------------------------------------------------------------------------------------------------------


def add_device_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        default="auto",
        help="auto (a GPU when there is one, cuda:LOCAL_RANK under torchrun), cpu, cuda or cuda:N",
    )


def resolve_device(name: str) -> torch.device:
    """The device of ``--device``, refused in one line unless this machine can run a model on it."""
    from attr_engine.distributed import local_device

    try:
        device = local_device(name)
    except ValueError as err:
        raise UsageError(str(err)) from None
    check_device_runs(device)
    return device


def check_device_runs(device: torch.device) -> None:
    """Refuse a device torch knows but cannot compute on here: ``meta`` (tensors without values), or a backend
    (``mps``, ``xpu``, ...) this machine does not have."""
    import torch

    if device.type in ("cpu", "cuda"):
        return  # local_device checked that a CUDA device exists
    if device.type == "meta":
        raise UsageError("--device meta cannot run a model: meta tensors hold no values; use auto, cpu or cuda")
    backend = getattr(torch, device.type, None) or getattr(torch.backends, device.type, None)
    available = getattr(backend, "is_available", None)
    if not (callable(available) and available()):
        raise UsageError(f"--device {device}: this machine has no {device.type} backend; use auto, cpu or cuda")


def add_classifier_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("classifier")
    group.add_argument(
        "--classifier",
        metavar="PATH",
        help="classifier checkpoint (.safetensors) written by train-classifier or demo; its architecture is read "
        "from the file",
    )
    group.add_argument(
        "--model",
        metavar="NAME",
        help="model name: timm (e.g. resnet50.a1_in1k), torchvision:<builder> or hf:<repo id or directory>; the "
        "architecture of --classifier, or a fresh model (with --pretrained: its weights, downloaded on first use)",
    )
    group.add_argument("--pretrained", action="store_true", help="load timm's pretrained weights for --model")
    group.add_argument("--num-classes", type=int, help="number of classes of a --model without checkpoint")


def check_classifier_args(args: argparse.Namespace) -> None:
    """The classifier flags (``--classifier`` / ``--model`` / ``--pretrained``) checked before anything is loaded,
    and without torch: a directory or an AHA checkpoint given as ``--classifier``, a checkpoint file given as
    ``--model``, a missing ``hf:`` directory are each refused in one line naming the flag they go to. A hub name is
    then probed once (offline: one line instead of the hub client's retries)."""
    if args.classifier is None and args.model is None:
        raise UsageError("no classifier: pass --classifier PATH (a checkpoint) or --model NAME (a timm model)")
    if args.classifier is not None:
        check_checkpoint_file(args.classifier, cli=True)
        if args.pretrained:
            raise UsageError("--pretrained and --classifier exclude each other (the checkpoint holds the weights)")
    if args.model in SMALL_MODELS:
        raise UsageError(f"{args.model!r} is a train-classifier preset; pass the checkpoint it wrote with --classifier")
    if args.model is not None:
        check_model_name_path(args.model, cli=True)
    check_model_flags(args.num_classes, getattr(args, "img_size", None))
    if args.model is not None and is_hub_name(args.model):
        from attr_engine.model_sources import hub_reachable_or_offline

        hub_reachable_or_offline()  # offline: a cached config loads, a missing one fails at once, not after retries


# ---------------------------------------------------------------------------------------------------------------
# Bounds: what a flag or an option may ask of the machine, checked before any work (issue #34)
# ---------------------------------------------------------------------------------------------------------------

# --num-classes and --img-size are bounded by attr_engine.guards (MAX_NUM_CLASSES, MAX_IMG_SIZE), which the library
# checks too.
# Below this side a model is tried once on a blank image before any work: a kernel or patch larger than the image
# fails there, in one line, instead of at the first map. Above it every model we know of takes the image.
PROBE_BELOW = 64
# The budget per image of --max-cost: classifier passes (a forward, or a forward and a backward) per image. RISE at
# its default 2000 masks and MDA on a 14 x 14 grid fit; Integrated Gradients at n_steps=10**8 does not.
MAX_PASSES_PER_IMAGE = 20_000
# Pixels in one classifier call of a method's internal batch (internal_batch_size=256 at 512 px): more is refused
# with the same budget, as a batch that no machine we run on holds in memory.
MAX_PIXELS_PER_CALL = 256 * 512 * 512


def check_model_flags(num_classes: int | None, img_size: int | None) -> None:
    """``--num-classes`` and ``--img-size`` within their bounds (:mod:`attr_engine.guards`, the bounds a checkpoint's
    sizes have too), before the model is built or an image resized."""
    try:
        if num_classes is not None:
            check_num_classes(num_classes, "--num-classes")
        if img_size is not None:
            check_img_size(img_size, "--img-size")
    except ValueError as err:
        raise UsageError(str(err)) from None


def check_input_side(classifier: Classifier, side: int) -> None:
    """Refuse an input side the model cannot take (a conv kernel or ViT patch larger than the image), tried once on
    a blank (1, 3, side, side) image for small sides (:data:`PROBE_BELOW`)."""
    import torch

    from attr_engine.classifier import eval_mode

    if side >= PROBE_BELOW:
        return
    model = getattr(classifier, "model", classifier)
    patch = getattr(getattr(model, "patch_embed", None), "patch_size", None)
    patch_side = max(patch) if isinstance(patch, tuple | list) else patch
    if isinstance(patch_side, int) and side < patch_side:
        raise UsageError(f"--img-size {side} is smaller than the model's {patch_side} px patches")
    probe = torch.zeros(1, 3, side, side, device=classifier.norm_mean.device)
    try:
        with torch.no_grad(), eval_mode(classifier):
            classifier(probe)
    except (RuntimeError, ValueError, AssertionError) as err:
        reason = " ".join(str(err).split())[:200]
        raise UsageError(f"--img-size {side} is too small for this model ({reason})") from None


def add_cost_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-cost",
        type=float,
        default=MAX_PASSES_PER_IMAGE,
        metavar="PASSES",
        help=f"refuse a method whose options ask more than this many classifier passes per image (n_steps, "
        f"n_samples, n_masks, occlusion windows, MDA's grid; default {MAX_PASSES_PER_IMAGE:,}) or an internal batch "
        f"of more than {MAX_PIXELS_PER_CALL:,} pixels per call; 0 lifts both bounds",
    )


def check_cost(explainer: Any, side: int, max_cost: float, method: str) -> None:
    """Refuse, before any work, a method whose options ask more than ``max_cost`` classifier passes per image or
    an internal batch over :data:`MAX_PIXELS_PER_CALL` pixels (:func:`attr_engine.baselines.cost.method_cost`)."""
    from attr_engine.baselines.cost import method_cost

    if max_cost == 0 or max_cost == float("inf"):
        return
    if not max_cost > 0:
        raise UsageError(f"--max-cost must be > 0 (0: no bound), got {max_cost}")
    cost = method_cost(explainer, side, side)
    if cost.passes > max_cost:
        raise UsageError(
            f"{method}: {cost.passes_from} means about {cost.passes:,} classifier passes per image, over the budget "
            f"of {max_cost:,.0f} (--max-cost); lower it, or pass --max-cost {cost.passes} (0: no bound) to run it"
        )
    pixels = cost.batch * side * side
    if pixels > MAX_PIXELS_PER_CALL:
        fits = max(1, MAX_PIXELS_PER_CALL // (side * side))
        raise UsageError(
            f"{method}: {cost.batch_from} puts {pixels:,} pixels in one classifier call at {side} px, over the "
            f"bound of {MAX_PIXELS_PER_CALL:,}; lower it to {fits} or less, or pass --max-cost 0 to run it"
        )


def classifier_args(args: argparse.Namespace, *, img_size: int | None = None, seed: int = 0) -> dict[str, Any]:
    """:func:`attr_engine.classifier.load_classifier`'s arguments from the classifier flags, seeded with ``seed`` so
    random weights are the same in every process. The command checks the flags first, with the other flags that
    need no model (:func:`check_classifier_args`), before torch is imported."""
    return {
        "name": args.model, "pretrained": args.pretrained, "num_classes": args.num_classes, "img_size": img_size,
        "checkpoint": args.classifier, "seed": seed,
    }  # fmt: skip


def is_hub_name(name: str) -> bool:
    """Whether building ``name`` reads from the Hugging Face hub even without pretrained weights (its config): a
    transformers ``hf:org/repo`` (not a local directory) or timm's ``hf-hub:org/repo``."""
    source, ident = split_source(name)
    if source == "hf":
        return not Path(ident).is_dir()
    return name.startswith("hf-hub:") or name.startswith("hf_hub:")


def warn_if_untrained(args: argparse.Namespace) -> None:
    """Maps of an untrained network explain nothing: say so once (after the model loaded) instead of silently
    using the random weights of ``--model`` alone."""
    import warnings

    if args.classifier is None and not args.pretrained:
        warnings.warn(
            f"--model {args.model} without --pretrained or --classifier uses random weights; its maps explain an "
            "untrained network",
            stacklevel=2,
        )


def resolve_method(name: str) -> str:
    """The canonical registry name of ``--method`` (:func:`attr_engine.explainer.resolve_explainer`), or a
    one-line error with close matches: what every command records, compares and builds."""
    from attr_engine.explainer import UnknownExplainerError, resolve_explainer

    try:
        return resolve_explainer(name)
    except UnknownExplainerError as err:
        hint = f" (did you mean {', '.join(err.close)}?)" if err.close else ""
        from attr_engine.explainer import list_explainers

        raise UsageError(f"unknown method {name!r}{hint}; available: {', '.join(list_explainers())}") from None


# ---------------------------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------------------------


def check_writable_dir(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` if needed and prove it is writable now, before hours of work are spent on its contents."""
    from attr_engine.atomic import atomic_write

    out = Path(path)
    if out.exists() and not out.is_dir():
        raise UsageError(f"output {out} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-probe-{os.getpid()}"
        with atomic_write(probe, "w") as f:
            f.write("ok")
        probe.unlink()
    except OSError as err:
        raise UsageError(f"output directory {out} is not writable: {err.strerror or err}") from None
    return out


def check_ray_pool(engine: str, actors: int | None, gpus_per_actor: float | None, *, flags: tuple[str, str]) -> int:
    """The checks of a Ray actor pool's flags that need no cluster: Ray Data installed (``engine``: the flag and
    value that asked for it), the actors (``flags[0]``, default 1) at least 1 and the GPUs per actor
    (``flags[1]``) not negative. Returns the number of actors."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise UsageError(f"{engine} needs Ray Data: pip install 'attr-engine[ray]' (or 'ray[data]')")
    actors = 1 if actors is None else actors
    if actors < 1:
        raise UsageError(f"{flags[0]} must be >= 1, got {actors}")
    if gpus_per_actor is not None and not gpus_per_actor >= 0:
        raise UsageError(f"{flags[1]} must be >= 0, got {gpus_per_actor}")
    return actors


def ray_actor_gpus(address: str | None, actors: int, gpus_per_actor: float | None, device: str) -> float:
    """The GPUs each actor of a pool reserves on the connected cluster (:func:`attr_engine.ray.plan_actors`): a
    shortfall is refused on a local cluster (``address`` and ``$RAY_ADDRESS`` unset: no node will join) and only
    warned about on a joined one (its autoscaler may add the nodes)."""
    from attr_engine.ray import plan_actors

    local_cluster = not (address or os.environ.get("RAY_ADDRESS"))
    return plan_actors(actors, gpus_per_actor, device, strict=local_cluster)


def cpu_model() -> str:
    """The CPU's model name and the vector instructions torch's kernels use on it, e.g. ``"AMD EPYC (AVX2)"``.

    CPU float results depend on both (the vendor's BLAS path and the vector width reorder sums), so a recorded run
    is reproducible to its last digits only on a CPU with the same model name and capability.
    """
    import torch

    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.partition(":")[2].strip()
                break
    return f"{name} ({torch.backends.cpu.get_cpu_capability()})"


def machine_summary(device: torch.device) -> dict[str, Any]:
    """Where a result was measured: CPU (model and vector capability), cores, torch threads, GPU, versions."""
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info
