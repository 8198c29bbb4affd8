"""Dataset-scale attribution on Ray Data: a pool of actors, each holding the classifier and the method, maps batches.

::

    import ray
    from attr_engine.ray import attribute_dataset

    ds = ray.data.read_images("s3://bucket/val/", include_paths=True, mode="RGB")  # or a local folder
    maps = attribute_dataset(ds, method="aha", classifier="clf.safetensors", aha="runs/aha",
                             batch_size=32, concurrency=8, num_gpus=1, scores=True)
    maps.write_parquet("s3://bucket/maps/")

Ray streams the rows: reading and decoding run ahead of the actors only as far as the object store allows
(backpressure), a lost actor is restarted and its batch retried, and the pool spans every node of the cluster.
Each actor (:class:`BatchAttributor`) loads the classifier and builds the method once, from an
:class:`AttributionJob` of plain values (file paths and names, never a model object): a checkpoint written by
``train-classifier`` / ``demo`` or a timm model, and ``aha`` (a checkpoint directory), ``pullback`` (Pullback
Ascent), ``pullback-soft`` or any registered baseline.

**Input batches**: a column ``image`` (decoded, as :func:`ray.data.read_images` gives them), ``bytes`` (+ ``path``:
encoded files, decoded here as ``attr-engine explain`` decodes a file) or ``path`` alone (files the actor opens);
the first found wins, other columns pass through. Every image is cut as the classifier expects
(:func:`attr_engine.imageops.prepare_input`, as the local engine). **Output columns**: ``map``, ``target``,
``probability``, ``height`` / ``width``, ``error`` and optionally ``deletion`` / ``insertion`` and the images;
their shapes and meanings: docs/ray.md.

Ray is imported only by the functions that run a job: ``import attr_engine`` (and ``attr-engine --help``) never
loads it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.util
import io
import logging
import os
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attr_engine.jobs import AttributionJob, Item, ItemResult
from attr_engine_kernels.validate import check_int_at_least, check_positive

if TYPE_CHECKING:
    import numpy as np
    import ray.data
    import torch


__all__ = [
    "AttributionJob",
    "BatchAttributor",
    "ItemResult",
    "RayEngine",
    "RemoteWorkerError",
    "TeacherPartWorker",
    "attribute_dataset",
    "compute_teacher_maps_ray",
    "explain_items",
    "plan_actors",
    "ray_session",
]

# Input layouts in the order they are looked for.
LAYOUTS = ("image", "bytes", "path")


def _image_from_array(array: np.ndarray) -> Any:
    """A ``read_images`` array as the PIL image :func:`~attr_engine.imageops.decode_image` makes of the file."""
    import numpy as np
    from PIL import Image

    if array.ndim == 3 and array.shape[2] == 1:
        array = array[..., 0]
    if array.dtype == np.uint8 and (array.ndim == 2 or (array.ndim == 3 and array.shape[2] in (3, 4))):
        return Image.fromarray(array).convert("RGB")
    if array.ndim == 2 and array.dtype in (np.uint16, np.int32, np.float32):
        # High bit depth greyscale, in [0, 1] as the folder reader scales it (16-bit by 65535, float as is).
        scale = 1.0 if array.dtype == np.float32 else 65535.0
        return Image.fromarray(np.clip(array.astype(np.float32) / scale, 0.0, 1.0))
    raise ValueError(f"unsupported image array {array.dtype} {array.shape}: read the images with mode='RGB'")


def _decode_row(batch: Mapping[str, Any], layout: str, i: int) -> Any:
    """Row ``i`` of a batch as a PIL image; a ValueError naming the image when it cannot be read."""
    from attr_engine.imageops import decode_image

    path = str(batch["path"][i]) if "path" in batch else f"row {i}"
    if layout == "path":
        return decode_image(Path(path))
    if layout == "image":
        try:
            return _image_from_array(batch["image"][i])
        except ValueError as err:
            raise ValueError(f"cannot read image {path}: {err}") from None
    buffer = io.BytesIO(bytes(batch["bytes"][i]))
    try:
        return decode_image(buffer)
    except ValueError as err:
        # Name the file, as the local engine's message does, instead of the in-memory buffer PIL saw.
        reason = str(err.__cause__ or err).replace(repr(buffer), repr(path))
        raise ValueError(f"cannot read image {path}: {reason}") from None


class BatchAttributor:
    """The callable class for :meth:`ray.data.Dataset.map_batches`: classifier and method built once per actor.

    Args:
        job: what to build and compute (:class:`AttributionJob`).

    Call it on a batch (``{column: array}``, one of the layouts of the module docstring) to get the output
    columns. An unreadable image becomes a row with its ``error``; any other failure (a bad option, a target the
    classifier lacks) raises, so Ray retries and then fails the job loudly.
    """

    def __init__(self, job: AttributionJob) -> None:
        import torch

        from attr_engine.distributed import local_device

        self.job = job
        self.device = local_device(job.device)
        self.classifier = job.load_classifier(self.device)
        self.config = job.data_config(self.classifier)
        self.explainer = job.get_explainer(self.classifier)
        torch.manual_seed(job.seed)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        """``batch``: ``{column: (N, ...) array}``; returns the output columns, N rows, in the same order."""
        import numpy as np
        import torch

        from attr_engine.explainer import NONFINITE_MAP, explain_batch_with_probability, finite_maps
        from attr_engine.imageops import prepare_input, to_image_frame
        from attr_engine.metrics import deletion_insertion

        job = self.job
        layout = next((name for name in LAYOUTS if name in batch), None)
        if layout is None:
            raise ValueError(f"a batch needs an 'image', 'bytes' or 'path' column; got {', '.join(batch) or 'none'}")
        n = len(batch[layout])
        keep_original = job.return_images and job.frame == "image"
        prepared: list[Any] = []
        errors = [""] * n
        for i in range(n):
            try:
                prepared.append(prepare_input(_decode_row(batch, layout, i), self.config, keep_original))
            except ValueError as err:
                prepared.append(None)
                errors[i] = str(err)
        good = [i for i in range(n) if prepared[i] is not None]

        empty = np.zeros((0, 0), np.float32)
        maps: list[np.ndarray] = [empty] * n
        images: list[np.ndarray] = [np.zeros((0, 0, 0), np.uint8 if keep_original else np.float32)] * n
        targets = np.full(n, -1, np.int64)
        probabilities = np.full(n, np.nan, np.float32)
        sizes = np.zeros((n, 2), np.int64)
        deletion, insertion = np.full(n, np.nan, np.float32), np.full(n, np.nan, np.float32)
        if good:
            x = torch.stack([prepared[i][0] for i in good]).to(self.device)
            target = self._targets(batch, good)
            model_maps, target, probability = explain_batch_with_probability(self.classifier, self.explainer, x, target)
            if job.scores:
                di = deletion_insertion(self.classifier, x, model_maps, target)
                deletion[good] = di.deletion.float().cpu().numpy()
                insertion[good] = di.insertion.float().cpu().numpy()
            targets[good] = target.cpu().numpy()
            probabilities[good] = probability.numpy()
            inputs = x.cpu()
            finite = finite_maps(model_maps)
            for k, i in enumerate(good):
                _, size, original = prepared[i]
                sizes[i] = size
                if not finite[k]:
                    errors[i] = NONFINITE_MAP  # the image was read, the method failed on it: no map
                    continue
                amap = model_maps[k] if job.frame == "model" else to_image_frame(model_maps[k], size, self.config)
                maps[i] = amap.contiguous().numpy()
                if job.return_images:
                    images[i] = (original if keep_original else inputs[k]).numpy()

        out: dict[str, Any] = {name: column for name, column in batch.items() if name not in ("image", "bytes")}
        out.update(map=maps, target=targets, probability=probabilities, height=sizes[:, 0], width=sizes[:, 1],
                   error=np.array(errors))  # fmt: skip
        if job.scores:
            out.update(deletion=deletion, insertion=insertion)
        if job.return_images:
            out["original" if keep_original else "input"] = images
        return out

    def _targets(self, batch: Mapping[str, Any], good: list[int]) -> torch.Tensor | None:
        import torch

        target = self.job.target
        if target == "pred":
            return None
        if target == "label":
            if "label" not in batch:
                raise ValueError("target 'label' needs a 'label' column in the dataset")
            labels = torch.as_tensor([int(batch["label"][i]) for i in good])
        else:
            labels = torch.full((len(good),), int(target))
        num_classes = self.classifier.num_classes
        bad = labels[(labels < 0) | (labels >= num_classes)]
        if bad.numel():
            raise ValueError(f"target {int(bad[0])} is not a class of this classifier (0 to {num_classes - 1})")
        return labels


def _map_job(
    ds: ray.data.Dataset,
    job: AttributionJob,
    *,
    batch_size: int,
    concurrency: int | tuple[int, int],
    num_gpus: float,
    num_cpus: float,
) -> ray.data.Dataset:
    import ray.data

    check_int_at_least(batch_size, "batch_size", 1)
    low, high = concurrency if isinstance(concurrency, tuple) else (concurrency, concurrency)
    if not 1 <= low <= high:
        raise ValueError(f"concurrency must be an int >= 1 or a (min, max) pair, got {concurrency!r}")
    if not num_gpus >= 0 or not num_cpus >= 0:
        raise ValueError(f"num_gpus and num_cpus must be >= 0, got {num_gpus!r} and {num_cpus!r}")
    return ds.map_batches(
        BatchAttributor,  # looked up at call time, so a subclass can stand in (tests kill workers with one)
        fn_constructor_args=(job,),
        batch_size=batch_size,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(min_size=low, max_size=high),
        num_gpus=num_gpus,
        num_cpus=num_cpus,
    )


def attribute_dataset(
    ds: ray.data.Dataset,
    method: str = "pullback",
    classifier: str | os.PathLike[str] | None = None,
    *,
    model: str | None = None,
    pretrained: bool = False,
    num_classes: int | None = None,
    img_size: int | None = None,
    crop_pct: float | None = None,
    aha: str | os.PathLike[str] | None = None,
    refine_steps: int = 0,
    seed: int = 0,
    options: Mapping[str, Any] | None = None,
    target: str | int = "pred",
    frame: str = "model",
    scores: bool = False,
    return_images: bool = False,
    device: str = "auto",
    batch_size: int = 16,
    concurrency: int | tuple[int, int] = 1,
    num_gpus: float = 0.0,
    num_cpus: float = 1.0,
) -> ray.data.Dataset:
    """Attribution maps for every image of ``ds``, lazily: a Ray Dataset of the output columns (module docstring).

    Args:
        ds: a dataset in one of the input layouts (``read_images``, ``read_binary_files(include_paths=True)``, or
            a ``path`` column).
        method: the method name (see :class:`AttributionJob`).
        classifier: a classifier checkpoint file (``.safetensors``), or a timm model name (then the same as
            ``model``); ``model`` names the checkpoint's architecture when its file does not record one.
        options: the method's own options; the other keywords before ``batch_size`` are :class:`AttributionJob`'s.
        batch_size: images per actor call (memory: the method's working set for this many images).
        concurrency: actors in the pool, or ``(min, max)`` for a pool Ray grows and shrinks.
        num_gpus: GPUs per actor: 1 for one actor per GPU, 0.5 for two (small models keep a GPU busier so), 0 on
            CPUs. ``num_cpus``: CPU cores per actor (torch in the actor uses that many threads).

    Returns:
        The lazy output dataset: write it (``write_parquet``), or iterate it (``iter_rows``).
    """
    if (
        model is None
        and classifier is not None
        and not (
            isinstance(classifier, os.PathLike)
            or str(classifier).endswith(".safetensors")
            or Path(classifier).is_file()
        )
    ):
        model, classifier = str(classifier), None  # a timm model name
    job = AttributionJob(
        method=method,
        classifier=None if classifier is None else str(classifier),
        model=model,
        pretrained=pretrained,
        num_classes=num_classes,
        img_size=img_size,
        crop_pct=crop_pct,
        aha=None if aha is None else str(aha),
        refine_steps=refine_steps,
        seed=seed,
        options=dict(options or {}),
        target=target,
        frame=frame,
        scores=scores,
        return_images=return_images,
        device=device,
    )
    return _map_job(ds, job, batch_size=batch_size, concurrency=concurrency, num_gpus=num_gpus, num_cpus=num_cpus)


# ---------------------------------------------------------------------------------------------------------------
# `attr-engine explain --engine ray`: the driver's side
# ---------------------------------------------------------------------------------------------------------------


class RemoteWorkerError(ValueError):
    """A Ray actor failed (building the method, a batch): its own error message, one line, without Ray's traceback.

    Attributes:
        remote_type: the name of the exception class the actor raised (``"ValueError"``, ``"OutOfMemoryError"``,
            ...), so a caller judges it as it would the same error raised here.
    """

    def __init__(self, message: str, remote_type: str = "ValueError") -> None:
        super().__init__(message)
        self.remote_type = remote_type


def _probe(address: str, timeout: float = 5.0) -> None:
    """Fail in one line, within ``timeout`` seconds, unless the ``host:port`` of ``address`` accepts a connection
    (``ray.init`` itself retries an unreachable address for about 20 s, then raises from deep inside)."""
    import socket

    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--address must be HOST:PORT, ray://HOST:PORT or auto, got {address!r}")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as err:
        raise ConnectionError(f"cannot reach the Ray cluster at {address}: {err.strerror or err}") from None


@contextlib.contextmanager
def ray_session(address: str | None = None, *, verbose: bool = False) -> Iterator[None]:
    """Ray, connected: the running session if there is one (left running), else ``address`` (``None``: the cluster
    in ``$RAY_ADDRESS``, else a new local one), shut down on exit.

    An address that cannot be reached, or a ``ray://`` address without the Ray client installed, fails at once in
    one line (ConnectionError / ValueError) before anything else happens. Ray's start-up messages are shown only
    with ``verbose``.
    """
    import ray

    if ray.is_initialized():
        yield
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is not None and address not in ("auto", "local"):
        if address.startswith("ray://") and importlib.util.find_spec("grpc") is None:
            raise ValueError("a ray:// address needs the Ray client: pip install 'ray[client]'")
        _probe(address)
    # Ray's own loggers (start-up notes, token-auth notices) are quieted for the session unless verbose.
    ray_logger = logging.getLogger("ray")
    level = ray_logger.level
    if not verbose:
        ray_logger.setLevel(logging.ERROR)
        # Ray's C++ core logs notes at "error" level to stderr; set for the processes this session starts.
        os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "fatal")
    try:
        try:
            with contextlib.nullcontext() if verbose else _native_stderr_hidden():
                ray.init(
                    address=address,
                    include_dashboard=False,
                    configure_logging=False,
                    logging_level=logging.INFO if verbose else logging.ERROR,
                    log_to_driver=verbose,
                )
        except ConnectionError as err:
            # Ray's own message only repeats the address; the reason (a missing authentication token, a node of
            # another Ray version) is in the error it chains.
            text = " ".join(f"{err}: {err.__cause__}".split()) if err.__cause__ else " ".join(str(err).split())
            raise ConnectionError(f"cannot connect to the Ray cluster at {address}: {text}") from None
        try:
            yield
        finally:
            with contextlib.nullcontext() if verbose else _native_stderr_hidden():
                ray.shutdown()
    finally:
        ray_logger.setLevel(level)


@contextlib.contextmanager
def _native_stderr_hidden() -> Iterator[None]:
    """File descriptor 2 sent to /dev/null for the block: Ray's C++ core writes to it directly while it starts and
    stops (``logging.cc ... RAY_BACKEND_LOG_LEVEL``, GCS client notes), where no Python logger reaches. Python's own
    errors are raised, not printed, so nothing the caller reports is lost."""
    import sys

    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a captured or replaced stderr (pytest, notebooks)
        fd = 2
    sys.stderr.flush()
    saved = os.dup(fd)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, fd)
        os.close(saved)
        os.close(devnull)


def plan_actors(actors: int, gpus_per_actor: float | None, device: str, *, strict: bool = True) -> float:
    """Check the connected cluster can host the job's actors and return the GPUs each one reserves.

    Ray waits forever for resources that never come (printing autoscaler errors), and an actor that asks for CUDA
    without a GPU dies with a traceback; both are decided here, on the driver, before any actor starts.

    Args:
        actors: actors in the pool, each with one CPU.
        gpus_per_actor: GPUs each actor reserves; ``None``: 1 when the cluster has GPUs and ``device`` is not
            ``cpu``, else 0.
        device: the actors' device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
        strict: refuse a request the cluster's nodes cannot meet now (a local cluster: no node will join). A
            joined cluster may have an autoscaler that adds the nodes asked for, so there the shortfall is a
            warning.

    Raises:
        ValueError: the device name is unknown or, with ``strict``, CUDA is asked for without GPUs or the actors do
            not fit.
    """
    import math

    import ray
    import torch

    check_int_at_least(actors, "actors", 1)
    if device != "auto":
        try:
            kind = torch.device(device).type
        except (RuntimeError, TypeError):
            raise ValueError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N") from None
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"device {device!r}: the Ray engine's actors run on cpu or cuda")
    nodes = [node.get("Resources", {}) for node in ray.nodes() if node.get("Alive")]
    total_gpus = sum(node.get("GPU", 0.0) for node in nodes)
    gpus = gpus_per_actor
    if gpus is None:
        gpus = 1.0 if device != "cpu" and total_gpus > 0 else 0.0
    if device.startswith("cuda") and gpus <= 0:
        why = "the Ray cluster has no GPUs" if total_gpus == 0 else "--gpus-per-actor is 0"
        raise ValueError(f"--device {device}: the actors would get no GPU ({why})")
    fits = 0
    for node in nodes:
        per_node = math.floor(node.get("CPU", 0.0))
        if gpus > 0:
            per_node = min(per_node, math.floor(node.get("GPU", 0.0) / gpus + 1e-9))
        fits += per_node
    if fits < actors:
        total_cpus = sum(node.get("CPU", 0.0) for node in nodes)
        ask = f"1 CPU and {gpus:g} GPU" if gpus > 0 else "1 CPU"
        message = (
            f"{actors} actor(s) of {ask} each do not fit the Ray cluster ({total_cpus:g} CPUs, {total_gpus:g} "
            f"GPUs on {len(nodes)} node(s)): lower --actors or --gpus-per-actor"
        )
        if strict:
            raise ValueError(message)
        warnings.warn(f"{message}; the job waits until the cluster's autoscaler adds them", stacklevel=2)
    return float(gpus)


# Ray's wrappers of an actor's error: the actor's own exception is the one inside them.
_RAY_WRAPPERS = ("RayError", "RayTaskError", "RayActorError", "UserCodeException", "RayDataUserCodeException",
                 "SystemException", "ActorDiedError")  # fmt: skip


def _is_ray_error(err: BaseException) -> bool:
    """An exception of Ray's own (``ray.exceptions``, ``ray.data.exceptions``, a task error's dynamic class)."""
    return type(err).__module__.split(".")[0] == "ray"


def _one_line(err: BaseException) -> tuple[str, str]:
    """The class name and message of the error an actor raised, out of Ray's wrapping (task, Ray Data user-code and
    system errors, actor deaths): the actor's exception object where Ray kept it, else the last line of Ray's text
    that names an exception other than Ray's own."""
    import re

    chain = [err]
    while _is_ray_error(chain[-1]) and len(chain) < 8:
        inner = getattr(chain[-1], "cause", None) or chain[-1].__cause__ or chain[-1].__context__
        if not isinstance(inner, BaseException):
            break
        chain.append(inner)
    if not _is_ray_error(chain[-1]):
        inner = chain[-1]
        return type(inner).__name__, " ".join(str(inner).split()) or type(inner).__name__
    text = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(str(e) for e in chain))  # Ray colours the actor's name
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        match = re.match(r"^(?:[A-Za-z_][\w.]*\.)?([A-Za-z_]\w*(?:Error|Exception))(?:\(\w+\))?: (.+)$", line)
        if match and match.group(1) not in _RAY_WRAPPERS:
            return match.group(1), match.group(2)
    return type(err).__name__, lines[-1] if lines else type(err).__name__


