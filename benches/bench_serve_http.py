"""Requests per second and latency of ``attr-engine serve`` (attr_engine.serve) under 1, 8 and 32 concurrent clients,
and a soak: 32 clients for a minute with no failed request and no replica restart.

    nice -n 10 python -m benches.bench_serve_http                      # resnet18 at 128 px, gradient
    nice -n 10 python -m benches.bench_serve_http --method aha --soak 60   # AHA: PyTorch and ONNX replicas
    python -m benches.bench_serve_http --method aha --decoder-stride 8    # the decoder at 1/8 of the side

Saves an untrained timm model as a classifier checkpoint (the speed of a map does not depend on the weights; with
``--method aha`` an untrained AHA for it too), starts a local Ray cluster and the server on 127.0.0.1 (a free
port), and sends real HTTP requests (httpx, one connection per client thread) of one random 160 x 120 PNG photo
each to ``:explain`` (the map in the image's frame, float32 on the wire) - or ``:predict`` with ``--verb
predict``. Each level sends at most ``--requests`` requests and stops after ``--seconds``; the first request of a
level is not timed (it warms the connections). Latency is per request, client side (encoding, HTTP, batching
wait, compute, decoding of the answer). Only 127.0.0.1 is ever contacted.

``--kinds``: which replicas to measure, one after the other on the same cluster and port: ``eager`` (the job in
PyTorch) and ``onnx`` (``serve --artifact``: the AHA exported to ONNX with the eager replica's crop, run in
onnxruntime). With ``--method aha`` both by default, then a line per client count comparing them; ``onnx`` needs
``--method aha`` (the only method that exports).

The soak (``--soak S``) runs ``--soak-clients`` clients for S seconds, then checks that every request answered
200 and that the replicas are the ones that started (their Ray actor names, and Serve's replica states). The
load average is printed before and after: on a shared machine the numbers move with it.
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import socket
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image


def _photo(size: tuple[int, int] = (160, 120)) -> bytes:
    rng = np.random.default_rng(0)
    buffer = io.BytesIO()
    Image.fromarray((rng.random((size[1], size[0], 3)) * 255).astype(np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sources(root: Path, args: argparse.Namespace) -> dict:
    """What each kind of replica serves: the job (an untrained timm model saved as a checkpoint, and an untrained AHA
    for it) and, for ``onnx``, that AHA exported with the crop the job's replica cuts with."""
    from attr_engine.classifier import load_classifier, save_classifier
    from attr_engine.jobs import AttributionJob

    torch.manual_seed(0)
    checkpoint = root / "classifier.safetensors"
    classifier = load_classifier(args.model, num_classes=10, img_size=args.img_size)
    save_classifier(classifier, checkpoint)
    aha = None
    sources: dict = {}
    if args.method == "aha":
        from attr_engine.aha import AHA, AHAConfig

        explainer = AHA(classifier, AHAConfig(decoder_stride=args.decoder_stride))
        explainer.save(root / "aha")
        aha = str(root / "aha")
        if "onnx" in args.kinds:
            from attr_engine.artifact import read_artifact
            from attr_engine.imageops import data_config

            # A checkpoint's replica cuts with crop_pct 1.0 (as explain does): the file records the same crop.
            config = data_config(classifier, img_size=args.img_size, crop_pct=1.0)
            sources["onnx"] = read_artifact(explainer.export(root / "aha.onnx", preprocess=config))
    job = AttributionJob(method=args.method, classifier=str(checkpoint), aha=aha, frame="image")
    return {kind: sources.get(kind, job) for kind in args.kinds}


def _clients(url: str, body: dict, clients: int, requests: int, seconds: float) -> dict:
    """``clients`` threads sending ``body`` until ``requests`` are done or ``seconds`` have passed."""
    import httpx

    latencies: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()
    left = [requests]
    deadline = time.perf_counter() + seconds

    def client() -> None:
        with httpx.Client(timeout=120) as http:
            http.post(url, json=body)  # warm-up: the connection, not timed
            while time.perf_counter() < deadline:
                with lock:
                    if left[0] <= 0:
                        return
                    left[0] -= 1
                start = time.perf_counter()
                try:
                    answer = http.post(url, json=body)
                    ok = answer.status_code == 200 and not any(
                        e.get("error") for e in next(iter(answer.json().values()))
                    )
                    why = "" if ok else f"{answer.status_code} {answer.text[:200]}"
                except httpx.HTTPError as err:
                    why = f"{type(err).__name__}: {err}"
                with lock:
                    (failures.append(why) if why else latencies.append(time.perf_counter() - start))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ms = np.array(latencies) * 1000 if latencies else np.array([np.nan])
    return {"clients": clients, "ok": len(latencies), "failed": len(failures), "wall": wall,
            "rps": len(latencies) / wall, "p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99)),
            "failures": failures[:3]}  # fmt: skip


