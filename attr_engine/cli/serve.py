"""``serve``: attribution maps over HTTP, KServe V1 routes on a Ray Serve deployment (:mod:`attr_engine.serve`).

The classifier and method are named as ``explain`` names them (``--classifier`` / ``--model``, ``--method``,
``--aha``, ``--option``) and are built here once before anything starts, so a bad flag, checkpoint or option ends
with one line and exit status 2; then a Ray cluster is started (or joined with ``--address``), every replica builds
the same classifier and method, and the command prints the model's URL and serves until Ctrl-C (or SIGTERM), when
it removes the application and shuts down the cluster it started. ``--artifact FILE.onnx`` serves an exported AHA
instead (``attr-engine export``): the file is loaded once here in onnxruntime and its metadata checked, and the
replicas run it in onnxruntime with no torch on their request path.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import os
import signal
import socket
import sys
import time
from typing import Any

from attr_engine.cli._common import (
    UsageError,
    add_classifier_args,
    add_device_arg,
    check_classifier_args,
    check_input_side,
    parse_key_values,
    resolve_device,
    resolve_method,
    work_started,
)
from attr_engine.guards import check_aha_dir, check_count, check_crop_pct

# attr_engine.serve's defaults, repeated so the parser can be built without importing Ray or torch.
MAP_DTYPES = ("float32", "float16")
MiB = 1 << 20


def register(subparsers: Any) -> dict[str, argparse.ArgumentParser]:
    p = subparsers.add_parser(
        "serve",
        help="serve predictions and attribution maps over HTTP (KServe V1 :predict / :explain on Ray Serve)",
        description="Serve a classifier and an attribution method over HTTP: POST /v1/models/NAME:explain with "
        '{"instances": [{"image": {"b64": "<PNG/JPEG bytes>"}, "target": null}]} answers each image\'s map (in '
        "the image's own frame, as explain writes it), target and probability; :predict answers the class; GET "
        "/v1/models/NAME (ready) and GET / (live). Concurrent requests are batched on each replica (Ray Serve). "
        "Needs pip install 'attr-engine[serve]'.",
    )
    add_classifier_args(p)
    p.add_argument(
        "--method",
        default=None,
        help="the attribution method: any name 'attr-engine methods' lists; aha needs --aha. Default: aha with "
        "--aha, pullback (Pullback Ascent) without.",
    )
    p.add_argument("--aha", metavar="DIR", help="trained AHA checkpoint directory (train-aha or demo output)")
    p.add_argument(
        "--artifact",
        metavar="FILE",
        help="serve an ONNX file written by attr-engine export in onnxruntime, no PyTorch in the replicas; it holds "
        "the classifier, the method and the input size, so --classifier, --model, --method, --aha, --option, "
        "--refine-steps and --img-size are refused with it",
    )
    p.add_argument("--refine-steps", type=int, default=0, help="AHA test-time refinement steps T (default 0)")
    p.add_argument("--option", action="append", metavar="KEY=VALUE", help="method option, e.g. n_masks=2000 for rise")
    p.add_argument("--img-size", type=int, help="input side (default: the classifier's, else 224)")
    p.add_argument(
        "--crop-pct",
        type=float,
        help="fraction of the resized image the centre crop keeps (default: timm's for --model, 1.0 for a "
        "--classifier checkpoint; with --artifact, the crop the file records, else 1.0)",
    )
    p.add_argument(
        "--model-frame", action="store_true", help="answer maps at the classifier's input size, not the image's frame"
    )
    p.add_argument("--seed", type=int, default=0, help="seeds the replicas' torch RNG and AHA refinement")
    add_device_arg(p)
    _add_server_args(p)
    p.set_defaults(run=run_serve)
    return {"serve": p}


def _add_server_args(p: argparse.ArgumentParser) -> None:
    server = p.add_argument_group("server")
    server.add_argument("--name", default="attr-engine", help="the model's name in the routes (default attr-engine)")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: all)")
    server.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    server.add_argument("--replicas", type=int, default=1, help="replicas, each holding the model (default 1)")
    server.add_argument("--threads-per-replica", type=int, default=1, help="CPUs (torch threads) per replica (1)")
    server.add_argument(
        "--gpus-per-replica", type=float, help="GPUs per replica (default: 1 with --device cuda, else 0)"
    )
    server.add_argument("--max-batch-size", type=int, default=16, help="instances per batch on a replica (16)")
    server.add_argument(
        "--batch-wait-ms",
        type=float,
        default=10,
        help="how long a batch waits for more instances, in milliseconds (default: %(default)s)",
    )
    server.add_argument(
        "--map-dtype",
        choices=MAP_DTYPES,
        default="float32",
        help="dtype of the maps on the wire: float32 (default, exact) or float16 (half the bytes, ~3 digits)",
    )
    server.add_argument(
        "--max-image-bytes",
        type=int,
        default=20 * MiB,
        help="an image payload's limit in bytes, refused before decoding (default %(default)s = 20 MiB)",
    )
    server.add_argument(
        "--max-request-bytes",
        type=int,
        default=64 * MiB,
        help="a request body's limit in bytes (default %(default)s = 64 MiB)",
    )
    server.add_argument("--max-instances", type=int, default=32, help="instances per request (32)")
    server.add_argument(
        "--max-pixels",
        type=int,
        default=25_000_000,
        help="pixels of an image, read from its header (default %(default)s)",
    )
    server.add_argument("--min-side", type=int, default=16, help="an image's shorter side at least (16 px)")
    server.add_argument(
        "--address",
        metavar="ADDR",
        help="the Ray cluster to join (e.g. auto, HOST:6379); default: $RAY_ADDRESS, else a new local cluster",
    )
    server.add_argument("--verbose", action="store_true", help="show Ray's own messages and the access log")


def _check_port(host: str, port: int) -> None:
    if not 1 <= port <= 65535:
        raise UsageError(f"--port must be between 1 and 65535, got {port}")
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.bind((host, port))
    except OSError as err:
        raise UsageError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None


def _settings(args: argparse.Namespace) -> Any:
    """The server's settings from the flags, each bad value one line."""
    from attr_engine.serve import ServeSettings

    gpus = args.gpus_per_replica
    if gpus is None:
        gpus = 1.0 if args.device.startswith("cuda") else 0.0
    try:
        return ServeSettings(
            name=args.name, max_batch_size=args.max_batch_size, batch_wait_s=args.batch_wait_ms / 1000,
            map_dtype=args.map_dtype, max_image_bytes=args.max_image_bytes, max_request_bytes=args.max_request_bytes,
            max_instances=args.max_instances, max_pixels=args.max_pixels, min_side=args.min_side,
            replicas=args.replicas, threads=args.threads_per_replica, gpus=gpus,
        )  # fmt: skip
    except ValueError as err:
        raise UsageError(str(err).replace("_", "-").replace("batch-wait-s", "--batch-wait-ms / 1000")) from None