def _remote_failure(err: BaseException, prefix: str = "") -> RemoteWorkerError:
    """The one-line error for a Ray error ``err`` (:func:`_one_line`), to be raised *outside* the ``except`` block
    that caught it, once the failed dataset's local names are deleted and garbage collected.

    Ray Data releases a failed pool's actors by dropping their handles, not by killing them, and the handles sit in
    reference cycles (the executor's, the traceback's frames): the actors keep their CPUs until a garbage
    collection, and for as long as the error is kept if it chains Ray's (an error raised inside ``except``
    references it as ``__context__``). A rerun on the same cluster (resuming after the error) then waits for CPUs
    that never come back. So the caller deletes its names for the dataset, collects garbage once (the actors go
    now) and raises the result outside the ``except`` block, where nothing chains Ray's error.
    """
    kind, message = _one_line(err)
    return RemoteWorkerError(prefix + message, kind)


def explain_items(
    job: AttributionJob,
    items: list[Item],
    *,
    actors: int,
    num_gpus: float,
    address: str | None = None,
    verbose: bool = False,
) -> Iterator[ItemResult]:
    """Run ``job`` for ``items`` on Ray; yields each input's :class:`~attr_engine.jobs.ItemResult` once, in the
    order they finish: the results :func:`attr_engine.jobs.run` yields for the same job, maps bit for bit.

    The dataset is built of blocks of exactly ``job.batch_size`` inputs, in order: the batches the local engine
    forms, so a deterministic method gives the same maps (a batch's composition changes the floating-point
    rounding of a convolution's gradient).

    Args:
        actors: actors in the pool; ``num_gpus``: GPUs per actor, as :func:`plan_actors` decided them.
        address: the cluster (see :func:`ray_session`; a running session is used as it is).
        verbose: Ray's own messages.
    """
    import pandas as pd
    import ray
    import ray.data

    size = job.batch_size
    blocks = [
        pd.DataFrame(
            {
                # Absolute: an actor's working directory is not the driver's.
                "path": [str(item.path.resolve()) for item in items[start : start + size]],
                "label": [item.label for item in items[start : start + size]],
                "index": range(start, min(start + size, len(items))),
            }
        )
        for start in range(0, len(items), size)
    ]
    with ray_session(address, verbose=verbose):
        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = False  # explain draws its own bar
        # Ray Data logs an actor's error itself (three lines and a log path): the driver reports it in one line.
        logging.getLogger("ray.data").setLevel(logging.INFO if verbose else logging.CRITICAL)
        ds = _map_job(ray.data.from_pandas(blocks), job, batch_size=size, concurrency=actors, num_gpus=num_gpus,
                      num_cpus=1.0)  # fmt: skip
        yield from _rows(ds, items, job)