def _replicas() -> list[str]:
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "SERVE_REPLICA" in a["name"])


def _row(kind: str, r: dict) -> str:
    return (f"| {kind} | {r['clients']} | {r['ok']} | {r['failed']} | {r['rps']:.2f} | {r['p50']:.0f} "
            f"| {r['p99']:.0f} | {r['wall']:.1f} |")  # fmt: skip


def _soak(args: argparse.Namespace, kind: str, url: str, body: dict, started: list[str]) -> None:
    """``--soak-clients`` clients for ``--soak`` seconds; every request answered and the replicas unchanged."""
    from ray import serve

    from attr_engine.serve import APP

    soak = _clients(url, body, args.soak_clients, 10**9, args.soak)
    states = serve.status().applications[APP].deployments["ModelServer"].replica_states
    same = _replicas() == started
    print(f"\nsoak ({kind}): {args.soak_clients} clients for {soak['wall']:.0f} s: {soak['ok']} requests, "
          f"{soak['failed']} failed, {soak['rps']:.2f} requests/s, p50 {soak['p50']:.0f} ms, p99 "
          f"{soak['p99']:.0f} ms; replicas {'unchanged' if same else 'RESTARTED'} ({states})")  # fmt: skip
    for why in soak["failures"]:
        print(f"  failure: {why}")


def _compare(results: dict) -> None:
    """ONNX against eager at each client count: requests/s and p50 / p99 as ratios."""
    if not {"eager", "onnx"} <= set(results):
        return
    print("\nonnx / eager:")
    for eager, onnx in zip(results["eager"], results["onnx"], strict=True):
        print(f"  {eager['clients']} clients: requests/s x{onnx['rps'] / eager['rps']:.2f}, p50 "
              f"x{onnx['p50'] / eager['p50']:.2f}, p99 x{onnx['p99'] / eager['p99']:.2f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--img-size", type=int, default=128)
    parser.add_argument("--method", default="gradient")
    parser.add_argument("--kinds", nargs="+", choices=("eager", "onnx"), help="default: both with aha, else eager")
    parser.add_argument("--verb", choices=("explain", "predict"), default="explain")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=64, help="requests per level at most")
    parser.add_argument("--seconds", type=float, default=60.0, help="seconds per level at most")
    parser.add_argument("--soak", type=float, default=0.0, help="then a soak of this many seconds (0: none)")
    parser.add_argument("--soak-clients", type=int, default=32)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--decoder-stride", type=int, default=1, help="with --method aha: AHAConfig.decoder_stride")
    args = parser.parse_args()
    args.kinds = args.kinds or (["eager", "onnx"] if args.method == "aha" else ["eager"])
    if "onnx" in args.kinds and args.method != "aha":
        parser.error("--kinds onnx needs --method aha: only AHA exports to ONNX")

    import ray
    from ray import serve

    from attr_engine.serve import ServeSettings, start_server, stop_server

    print(f"load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        sources = _sources(Path(tmp), args)
        ray.init(num_cpus=max(2, args.replicas), include_dashboard=False, configure_logging=False,
                 log_to_driver=False)  # fmt: skip
        try:
            settings = ServeSettings(name="bench", replicas=args.replicas, max_batch_size=args.max_batch_size)
            port = _free_port()
            body = {"instances": [{"image": {"b64": base64.b64encode(_photo()).decode()}, "target": None}]}
            stride = f" (decoder stride {args.decoder_stride})" if args.method == "aha" else ""
            print(f"{args.method}{stride} on {args.model} at {args.img_size} px, {args.replicas} replica(s) of 1 CPU, "
                  f"max batch {args.max_batch_size}, :{args.verb} of one 160 x 120 PNG per request; replicas: "
                  f"{', '.join(args.kinds)}\n")  # fmt: skip
            print("| replica | clients | requests | failed | requests/s | p50 ms | p99 ms | wall s |\n"
                  "|---|---|---|---|---|---|---|---|")  # fmt: skip
            results: dict = {}
            for kind, source in sources.items():
                url = start_server(source, settings, host="127.0.0.1", port=port) + f":{args.verb}"
                started = _replicas()
                results[kind] = []
                for clients in args.clients:
                    results[kind].append(_clients(url, body, clients, args.requests, args.seconds))
                    print(_row(kind, results[kind][-1]), flush=True)
                if args.soak:
                    _soak(args, kind, url, body, started)
                stop_server()
            _compare(results)
        finally:
            serve.shutdown()
            ray.shutdown()
    print(f"\nload average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