def _check_args(args: argparse.Namespace) -> None:
    """The flags and paths that need no model, checked before torch or Ray is imported (an ``--artifact`` run's
    flags are checked with its file, in :func:`_artifact`)."""
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("starlette") is None:
        raise UsageError("serve needs Ray Serve: pip install 'attr-engine[serve]' (or 'ray[serve]')")
    if args.crop_pct is not None:
        check_crop_pct(args.crop_pct, "--crop-pct")
    if args.artifact is not None:
        return
    if args.img_size is not None and args.img_size < 1:
        raise UsageError(f"--img-size must be >= 1, got {args.img_size}")
    check_count(args.refine_steps, "refine_steps", flag="--refine-steps")
    if args.aha is not None:
        check_aha_dir(args.aha, cli=True)
    check_classifier_args(args)


def _build(args: argparse.Namespace) -> tuple[Any, Any]:
    """The job (or the exported file) and settings, checked: the classifier and method are built once here, the file
    loaded once, so a mistake is one line."""
    if not (args.address or os.environ.get("RAY_ADDRESS")):
        # A local cluster's HTTP proxy listens here; a joined cluster's runs on its nodes (and may be listening).
        _check_port(args.host, args.port)
    settings = _settings(args)
    if args.artifact is not None:
        return _artifact(args), settings
    from attr_engine import jobs
    from attr_engine.imageops import data_config

    method = resolve_method(args.method or ("aha" if args.aha else "pullback"))
    options = parse_key_values(args.option, "--option")
    job = jobs.AttributionJob(
        method=method, classifier=args.classifier, model=args.model, pretrained=args.pretrained,
        num_classes=args.num_classes, img_size=args.img_size, aha=args.aha, refine_steps=args.refine_steps,
        seed=args.seed, options=options, frame="model" if args.model_frame else "image", device=args.device,
    )  # fmt: skip
    # Built once here on the CPU to check everything before the cluster starts; each replica builds its own.
    classifier = job.load_classifier(resolve_device("cpu"))
    img_size = args.img_size or (classifier.input_size[1] if classifier.input_size else 224)
    check_input_side(classifier, img_size)
    crop_pct = args.crop_pct if args.crop_pct is not None else (1.0 if args.classifier else None)
    try:
        config = data_config(classifier, img_size=img_size, crop_pct=crop_pct)
    except ValueError as err:
        raise UsageError(f"--crop-pct: {err}") from None
    job.get_explainer(classifier)
    from attr_engine.classifier import classifier_fingerprint

    job = dataclasses.replace(job, preprocess=config, fingerprint=classifier_fingerprint(classifier))
    return job, settings


