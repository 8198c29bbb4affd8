"""Attribution maps over HTTP: a Ray Serve deployment that answers KServe V1 ``:predict`` and ``:explain``.

::

    import ray
    from attr_engine.jobs import AttributionJob
    from attr_engine.serve import ServeSettings, start_server
    ray.init()
    job = AttributionJob(method="aha", classifier="clf.safetensors", aha="runs/aha", frame="image")
    start_server(job, ServeSettings(name="shapes"), host="127.0.0.1", port=8000)  # POST .../v1/models/shapes:explain

Each replica (:class:`ModelServer`) is one HTTP front (routes, limits, instance checks, ``@serve.batch``, the
answers' encoding, errors) over a back end built once: from an :class:`~attr_engine.jobs.AttributionJob`, the
classifier and method in PyTorch (:func:`logits_and_maps` per batch); from an exported file
(:func:`~attr_engine.artifact.read_artifact`), an onnxruntime session, numpy and PIL, with no torch imported.

**Routes** (KServe V1, one model per server, ``<name>`` = :attr:`ServeSettings.name`; the README's "Serve over
HTTP" has the shapes): ``POST /v1/models/<name>:explain`` -> ``{"explanations": [{"target", "probability",
"height", "width", "map": {"shape", "dtype", "b64"}, "error"}]}``, the map as little-endian bytes in the image's
frame (NaN where the centre crop cut) or, with ``frame="model"``, the input size; ``POST .../<name>:predict`` ->
``{"predictions": [{"class", "probability", "name", "error"}]}``; ``GET /v1/models/<name>``, ``/v1/models``, ``/``.

**Errors.** A request the server cannot take (not JSON, nested too deeply, no ``instances``, too many, too large,
an unknown route or model) is answered 4xx with ``{"error": "<one line>"}``. A bad instance (a field missing or
unknown, a payload over :attr:`ServeSettings.max_image_bytes`, refused before decoding, no PNG / JPEG / WebP, a
side under :attr:`ServeSettings.min_side` or more than :attr:`ServeSettings.max_pixels` pixels, read from the
header, a target that is no class, a non-finite map) gets its ``error`` and the others still answer; when all
failed, the request is answered with the first one's line: 4xx for a bad instance, 500 for the method's failure.
Ray is imported by this module (``pip install 'attr-engine[serve]'``), torch only by the PyTorch back end.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import io
import json
import logging
import math
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

from ray import serve
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from attr_engine.artifact import OUTPUT_NAMES, OnnxArtifact

if TYPE_CHECKING:
    import numpy as np
    import torch

    from attr_engine.classifier import Classifier
    from attr_engine.jobs import AttributionJob

__all__ = [
    "APP",
    "IMAGE_FORMATS",
    "InstanceError",
    "ModelServer",
    "ServeSettings",
    "build_app",
    "class_names",
    "encode_map",
    "logits_and_maps",
    "read_image",
    "start_server",
    "stop_server",
]

# The Ray Serve application name: one model per server, so a new deployment replaces the running one.
APP = "attr-engine"
# Formats a request may carry (PIL's names). PIL opens many more (EPS runs Ghostscript): those are refused.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")
MAP_DTYPES = ("float32", "float16")
MiB = 1 << 20

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeSettings:
    """How a server answers and what it accepts; the job (or the exported file) says what it computes.

    Attributes:
        name: the model's name in the routes (``/v1/models/<name>:explain``).
        max_batch_size: instances a replica explains in one batch (``@serve.batch``); ``batch_wait_s``: how long
            a batch waits for more instances after its first.
        map_dtype: ``float32`` (the maps exactly) or ``float16`` (half the bytes, about 3 significant digits; a
            map beyond 65504 is that instance's error).
        max_image_bytes: an instance's image payload, decoded from base64, at most this many bytes: a longer
            base64 string is refused before it is decoded.
        max_request_bytes: a request body at most this many bytes (read no further).
        max_instances: instances per request.
        max_pixels: an image at most this many pixels (width x height, from its header, before decompression:
            a decompression bomb is refused unread). ``min_side``: its shorter side at least this many pixels.
        replicas: Ray Serve replicas, each with the model; ``threads``: CPUs (torch or onnxruntime threads) per
            replica; ``gpus``: GPUs per replica.
    """

    name: str = "attr-engine"
    max_batch_size: int = 16
    batch_wait_s: float = 0.01
    map_dtype: str = "float32"
    max_image_bytes: int = 20 * MiB
    max_request_bytes: int = 64 * MiB
    max_instances: int = 32
    max_pixels: int = 25_000_000
    min_side: int = 16
    replicas: int = 1
    threads: int = 1
    gpus: float = 0.0

    def __post_init__(self) -> None:
        from attr_engine_kernels.validate import check_int_at_least

        if not self.name or any(c in self.name for c in "/:?#% ") or not self.name.isprintable():
            raise ValueError(
                f"name must be a non-empty name without '/', ':', '?', '#', '%' or spaces, got {self.name!r}"
            )
        for key in ("max_batch_size", "max_image_bytes", "max_request_bytes", "max_instances", "max_pixels",
                    "min_side", "replicas", "threads"):  # fmt: skip
            check_int_at_least(getattr(self, key), key, 1)
        if not 0.0 <= self.batch_wait_s <= 10.0:
            raise ValueError(f"batch_wait_s must be between 0 and 10 seconds, got {self.batch_wait_s!r}")
        if self.map_dtype not in MAP_DTYPES:
            raise ValueError(f"map_dtype must be one of {', '.join(MAP_DTYPES)}, got {self.map_dtype!r}")
        if not self.gpus >= 0:
            raise ValueError(f"gpus must be >= 0, got {self.gpus!r}")
        if self.min_side**2 > self.max_pixels:
            raise ValueError(f"min_side {self.min_side} leaves no image within max_pixels {self.max_pixels}")

    @property
    def max_b64_chars(self) -> int:
        """The longest base64 string that can decode to at most ``max_image_bytes`` bytes."""
        return 4 * math.ceil(self.max_image_bytes / 3)


class InstanceError(ValueError):
    """Why a request or one instance of it cannot be answered, as one line, with its HTTP status."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(" ".join(message.split()))
        self.status = status


# ---------------------------------------------------------------------------------------------------------------
# Instances: fields, payload, image
# ---------------------------------------------------------------------------------------------------------------


def read_image(data: bytes, settings: ServeSettings) -> Any:
    """The PIL image of an instance's bytes, decoded as ``explain`` decodes a file
    (:func:`~attr_engine.imageops.decode_image`), after its header passed the format and size limits.

    Raises:
        InstanceError: bytes of no allowed format (:data:`IMAGE_FORMATS`), too few or too many pixels (413), or a
            file that fails to decode.
    """
    from PIL import Image

    from attr_engine.pixels import decode_image

    try:
        # Image.open reads the header only: the size is known before a single pixel is decompressed.
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as im:
            width, height = im.size
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        raise InstanceError(f"the image is not a {' / '.join(IMAGE_FORMATS)} file") from None
    if width * height > settings.max_pixels:
        raise InstanceError(
            f"the image has {width} x {height} pixels, more than the server's limit of {settings.max_pixels}", 413
        )
    if min(width, height) < settings.min_side:
        raise InstanceError(f"the image is {width} x {height} pixels; its sides must be at least {settings.min_side}")
    try:
        return decode_image(io.BytesIO(data))
    except ValueError as err:
        raise InstanceError(f"cannot decode the image: {err.__cause__ or err}") from None


def _instance_fields(instance: Any, settings: ServeSettings, num_classes: int) -> tuple[bytes, int | None]:
    """An instance's image bytes and target (None: the predicted class), checked without decoding the image."""
    if not isinstance(instance, dict):
        raise InstanceError(
            f"an instance must be an object {{'image': {{'b64': ...}}, 'target': ...}}, got {instance!r:.60}"
        )
    unknown = sorted(set(instance) - {"image", "target"})
    if unknown:
        raise InstanceError(f"unknown field {unknown[0]!r} in an instance (fields: image, target)")
    image = instance.get("image")
    if not isinstance(image, dict) or not isinstance(image.get("b64"), str):
        raise InstanceError("an instance needs 'image': {'b64': '<base64 of the PNG / JPEG bytes>'}")
    payload = image["b64"]
    if len(payload) > settings.max_b64_chars:
        raise InstanceError(f"the image payload exceeds the server's limit of {settings.max_image_bytes} bytes", 413)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InstanceError("image.b64 is not valid base64") from None
    target = instance.get("target")
    if target is not None:
        if isinstance(target, bool) or not isinstance(target, int):
            raise InstanceError(f"target must be a class index (an integer) or null, got {target!r:.40}")
        if not 0 <= target < num_classes:
            raise InstanceError(f"target {target} is not a class of this classifier (0 to {num_classes - 1})")
    return data, target


def _instances(body: bytes, settings: ServeSettings) -> list[Any]:
    """The ``instances`` list of a request body, or the request's error."""
    try:
        request = json.loads(body)
    except (UnicodeDecodeError, ValueError):
        raise InstanceError("the request body is not JSON") from None
    except RecursionError:
        # json's C parser counts each array or object it enters against the interpreter's recursion limit and
        # stops at the first level past it, the rest of the body unread: refusing costs no more than parsing a body
        # that shallow, where a depth scan of our own would walk every byte of every large body in Python.
        raise InstanceError(
            "the request body is nested deeper than the JSON parser's limit of about "
            f"{sys.getrecursionlimit()} levels of arrays and objects"
        ) from None
    if not isinstance(request, dict) or not isinstance(request.get("instances"), list):
        raise InstanceError("the request needs 'instances': a list of {'image': {'b64': ...}, 'target': ...}")
    instances = request["instances"]
    if not instances:
        raise InstanceError("'instances' is empty")
    if len(instances) > settings.max_instances:
        raise InstanceError(
            f"{len(instances)} instances in one request, more than the server's limit of {settings.max_instances}",
            413,
        )
    return instances


def encode_map(amap: np.ndarray, dtype: str) -> dict[str, Any]:
    """``amap (h, w)`` float32 as the wire's ``{"shape", "dtype", "b64"}``: little-endian bytes in C order.

    Raises:
        InstanceError: with ``dtype`` float16, finite values beyond float16's range (65504).
    """
    import numpy as np

    with np.errstate(over="ignore"):  # an overflow is refused below, with its reason
        stored = amap.astype("<f4" if dtype == "float32" else "<f2")
    if dtype == "float16" and not np.array_equal(np.isfinite(stored), np.isfinite(amap)):
        raise InstanceError("map values exceed float16's range (65504): serve with map_dtype float32", 500)
    return {"shape": list(amap.shape), "dtype": dtype, "b64": base64.b64encode(stored.tobytes()).decode("ascii")}


# ---------------------------------------------------------------------------------------------------------------
# A batch: logits and maps
# ---------------------------------------------------------------------------------------------------------------


def logits_and_maps(
    classifier: Classifier, explainer: Any, x: torch.Tensor, target: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits ``(B, K)`` and the maps ``(B, H, W)`` of ``x (B, 3, H, W)`` for ``target (B,)``, or for the
    predicted classes (the logits' argmax) when ``target`` is None.

    An explainer with a fused ``predict_and_explain`` (AHA) takes both from one backbone pass; any other runs the
    classifier once for the logits and ``attribute`` for the maps.
    """
    import torch

    fused = getattr(explainer, "predict_and_explain", None)
    if fused is not None:
        return fused(x, target=target)
    with torch.no_grad():
        logits = classifier(x)
    return logits, explainer.attribute(x, logits.argmax(1) if target is None else target)


@dataclass
class _Row:
    """One checked instance in a batch: the model's input ``x (3, H, W)`` (a tensor for the PyTorch back end, a
    float32 array for onnxruntime), the image's ``(h, w)``, the target (None: predicted) and whether its map is
    wanted (``:explain``) or its class alone (``:predict``)."""

    x: Any
    size: tuple[int, int]
    target: int | None
    explain: bool


@dataclass
class _Answer:
    target: int | None  # None: the batch failed before any class was known
    probability: float | None
    map: np.ndarray | None = None  # (h, w) float32 in the output frame; None for :predict
    error: str | None = None


class _Backend(Protocol):
    """What a replica computes with, behind the shared HTTP front: the model's class count and names, an image's
    input, and a batch's answers."""

    num_classes: int
    names: dict[int, str]

    def prepare(self, image: Any) -> tuple[Any, tuple[int, int]]:
        """A decoded PIL image as the model's input ``x (3, H, W)``, and the image's ``(h, w)``."""
        ...

    def compute(self, rows: list[_Row]) -> list[_Answer]:
        """One answer per row: its class and probability, and its map in the output frame where it is explained."""
        ...


class ModelServer:
    """The Ray Serve deployment's class: the HTTP front of the module docstring over one compute back end per
    replica. Built by :func:`build_app`.

    Args:
        source: what to compute: an :class:`~attr_engine.jobs.AttributionJob` (the classifier and method in
            PyTorch; ``job.frame``, ``job.preprocess``) or an :class:`~attr_engine.artifact.OnnxArtifact` (the
            exported file in onnxruntime; nothing this replica imports for it loads torch).
        settings: the limits and batching (:class:`ServeSettings`).
    """

    def __init__(self, source: AttributionJob | OnnxArtifact, settings: ServeSettings) -> None:
        self.settings = settings
        self.backend: _Backend
        if isinstance(source, OnnxArtifact):
            self.backend = _OnnxBackend(source, settings)
        else:
            self.backend = _EagerBackend(source, settings)
        self.names = self.backend.names
        # The decorator's sizes are placeholders: these settings are known only now (Ray Serve's documented setters).
        batching = cast(Any, self._batch)
        batching.set_max_batch_size(settings.max_batch_size)
        batching.set_batch_wait_timeout_s(settings.batch_wait_s)

    def loaded_modules(self) -> list[str]:
        """The top-level packages this replica's process has imported; called through a deployment handle (e.g.
        to check that a replica serving an exported file runs without torch)."""
        return sorted({name.partition(".")[0] for name in sys.modules})

    async def __call__(self, request: Request) -> JSONResponse:
        """Route one HTTP request; every failure becomes its response, never the replica's end."""
        path, method, name = request.url.path, request.method, self.settings.name
        base = f"/v1/models/{name}"
        try:
            if path == "/" and method == "GET":
                return JSONResponse({"status": "alive"})
            if path in ("/v1/models", "/v1/models/") and method == "GET":
                return JSONResponse({"models": [name]})
            if path == base and method == "GET":
                return JSONResponse({"name": name, "ready": True})
            for verb in ("explain", "predict"):
                if path == f"{base}:{verb}":
                    if method != "POST":
                        raise InstanceError(f"{path} takes POST, not {method}", 405)
                    return await self._answer(request, verb == "explain")
            if path.startswith("/v1/models/") and path.rpartition("/")[2].split(":")[0] != name:
                raise InstanceError(
                    f"no model {path.rpartition('/')[2].split(':')[0]!r} here; this server serves {name!r}", 404
                )
            raise InstanceError(f"no route {method} {path} (POST {base}:explain, {base}:predict; GET {base}, /)", 404)
        except InstanceError as err:
            return JSONResponse({"error": str(err)}, status_code=err.status)
        except Exception as err:  # a bug or an exhausted resource: this request fails, the replica stays
            logger.exception("request %s %s failed", method, path)
            line = " ".join(f"internal error: {type(err).__name__}: {err}".split())[:300]
            return JSONResponse({"error": line}, status_code=500)

    async def _body(self, request: Request) -> bytes:
        """The request body, read no further than ``max_request_bytes``: a Content-Length over the limit is refused
        (413) before a byte of the body is read, a body without one at the first chunk past the limit.

        The 413 may go out while the client is still sending: the HTTP server (uvicorn, in Ray Serve's proxy) reads
        and drops the rest of that body and keeps the connection open, so a client that sends its whole body before
        it reads the answer (httpx does) gets the 413 rather than a reset connection.
        """
        limit = self.settings.max_request_bytes
        too_large = InstanceError(f"the request body exceeds the server's limit of {limit} bytes", 413)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
        except ClientDisconnect:
            raise InstanceError("the client disconnected before the request body was read") from None
        return b"".join(chunks)

    async def _answer(self, request: Request, explain: bool) -> JSONResponse:
        """``:explain`` or ``:predict``: every instance checked and decoded, then batched; one entry per instance."""
        instances = _instances(await self._body(request), self.settings)
        rows = await asyncio.to_thread(self._rows, instances, explain)
        answers = iter(await asyncio.gather(*(self._batch(r) for r in rows if not isinstance(r, InstanceError))))
        results = [row if isinstance(row, InstanceError) else next(answers) for row in rows]
        failed = [(i, r) for i, r in enumerate(results) if isinstance(r, InstanceError) or r.error is not None]
        if len(failed) == len(results):  # nothing to answer: the request is bad (4xx) or the method failed (500)
            i, first = failed[0]
            status = first.status if isinstance(first, InstanceError) else 500
            reason = first if isinstance(first, InstanceError) else first.error
            more = f" (and {len(failed) - 1} more failed instances)" if len(failed) > 1 else ""
            raise InstanceError(f"instance {i}: {reason}{more}", status)
        entries = [self._entry(result, explain) for result in results]
        return JSONResponse({"explanations" if explain else "predictions": entries})

    def _rows(self, instances: Sequence[Any], explain: bool) -> list[_Row | InstanceError]:
        """Each instance as the classifier's input, or its error (runs in a worker thread: decoding is CPU work)."""
        rows: list[_Row | InstanceError] = []
        for instance in instances:
            try:
                data, target = _instance_fields(instance, self.settings, self.backend.num_classes)
                x, size = self.backend.prepare(read_image(data, self.settings))
                rows.append(_Row(x, size, target, explain))
            except InstanceError as err:
                rows.append(err)
        return rows

    def _entry(self, answer: _Answer | InstanceError, explain: bool) -> dict[str, Any]:
        """One instance's entry of the response."""
        if isinstance(answer, InstanceError) or answer.error is not None:
            error = str(answer) if isinstance(answer, InstanceError) else answer.error
            target = None if isinstance(answer, InstanceError) else answer.target
            probability = None if isinstance(answer, InstanceError) else answer.probability
            if explain:
                return {"target": target, "probability": probability, "height": None, "width": None, "map": None,
                        "error": error}  # fmt: skip
            return {"class": None, "probability": None, "name": None, "error": error}
        if not explain:
            name = self.names.get(answer.target) if answer.target is not None else None
            return {"class": answer.target, "probability": answer.probability, "name": name, "error": None}
        assert answer.map is not None  # an explained row without error has its map
        try:
            encoded = encode_map(answer.map, self.settings.map_dtype)
        except InstanceError as err:
            return self._entry(_Answer(answer.target, answer.probability, error=str(err)), True)
        height, width = answer.map.shape
        return {"target": answer.target, "probability": answer.probability, "height": height, "width": width,
                "map": encoded, "error": None}  # fmt: skip

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.01)
    async def _batch(self, rows: list[_Row]) -> list[_Answer]:
        """The rows of concurrent requests, computed together in a worker thread (the replica's event loop keeps
        taking requests meanwhile, which form the next batch)."""
        try:
            return await asyncio.to_thread(self.backend.compute, rows)
        except Exception as err:  # the whole batch failed (a bug, memory): each of its requests says so
            logger.exception("a batch of %d instances failed", len(rows))
            line = f"internal error: {type(err).__name__}: {' '.join(str(err).split())}"[:300]
            return [_Answer(None, None, error=line) for _ in rows]


# ---------------------------------------------------------------------------------------------------------------
# The back ends: PyTorch (any method) and onnxruntime (an exported AHA)
# ---------------------------------------------------------------------------------------------------------------


class _EagerBackend:
    """The classifier and method of a job in PyTorch, built once per replica as ``explain`` builds them: inputs cut
    by :func:`~attr_engine.imageops.prepare_input`, a batch's logits and maps from :func:`logits_and_maps`, maps
    drawn back by :func:`~attr_engine.imageops.to_image_frame`."""

    def __init__(self, job: AttributionJob, settings: ServeSettings) -> None:
        import torch

        from attr_engine.distributed import local_device
        from attr_engine.imageops import data_config

        torch.set_num_threads(settings.threads)
        self.job = job
        self.device = local_device(job.device)
        self.classifier = job.load_classifier(self.device)
        crop_pct = job.crop_pct if job.crop_pct is not None else (1.0 if job.classifier else None)
        self.config = job.preprocess or data_config(self.classifier, img_size=job.img_size, crop_pct=crop_pct)
        self.explainer = job.get_explainer(self.classifier)
        self.num_classes = self.classifier.num_classes
        self.names = class_names(job, self.classifier)
        torch.manual_seed(job.seed)

    def prepare(self, image: Any) -> tuple[torch.Tensor, tuple[int, int]]:
        """``x (3, H, W)`` as ``explain`` cuts it, and the image's ``(h, w)``."""
        from attr_engine.imageops import prepare_input

        x, size, _ = prepare_input(image, self.config)
        return x, size

    def compute(self, rows: list[_Row]) -> list[_Answer]:
        """Answers for ``rows``: predictions from the classifier alone, maps in groups of predicted and given
        targets (a fused explainer takes ``target=None`` for the predicted class)."""
        import torch

        answers: list[_Answer | None] = [None] * len(rows)
        groups = {
            "predict": [i for i, r in enumerate(rows) if not r.explain],
            "predicted": [i for i, r in enumerate(rows) if r.explain and r.target is None],
            "given": [i for i, r in enumerate(rows) if r.explain and r.target is not None],
        }
        for kind, index in groups.items():
            if not index:
                continue
            x = torch.stack([rows[i].x for i in index]).to(self.device)
            maps = None
            if kind == "predict":
                with torch.no_grad():
                    logits = self.classifier(x)
            else:
                given = torch.tensor([rows[i].target for i in index], device=self.device) if kind == "given" else None
                logits, maps = logits_and_maps(self.classifier, self.explainer, x, given)
            target = logits.argmax(1) if kind != "given" else torch.tensor([rows[i].target for i in index])
            probability = logits.detach().float().softmax(1).cpu().gather(1, target.cpu()[:, None])[:, 0]
            for k, i in enumerate(index):
                answers[i] = self._answer_row(rows[i], int(target[k]), float(probability[k]), maps, k)
        assert all(a is not None for a in answers)
        return answers  # type: ignore[return-value]  # every row belongs to one group

    def _answer_row(self, row: _Row, target: int, probability: float, maps: torch.Tensor | None, k: int) -> _Answer:
        """Row ``k`` of a group's result; its map in the output frame."""
        import torch

        from attr_engine.imageops import to_image_frame
        from attr_engine.pixels import NONFINITE_MAP

        if maps is None:
            return _Answer(target, probability)
        amap = maps[k].detach().float().cpu()
        if not bool(torch.isfinite(amap).all()):
            return _Answer(target, probability, error=NONFINITE_MAP)
        if self.job.frame == "image":
            amap = to_image_frame(amap, row.size, self.config)
        return _Answer(target, probability, amap.contiguous().numpy())


class _OnnxBackend:
    """An exported AHA in onnxruntime, built once per replica: inputs cut by
    :func:`~attr_engine.pixels.preprocess_array`, one run of the file per batch for the ``:explain`` rows' logits
    and maps (target -1: the predicted class), one run of its classifier alone for the ``:predict`` rows
    (:meth:`~attr_engine.artifact.OnnxArtifact.logits_session`: the classifier's cost, not the map's; the whole
    file, with a warning in the log, where the logits cannot be cut out), maps drawn back by
    :func:`~attr_engine.pixels.image_frame_array`. Imports numpy, PIL, onnx and onnxruntime, never torch."""

    def __init__(self, artifact: OnnxArtifact, settings: ServeSettings) -> None:
        self.artifact = artifact
        self.session = artifact.session(settings.threads, gpu=settings.gpus > 0)
        self.logits_session = artifact.logits_session(settings.threads, gpu=settings.gpus > 0)
        if self.logits_session is None:  # a slower :predict is the operator's to know, not to discover
            logger.warning(
                "%s: the logits cannot be cut out of the file without its maps (they read the target), so :predict "
                "runs the whole file, at the price of a map",
                artifact.path,
            )
        self.num_classes = artifact.num_classes
        self.names = dict(enumerate(artifact.names))

    def prepare(self, image: Any) -> tuple[np.ndarray, tuple[int, int]]:
        """``x (3, H, W)`` float32 in [0, 1] at the file's input size, and the image's ``(h, w)``."""
        from attr_engine.pixels import preprocess_array

        return preprocess_array(image, self.artifact.preprocess), (image.height, image.width)

    def compute(self, rows: list[_Row]) -> list[_Answer]:
        """The rows' answers: the class (the logits' argmax, or the given target), its softmax probability, and for
        ``:explain`` the map in the output frame (a non-finite map: the row's error)."""
        import numpy as np

        answers: list[_Answer | None] = [None] * len(rows)
        alone = [not row.explain and self.logits_session is not None for row in rows]  # the classifier alone
        explained = [i for i, cut in enumerate(alone) if not cut]
        predicted = [i for i, cut in enumerate(alone) if cut]
        if explained:
            x = np.stack([rows[i].x for i in explained])
            given = np.array([-1 if rows[i].target is None else rows[i].target for i in explained], dtype=np.int64)
            logits, maps = self.session.run(list(OUTPUT_NAMES), {"images": x, "target": given})
            for k, i in enumerate(explained):
                answers[i] = self._answer(rows[i], logits[k], maps[k] if rows[i].explain else None)
        if predicted:
            (logits,) = self.logits_session.run(["logits"], {"images": np.stack([rows[i].x for i in predicted])})
            for k, i in enumerate(predicted):
                answers[i] = self._answer(rows[i], logits[k], None)
        assert all(a is not None for a in answers)
        return answers  # type: ignore[return-value]  # every row is explained or predicted

    def _answer(self, row: _Row, logits: np.ndarray, amap: np.ndarray | None) -> _Answer:
        """One row's answer from its ``logits (K,)`` and, for an ``:explain`` row, the file's map ``(H, W)`` of it
        (None: a ``:predict`` row)."""
        import numpy as np

        from attr_engine.pixels import NONFINITE_MAP, image_frame_array

        scores = logits.astype(np.float64)
        exp = np.exp(scores - scores.max())
        target = int(scores.argmax()) if row.target is None else row.target
        answer = _Answer(target, float(exp[target] / exp.sum()))
        if amap is None:
            return answer
        if not np.isfinite(amap).all():
            answer.error = NONFINITE_MAP
            return answer
        amap = amap.astype(np.float32)
        if self.artifact.frame == "image":
            amap = image_frame_array(amap, row.size, self.artifact.preprocess)
        answer.map = np.ascontiguousarray(amap)
        return answer


# ---------------------------------------------------------------------------------------------------------------
# Class names, the application, starting and stopping
# ---------------------------------------------------------------------------------------------------------------


def class_names(job: AttributionJob, classifier: Classifier) -> dict[int, str]:
    """``{class id: name}`` where the names are known to be the classifier's classes, else ``{}``.

    A ``train-classifier`` checkpoint has a ``train.json`` beside it listing its classes: used when it names this
    model and as many classes as the classifier has (the rule ``explain --png`` captions follow). A timm model
    with pretrained ImageNet weights: timm's ImageNet class descriptions, when the class count matches.
    """
    if job.classifier:
        from attr_engine.classifier import checkpoint_class_names

        return checkpoint_class_names(job.classifier, classifier)
    if job.pretrained:
        from timm.data import ImageNetInfo, infer_imagenet_subset

        subset = infer_imagenet_subset(getattr(classifier, "model", classifier))
        if subset:
            info = ImageNetInfo(subset)
            if info.num_classes() == classifier.num_classes:
                return {k: info.index_to_description(k) for k in range(info.num_classes())}
    return {}


def build_app(source: AttributionJob | OnnxArtifact, settings: ServeSettings) -> serve.Application:
    """The Ray Serve application of ``source`` (a job, or an exported file) under ``settings``:
    :attr:`ServeSettings.replicas` replicas of :class:`ModelServer`, each with ``threads`` CPUs and ``gpus`` GPUs;
    Ray Serve's own logs at WARNING, no access log."""
    deployment = serve.deployment(
        name="ModelServer",
        num_replicas=settings.replicas,
        ray_actor_options={"num_cpus": settings.threads, "num_gpus": settings.gpus},
        # Room for a batch being computed and the next one forming.
        max_ongoing_requests=2 * settings.max_batch_size,
        logging_config={"log_level": "WARNING", "enable_access_log": False},
        # A replica that cannot build (a checkpoint changed since the command checked it) fails the start soon.
        max_constructor_retry_count=3,
    )(ModelServer)
    return deployment.bind(source, settings)


def start_server(
    source: AttributionJob | OnnxArtifact,
    settings: ServeSettings,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    verbose: bool = False,
    timeout: float = 300.0,
) -> str:
    """Deploy ``source`` (an :class:`~attr_engine.jobs.AttributionJob`, or an exported file:
    :func:`~attr_engine.artifact.read_artifact`) on the connected Ray cluster, listening on ``host:port``; returns
    the model's URL once it answers its readiness route.

    Serve already running on the cluster keeps its own address: the server is then checked to answer at
    ``host:port`` and refused in one line otherwise. A replica that fails to build (a bad checkpoint) fails here
    with its own message.

    Raises:
        ValueError: the application failed to deploy, or does not answer at ``host:port`` within ``timeout``.
    """
    import ray

    if not verbose:
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
    quiet = {"log_level": "INFO" if verbose else "WARNING", "enable_access_log": verbose}
    serve.start(http_options={"host": host, "port": port}, logging_config=quiet)
    try:
        serve.run(build_app(source, settings), name=APP, route_prefix="/", logging_config=quiet)
    except (ray.exceptions.RayError, RuntimeError) as err:
        from attr_engine.ray import RemoteWorkerError

        # serve.run says only that the deployment failed; Serve's status holds the replica's own error.
        with contextlib.suppress(Exception):
            err = RuntimeError(serve.status().applications[APP].deployments["ModelServer"].message or str(err))
        raise RemoteWorkerError(f"the server failed to start: {_last_error_line(err)}") from None
    local = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    url = f"http://{local if ':' not in local else f'[{local}]'}:{port}/v1/models/{settings.name}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                if json.loads(answer.read()).get("name") == settings.name:
                    return url
        except (OSError, ValueError, urllib.error.URLError):
            pass
        if time.monotonic() > deadline:
            raise ValueError(f"the server does not answer at {url} (is Ray Serve already running on this cluster "
                             "with another HTTP address?)")  # fmt: skip
        time.sleep(0.5)


def stop_server() -> None:
    """Remove the application (the Ray cluster and Serve's proxy stay for their owner to shut down)."""
    serve.delete(APP)


def _last_error_line(err: BaseException) -> str:
    """The message a replica's constructor raised, out of Ray Serve's deployment-failure text."""
    import re

    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err))
    for line in reversed([line.strip() for line in text.splitlines() if line.strip()]):
        match = re.match(r"^(?:[A-Za-z_][\w.]*\.)?([A-Za-z_]\w*(?:Error|Exception)): (.+)$", line)
        if match:
            return match.group(2)
    return " ".join(text.split())[:300] or type(err).__name__