def _rows(ds: ray.data.Dataset, items: list[Item], job: AttributionJob) -> Iterator[ItemResult]:
    """The job's output rows as ItemResults, each input once; an actor's failure as one line."""
    import torch

    seen: set[int] = set()
    rows = iter(ds.iter_rows())
    while True:
        failure = None
        try:
            row = next(rows)
        except StopIteration:
            return
        except Exception as err:  # Ray's task, user-code and system errors, actor deaths
            if not _is_ray_error(err):
                raise
            # The actor's own line, as the local engine would print it for the same error.
            failure = _remote_failure(err)
        if failure is not None:
            del ds, rows
            gc.collect()  # the failed pool's actors go now (_remote_failure)
            raise failure
        index = int(row["index"])
        if index in seen:  # a retried batch is emitted once; this only guards the writes if that ever changes
            continue
        seen.add(index)
        item = items[index]
        if row["error"]:
            # An unreadable image has target -1; a failed map keeps its class and probability, as the local
            # engine's result does.
            yield ItemResult(
                item, target=int(row["target"]), error=str(row["error"]), probability=float(row["probability"])
            )
            continue
        shown = None
        if job.return_images:
            picture = torch.from_numpy(row["original" if job.frame == "image" else "input"].copy())
            shown = picture.float().div_(255) if picture.dtype == torch.uint8 else picture
        # float32 in the column, as in the local engine's tensor: the same double, the same caption.
        probability = float(row["probability"])
        yield ItemResult(item, torch.from_numpy(row["map"].copy()), shown, int(row["target"]), probability=probability)


