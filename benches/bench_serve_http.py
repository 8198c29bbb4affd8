"""Requests per second and latency of ``attr-engine serve`` (attr_engine.serve) under 1, 8 and 32 concurrent clients,
and a soak: 32 clients for a minute with no failed request and no replica restart.

    nice -n 10 python -m benches.bench_serve_http                      # resnet18 at 128 px, gradient
    nice -n 10 python -m benches.bench_serve_http --method aha --soak 60

Saves an untrained timm model as a classifier checkpoint (the speed of a map does not depend on the weights; with
``--method aha`` an untrained AHA for it too), starts a local Ray cluster and the server on 127.0.0.1 (a free
port), and sends real HTTP requests (httpx, one connection per client thread) of one random 160 x 120 PNG photo
each to ``:explain`` (the map in the image's frame, float32 on the wire) - or ``:predict`` with ``--verb
predict``. Each level sends at most ``--requests`` requests and stops after ``--seconds``; the first request of a
level is not timed (it warms the connections). Latency is per request, client side (encoding, HTTP, batching
wait, compute, decoding of the answer). Only 127.0.0.1 is ever contacted.

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


def _job(root: Path, args: argparse.Namespace):
    """The job the server runs: an untrained timm model saved as a checkpoint (and an untrained AHA for it)."""
    from attr_engine.classifier import load_classifier, save_classifier
    from attr_engine.jobs import AttributionJob

    torch.manual_seed(0)
    checkpoint = root / "classifier.safetensors"
    classifier = load_classifier(args.model, num_classes=10, img_size=args.img_size)
    save_classifier(classifier, checkpoint)
    aha = None
    if args.method == "aha":
        from attr_engine.aha import AHA

        AHA(classifier).save(root / "aha")
        aha = str(root / "aha")
    return AttributionJob(method=args.method, classifier=str(checkpoint), aha=aha, frame="image")


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


def _row(r: dict) -> str:
    return (f"| {r['clients']} | {r['ok']} | {r['failed']} | {r['rps']:.2f} | {r['p50']:.0f} | {r['p99']:.0f} "
            f"| {r['wall']:.1f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--img-size", type=int, default=128)
    parser.add_argument("--method", default="gradient")
    parser.add_argument("--verb", choices=("explain", "predict"), default="explain")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=64, help="requests per level at most")
    parser.add_argument("--seconds", type=float, default=60.0, help="seconds per level at most")
    parser.add_argument("--soak", type=float, default=0.0, help="then a soak of this many seconds (0: none)")
    parser.add_argument("--soak-clients", type=int, default=32)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--max-batch-size", type=int, default=16)
    args = parser.parse_args()

    import ray
    from ray import serve

    from attr_engine.serve import APP, ServeSettings, start_server

    print(f"load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        job = _job(Path(tmp), args)
        ray.init(num_cpus=max(2, args.replicas), include_dashboard=False, configure_logging=False,
                 log_to_driver=False)  # fmt: skip
        try:
            settings = ServeSettings(name="bench", replicas=args.replicas, max_batch_size=args.max_batch_size)
            url = start_server(job, settings, host="127.0.0.1", port=_free_port()) + f":{args.verb}"
            body = {"instances": [{"image": {"b64": base64.b64encode(_photo()).decode()}, "target": None}]}
            started = _replicas()
            print(f"{args.method} on {args.model} at {args.img_size} px, {args.replicas} replica(s) of 1 CPU, "
                  f"max batch {args.max_batch_size}, :{args.verb} of one 160 x 120 PNG per request\n")  # fmt: skip
            print(
                "| clients | requests | failed | requests/s | p50 ms | p99 ms | wall s |\n|---|---|---|---|---|---|---|"
            )
            for clients in args.clients:
                print(_row(_clients(url, body, clients, args.requests, args.seconds)), flush=True)
            if args.soak:
                soak = _clients(url, body, args.soak_clients, 10**9, args.soak)
                states = serve.status().applications[APP].deployments["ModelServer"].replica_states
                same = _replicas() == started
                print(f"\nsoak: {args.soak_clients} clients for {soak['wall']:.0f} s: {soak['ok']} requests, "
                      f"{soak['failed']} failed, {soak['rps']:.2f} requests/s, p50 {soak['p50']:.0f} ms, p99 "
                      f"{soak['p99']:.0f} ms; replicas {'unchanged' if same else 'RESTARTED'} ({states})")  # fmt: skip
                for why in soak["failures"]:
                    print(f"  failure: {why}")
        finally:
            serve.shutdown()
            ray.shutdown()
    print(f"\nload average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