def _artifact(args: argparse.Namespace) -> Any:
    """The exported file of ``--artifact``, loaded once in onnxruntime and its metadata read; a flag that builds a
    model, or a file that is missing, no ONNX or not attr-engine's export, is refused in one line."""
    building = {"--classifier": args.classifier, "--model": args.model, "--method": args.method, "--aha": args.aha,
                "--pretrained": args.pretrained or None, "--num-classes": args.num_classes, "--option": args.option,
                "--refine-steps": args.refine_steps or None, "--img-size": args.img_size}  # fmt: skip
    given = [flag for flag, value in building.items() if value is not None]
    if given:
        raise UsageError(
            f"--artifact serves the exported file as it is (its classifier, method and input size): drop "
            f"{', '.join(given)}"
        )
    if importlib.util.find_spec("onnxruntime") is None:
        raise UsageError("--artifact needs onnxruntime: pip install 'attr-engine[export]'")
    from attr_engine.artifact import read_artifact

    try:
        return read_artifact(args.artifact, crop_pct=args.crop_pct, frame="model" if args.model_frame else "image")
    except ValueError as err:
        raise UsageError(f"--artifact {err}") from None


def _check_cluster(settings: Any, local: bool) -> None:
    """The replicas fit the cluster (Ray would wait for them forever): on a local cluster an error, else a warning."""
    import warnings

    import ray

    total = ray.cluster_resources()
    need_cpu, need_gpu = settings.replicas * settings.threads, settings.replicas * settings.gpus
    if total.get("CPU", 0) >= need_cpu and total.get("GPU", 0) >= need_gpu:
        return
    message = (
        f"{settings.replicas} replica(s) of {settings.threads} CPU and {settings.gpus:g} GPU each do not fit the Ray "
        f"cluster ({total.get('CPU', 0):g} CPUs, {total.get('GPU', 0):g} GPUs): lower --replicas, "
        "--threads-per-replica or --gpus-per-replica"
    )
    if local:
        raise UsageError(message)
    warnings.warn(f"{message}; the server waits until the cluster's autoscaler adds them", stacklevel=2)


def _stop_on_signals() -> None:
    """SIGINT (Ctrl-C) and SIGTERM (a service manager, a container stop) end the server cleanly, whatever handling
    the process inherited: a shell without job control starts a background command (``attr-engine serve ... &`` in
    a script) with SIGINT ignored, and Python then installs no Ctrl-C handler, so the server would never stop."""

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    with contextlib.suppress(ValueError):  # not the main thread: leave the signals alone
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, stop)


def run_serve(args: argparse.Namespace) -> int:
    _check_args(args)
    from attr_engine.artifact import OnnxArtifact
    from attr_engine.ray import ray_session

    job, settings = _build(args)
    local = not (args.address or os.environ.get("RAY_ADDRESS"))
    with ray_session(args.address, verbose=args.verbose):
        from attr_engine.serve import start_server, stop_server

        _check_cluster(settings, local)
        work_started()
        _stop_on_signals()
        try:
            url = start_server(job, settings, host=args.host, port=args.port, verbose=args.verbose)
            source = f" from {job.path} (onnxruntime)" if isinstance(job, OnnxArtifact) else ""
            print(f"serving {job.method} maps as {settings.name!r} at {url}{source} (POST {url}:explain, "
                  f"{url}:predict); Ctrl-C stops", flush=True)  # fmt: skip
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            print(f"stopped serving {settings.name!r}", file=sys.stderr, flush=True)
        finally:
            with contextlib.suppress(Exception):  # the cluster may be gone already (a joined one shut down)
                stop_server()
    return 0