@dataclasses.dataclass(frozen=True)
class RayEngine:
    """The Ray engine for :func:`attr_engine.jobs.explain`: the job's maps from an actor pool
    (:func:`explain_items`), written by the caller as the local engine's are.

    Args:
        actors: actors in the pool; ``num_gpus``: GPUs per actor (:func:`plan_actors`).
        address: the cluster (:func:`ray_session`); ``verbose``: Ray's own messages.
    """

    actors: int = 1
    num_gpus: float = 0.0
    address: str | None = None
    verbose: bool = False

    def __call__(
        self, job: AttributionJob, items: list[Item], *, classifier: Any, explainer: Any, config: Any, limit: int
    ) -> Iterator[ItemResult]:
        """``classifier``, ``explainer``, ``config``: the driver's, unused (every actor builds its own from the job);
        ``limit``: the caller stops reading once it has written that many maps."""
        return explain_items(
            job, items, actors=self.actors, num_gpus=self.num_gpus, address=self.address, verbose=self.verbose
        )


# ---------------------------------------------------------------------------------------------------------------
# AHA's teacher maps on an actor pool
# ---------------------------------------------------------------------------------------------------------------


class TeacherPartWorker:
    """The callable class for :meth:`ray.data.Dataset.map_batches` of :func:`compute_teacher_maps_ray`: the
    explainer placed on this actor's device once, then each row's chunk of the teacher maps computed and stored
    (:func:`attr_engine.aha.teacher.compute_teacher_part`: a part already written with these settings is kept).

    Args:
        aha: the explainer whose per-image optimum is the teacher (an :class:`attr_engine.aha.AHA` on the CPU, as
            Ray ships it); ``data``: the map-style dataset; ``out``: the parts' folder, the same path on every node.
        settings: ``steps``, ``lr``, ``chunk`` (compute_teacher_part's keywords) and ``device`` (``auto``, ``cpu``,
            ``cuda``).
    """

    def __init__(self, aha: Any, data: Any, out: str, settings: Mapping[str, Any]) -> None:
        from attr_engine.distributed import local_device

        self.settings = dict(settings)
        self.aha = aha.to(local_device(self.settings.pop("device")))
        self.data, self.out = data, out

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        """``batch``: ``{"id": (N,) chunk indices}``; returns ``chunk``, ``part`` (file name) and ``computed``
        (False where an earlier run had written the part), N rows."""
        import numpy as np

        from attr_engine.aha.teacher import compute_teacher_part

        done = [compute_teacher_part(self.aha, self.data, self.out, int(k), **self.settings) for k in batch["id"]]
        return {"chunk": np.asarray(batch["id"], np.int64), "part": np.array([path.name for path, _ in done]),
                "computed": np.array([computed for _, computed in done])}  # fmt: skip


def compute_teacher_maps_ray(
    aha: Any,
    data: Any,
    out: str | os.PathLike[str],
    *,
    steps: int = 30,
    lr: float = 0.05,
    chunk: int = 16,
    actors: int = 1,
    num_gpus: float = 0.0,
    device: str = "auto",
) -> list[tuple[Path, bool]]:
    """AHA's teacher maps of ``data`` (:func:`attr_engine.aha.teacher.compute_teacher_maps`'s parts: the same
    tensors and settings) computed by a Ray Data pool of ``actors`` actors, one chunk of ``chunk`` items per task,
    on the connected Ray cluster (:func:`ray_session`; ``ray.init`` is called by Ray itself when none is).

    The parts' folder ``out`` must be one every node writes to (a shared filesystem). Each part is written
    atomically and skipped when already there, so a lost actor's chunk is redone by Ray's retry or by running this
    again, never any finished one (when an actor fails, a chunk another actor has in flight may still be written,
    whole, after the error is raised). The explainer and the dataset travel to the actors by Ray's own serialisation
    (the dataset holds its file paths, not images: the images are read by the actors).

    Args:
        aha: the explainer (moved to a copy on the CPU for shipping; the caller's is not changed).
        actors: actors in the pool, each with one CPU; ``num_gpus``: GPUs per actor (:func:`plan_actors`).
        device: the actors' device (``auto``: their GPU where they have one).

    Returns:
        Every part's path and whether this call computed it, in index order. Load them with
        :meth:`attr_engine.aha.teacher.TeacherMaps.load`.
    """
    import copy

    import ray.data

    from attr_engine.aha.teacher import teacher_chunks

    check_int_at_least(steps, "steps", 1)
    check_positive(lr, "lr")
    check_int_at_least(actors, "actors", 1)
    chunks = teacher_chunks(data, chunk)
    folder = Path(out).resolve()  # absolute: an actor's working directory is not the driver's
    folder.mkdir(parents=True, exist_ok=True)
    shipped = aha if aha.device.type == "cpu" else copy.deepcopy(aha).cpu()
    settings = {"steps": steps, "lr": lr, "chunk": chunk, "device": device}
    # The chunk indices as in-memory blocks (ray.data.range would need read tasks, and CPUs for them beside the
    # actors: a pool that takes every CPU of the cluster would wait for them forever).
    ds = ray.data.from_items([{"id": k} for k in range(chunks)]).map_batches(
        TeacherPartWorker,
        fn_constructor_args=(shipped, data, str(folder), settings),
        batch_size=1,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=actors),
        num_gpus=num_gpus,
        num_cpus=1.0,
    )
    failure = None
    try:
        rows = sorted(ds.take_all(), key=lambda row: int(row["chunk"]))
    except Exception as err:
        if not _is_ray_error(err):
            raise
        failure = _remote_failure(err, "teacher maps on Ray: ")
    if failure is not None:
        del ds
        gc.collect()  # the failed pool's actors go now (_remote_failure)
        raise failure
    return [(folder / str(row["part"]), bool(row["computed"])) for row in rows]
