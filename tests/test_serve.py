"""`attr-engine serve` on a real Ray cluster: the command runs as its own process, joins a local two-CPU cluster the
test starts, and answers real HTTP requests on 127.0.0.1 (httpx). Three kinds of server run the same tests: the
PyTorch replicas of a gradient method and of AHA, and `--artifact` replicas of that AHA exported to ONNX
(onnxruntime, no torch in the replica). Their maps equal `explain`'s (the local engine) for the same images and
targets; :predict, the health routes, every kind of bad request (4xx, one line), and the replica is never restarted
by any of them.

The wire dtype is float32 by default, so PyTorch maps are compared at float32 rounding: a replica batches instances
of concurrent requests together, and a convolution's gradient rounds differently in another batch composition (about
1e-7 of the map's scale; a wrong image, target or frame differs by the map's whole scale). The ONNX replica's maps
are onnxruntime's kernels against PyTorch's: within 1e-4 of the standardised maps, as tests/test_export.py compares
them (the AHA replica's maps are within float32 rounding of the same local maps, so the two kinds agree to 1e-4).
"""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

ray = pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")
pytest.importorskip("ray.serve")

from ray import serve  # noqa: E402  (after the skips: without Ray Serve there is nothing to test)

from attr_engine.aha import AHA, AHAConfig  # noqa: E402
from attr_engine.checkpoint import load_safetensors  # noqa: E402
from attr_engine.classifier import load_classifier  # noqa: E402
from attr_engine.cli import main  # noqa: E402
from attr_engine.imageops import data_config, decode_image, prepare_input  # noqa: E402
from attr_engine.serve import APP, InstanceError, ServeSettings, encode_map, logits_and_maps, read_image  # noqa: E402
from tests.eval_helpers import logits_read_the_target, single_thread, untrained_resnet_checkpoint  # noqa: E402
from tests.ray_helpers import start_local_ray  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NAME = "tiny"
FAST_AHA = {"n_fractions": 6, "n_iters": 8, "decoder_dim": 16, "class_dim": 8, "grid_range": (2, 6)}
# Image name -> (height, width, mode, format): two aspect ratios (a NaN border on either side), greyscale, a JPEG.
IMAGES = {"a.png": (40, 36, "RGB", "PNG"), "b.jpg": (33, 48, "RGB", "JPEG"), "c.png": (36, 52, "L", "PNG")}
LIMITS = ["--max-image-bytes", "30000", "--max-pixels", "20000", "--min-side", "8", "--max-instances", "8",
          "--max-request-bytes", "200000"]  # fmt: skip
METHODS = {"gradient": ["--method", "gradient"], "aha": ["--method", "aha", "--aha", "{aha}"]}
# The kinds of server: PyTorch replicas of each method, and onnxruntime replicas of the exported AHA ("onnx").
KINDS = {"gradient": "gradient", "aha": "aha", "onnx": "aha"}  # kind -> the method its maps are explain's of
# Seconds a server may take to stop after Ctrl-C; past them its threads' stacks are shown and it is killed.
STOP_SECONDS = 120
ONNX_MAP_ATOL = 1e-4  # onnxruntime against PyTorch on standardised maps (tests/test_export.py)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _png(array: np.ndarray, fmt: str = "PNG", **kwargs) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, fmt, **kwargs)
    return buffer.getvalue()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _decode_map(entry: dict) -> np.ndarray:
    wire = entry["map"]
    amap = np.frombuffer(base64.b64decode(wire["b64"]), dtype=np.dtype(wire["dtype"]).newbyteorder("<"))
    assert wire["shape"] == [entry["height"], entry["width"]]
    return amap.reshape(wire["shape"])


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread, as each replica has: the same arithmetic, and no spinning on 2 shared cores."""
    with single_thread():
        yield


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster of 2 CPUs (:func:`tests.ray_helpers.start_local_ray`) that the servers join (--address),
    and the port of its HTTP proxy: every server of the module listens there (Serve keeps the address it started
    with). The test reads Serve's status."""
    start_local_ray()
    yield ray.get_runtime_context().gcs_address, _free_port()
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A classifier checkpoint with its train.json (class names), an AHA for it, three images, and `explain`'s
    maps of them (the local engine) for the predicted classes and for class 2, with each method."""
    root = tmp_path_factory.mktemp("serve")
    checkpoint = untrained_resnet_checkpoint(root)
    _, meta = load_safetensors(checkpoint)
    classifier = load_classifier(meta["model_name"], checkpoint=checkpoint)
    classes = [f"class-{k}" for k in range(classifier.num_classes)]
    (root / "train.json").write_text(json.dumps({"model": classifier.model_name, "classes": classes}))
    torch.manual_seed(0)
    AHA(classifier, AHAConfig(**FAST_AHA)).save(root / "aha")
    rng = np.random.default_rng(0)
    images = {}
    for name, (h, w, mode, fmt) in IMAGES.items():
        pixels = (rng.random((h, w, 3)) * 255).astype(np.uint8)
        data = _png(
            np.asarray(Image.fromarray(pixels).convert(mode)), fmt, **({"quality": 95} if fmt == "JPEG" else {})
        )
        (root / "images").mkdir(exist_ok=True)
        (root / "images" / name).write_bytes(data)
        images[name] = data
    local = {}
    for method, flags in METHODS.items():
        for target in ("pred", "2"):
            out = root / f"explain-{method}-{target}"
            args = [a.replace("{aha}", str(root / "aha")) for a in flags]
            assert main(["explain", str(root / "images"), "--classifier", str(checkpoint), "--out", str(out),
                         "--no-progress", "--target", target, *args]) == 0  # fmt: skip
            manifest = json.loads((out / "_manifest" / "rank0-of-1.json").read_text())
            targets = {w["input"]: w["target"] for w in manifest["written"]}
            local[method, target] = {n: (np.load(out / Path(n).with_suffix(".npy")), targets[n]) for n in IMAGES}
    config = data_config(classifier, crop_pct=1.0)
    with torch.no_grad():
        x = torch.stack([prepare_input(decode_image(io.BytesIO(images[n])), config)[0] for n in IMAGES])
        probabilities = classifier(x).softmax(1)
    return {"root": root, "checkpoint": checkpoint, "images": images, "local": local, "classes": classes,
            "probabilities": dict(zip(IMAGES, probabilities, strict=True))}  # fmt: skip


def _replicas() -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "SERVE_REPLICA" in a["name"])


@pytest.fixture(scope="module")
def artifact(data) -> Path:
    """The test's AHA exported to ONNX by `attr-engine export` (its crop and train.json's class names recorded)."""
    pytest.importorskip("onnxruntime", reason="the export extra (onnxruntime) is not installed")
    pytest.importorskip("onnxscript", reason="the export extra (onnxscript) is not installed")
    out = data["root"] / "aha.onnx"
    argv = ["export", "--classifier", str(data["checkpoint"]), "--aha", str(data["root"] / "aha"), "-o", str(out)]
    assert main([*argv, "--device", "cpu"]) == 0
    return out


@pytest.fixture(scope="module", params=sorted(KINDS))
def server(request, cluster, data):
    """`attr-engine serve` in its own process, joined to the test's cluster; stopped with Ctrl-C at the end, which
    must end it cleanly (exit status 0, no traceback). It starts with SIGINT ignored, as a script's background
    command (`attr-engine serve ... &`) does: Ctrl-C must stop it all the same."""
    kind, (address, port) = request.param, cluster
    method = KINDS[kind]
    if kind == "onnx":
        model = ["--artifact", str(request.getfixturevalue("artifact"))]
    else:
        args = [a.replace("{aha}", str(data["root"] / "aha")) for a in METHODS[method]]
        model = ["--classifier", str(data["checkpoint"]), *args]
    command = [sys.executable, "-m", "attr_engine", "serve", *model,
               "--name", NAME, "--port", str(port), "--address", address, *LIMITS]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONFAULTHANDLER": "1"}
    ignored = lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
                            preexec_fn=ignored)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    client = httpx.Client(base_url=url, timeout=120)
    try:
        line = proc.stdout.readline()  # printed once the model answers its readiness route
        if not line:  # the command ended: its one line says why
            raise AssertionError(proc.stderr.read())
        assert line.startswith(f"serving {method} maps as {NAME!r} at {url}/v1/models/{NAME}"), line
        yield {"kind": kind, "method": method, "client": client, "replicas": _replicas(), "proc": proc, "url": url}
    finally:
        client.close()
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=STOP_SECONDS)
        except subprocess.TimeoutExpired:
            # PYTHONFAULTHANDLER: SIGABRT writes every thread's stack to stderr, then the process ends.
            proc.send_signal(signal.SIGABRT)
            try:
                _, err = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            raise AssertionError(f"the server did not stop {STOP_SECONDS} s after Ctrl-C; its stderr:\n{err}") from None
    assert proc.returncode == 0, err
    assert f"stopped serving {NAME!r}" in err and "Traceback" not in err


def _explain(client, instances: list[dict], verb: str = "explain") -> httpx.Response:
    return client.post(f"/v1/models/{NAME}:{verb}", json={"instances": instances})


def _assert_close(served: np.ndarray, local: np.ndarray, kind: str = "aha") -> None:
    """A served map against `explain`'s: float32 rounding for a PyTorch replica, 1e-4 for onnxruntime's."""
    assert served.dtype == np.float32 and served.shape == local.shape
    assert np.array_equal(np.isnan(served), np.isnan(local)) and np.isnan(local).any()  # the crop's NaN border
    scale = float(np.nanmax(np.abs(local)))
    if kind == "onnx":
        np.testing.assert_allclose(served, local, rtol=0, atol=ONNX_MAP_ATOL)
    else:
        np.testing.assert_allclose(served, local, rtol=1e-5, atol=1e-5 * scale)


def _probability_tolerance(kind: str) -> float:
    """onnxruntime's logits differ from PyTorch's by float32 rounding over the layers: the probabilities too."""
    return 1e-4 if kind == "onnx" else 1e-5


# ---------------------------------------------------------------------------------------------------------------


def test_explain_answers_the_local_engines_maps_targets_and_probabilities(server, data):
    """Three images in one request (predicted classes) and the same with class 2: explain's maps, in the image's
    frame, and the classifier's probability of each explained class."""
    for target, wire_target in (("pred", None), ("2", 2)):
        instances = [{"image": {"b64": _b64(data["images"][n])}, "target": wire_target} for n in IMAGES]
        answer = _explain(server["client"], instances)
        assert answer.status_code == 200, answer.text
        entries = answer.json()["explanations"]
        assert len(entries) == len(IMAGES)
        for name, entry in zip(IMAGES, entries, strict=True):
            local_map, local_target = data["local"][server["method"], target][name]
            assert entry["error"] is None and entry["target"] == local_target
            assert (entry["height"], entry["width"]) == IMAGES[name][:2]
            probability = float(data["probabilities"][name][local_target])
            assert entry["probability"] == pytest.approx(probability, rel=_probability_tolerance(server["kind"]))
            _assert_close(_decode_map(entry), local_map, server["kind"])


def test_concurrent_requests_are_batched_and_each_gets_its_own_map(server, data):
    """16 requests at once from 8 threads, each image with its own target: batched on the replica, yet every
    answer is its own image's and target's map (a row mix-up would hand a request another image's map)."""
    jobs = [(name, target) for name in IMAGES for target in (None, 2)] * 3
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda job: _explain(server["client"], [{"image": {"b64": _b64(data["images"][job[0]])},
                                                                       "target": job[1]}]), jobs))  # fmt: skip
    for (name, target), answer in zip(jobs, answers, strict=True):
        assert answer.status_code == 200, answer.text
        (entry,) = answer.json()["explanations"]
        local_map, local_target = data["local"][server["method"], "pred" if target is None else "2"][name]
        assert entry["target"] == local_target
        _assert_close(_decode_map(entry), local_map, server["kind"])


def test_predict_answers_the_class_its_probability_and_name(server, data):
    instances = [{"image": {"b64": _b64(data["images"][n])}} for n in IMAGES]
    answer = _explain(server["client"], instances, "predict")
    assert answer.status_code == 200, answer.text
    for name, entry in zip(IMAGES, answer.json()["predictions"], strict=True):
        predicted = int(data["probabilities"][name].argmax())
        assert entry["class"] == predicted == data["local"][server["method"], "pred"][name][1]
        probability = float(data["probabilities"][name].max())
        assert entry["probability"] == pytest.approx(probability, rel=_probability_tolerance(server["kind"]))
        # From train.json: read by a PyTorch replica, recorded in the exported file's metadata by export.
        assert entry["name"] == data["classes"][predicted] and entry["error"] is None


def test_an_onnx_replica_predicts_with_the_classifier_alone(artifact, data, caplog):
    """The ONNX back end (no Ray): in one batch, an :explain row runs through the whole file and a :predict row
    through the classifier's subgraph alone, both with the local classes and probabilities."""
    from attr_engine.artifact import read_artifact
    from attr_engine.serve import ModelServer

    with caplog.at_level("WARNING", logger="attr_engine.serve"):
        server = ModelServer(read_artifact(artifact), ServeSettings(max_pixels=20_000, min_side=8))
    assert not caplog.records  # the classifier was cut out: nothing to warn of
    calls: list[tuple[str, int]] = []

    class Recorded:
        def __init__(self, name, session):
            self.name, self.session = name, session

        def run(self, outputs, feeds):
            calls.append((self.name, len(feeds["images"])))
            return self.session.run(outputs, feeds)

    backend = server.backend
    backend.session = Recorded("file", backend.session)
    backend.logits_session = Recorded("classifier", backend.logits_session)
    instance = {"image": {"b64": _b64(data["images"]["b.jpg"])}, "target": None}
    rows = server._rows([instance], False) + server._rows([instance], True) + server._rows([instance], False)
    answers = backend.compute(rows)
    assert sorted(calls) == [("classifier", 2), ("file", 1)]
    predicted = int(data["probabilities"]["b.jpg"].argmax())
    probability = float(data["probabilities"]["b.jpg"].max())
    for answer in answers:
        assert answer.target == predicted and answer.error is None
        assert answer.probability == pytest.approx(probability, rel=_probability_tolerance("onnx"))
    assert answers[0].map is None and answers[2].map is None
    _assert_close(answers[1].map, data["local"]["aha", "pred"]["b.jpg"][0], "onnx")


def test_an_onnx_replica_whose_logits_cannot_be_cut_out_says_so(tmp_path, caplog):
    """A file whose logits read the target keeps :predict on the whole file, and the log names the file and why."""
    from attr_engine.serve import ModelServer

    artifact = logits_read_the_target(tmp_path / "target.onnx")
    with caplog.at_level("WARNING", logger="attr_engine.serve"):
        server = ModelServer(artifact, ServeSettings())
    assert server.backend.logits_session is None
    (record,) = caplog.records
    assert artifact.path in record.getMessage() and ":predict runs the whole file" in record.getMessage()


def test_the_readme_example_runs_against_the_server(server, data, tmp_path, monkeypatch):
    """README "Serve over HTTP", its Python block as printed, with this server's address and a photo of ours."""
    from tests.test_readme import code_block

    block = code_block("### Serve over HTTP")
    assert "http://127.0.0.1:8000/v1/models/shapes:explain" in block
    (tmp_path / "photo.jpg").write_bytes(data["images"]["b.jpg"])
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(block.replace("http://127.0.0.1:8000/v1/models/shapes", f"{server['url']}/v1/models/{NAME}"), namespace)
    _assert_close(namespace["amap"], data["local"][server["method"], "pred"]["b.jpg"][0], server["kind"])


def test_health_routes(server):
    client = server["client"]
    assert client.get("/").json() == {"status": "alive"}
    assert client.get(f"/v1/models/{NAME}").json() == {"name": NAME, "ready": True}
    assert client.get("/v1/models").json() == {"models": [NAME]}


def _bomb() -> bytes:
    """A 4000 x 4000 PNG of a few kilobytes: 16 megapixels once decompressed."""
    return _png(np.zeros((4000, 4000), dtype=bool))


BAD_REQUESTS = {
    "not json": (b"{instances: [", 400, "not JSON"),
    "nested too deeply": (b"[" * 100_000, 400, "nested deeper than"),
    "instances nested too deeply": (b'{"instances": ' + b"[" * 90_000 + b"]" * 90_000 + b"}", 400, "nested deeper"),
    "no instances": (json.dumps({"inputs": []}).encode(), 400, "'instances'"),
    "empty instances": (json.dumps({"instances": []}).encode(), 400, "empty"),
    "too many instances": (json.dumps({"instances": [{}] * 9}).encode(), 413, "limit of 8"),
    "instance not an object": (json.dumps({"instances": [3]}).encode(), 400, "must be an object"),
    "missing image": (json.dumps({"instances": [{"target": 1}]}).encode(), 400, "needs 'image'"),
    "unknown field": (json.dumps({"instances": [{"image": {"b64": ""}, "targte": 1}]}).encode(), 400, "'targte'"),
    "not base64": (json.dumps({"instances": [{"image": {"b64": "!!!"}}]}).encode(), 400, "not valid base64"),
    "not an image": (json.dumps({"instances": [{"image": {"b64": _b64(b"GIF89a nope")}}]}).encode(), 400, "not a PNG"),
    "payload over the cap": (json.dumps({"instances": [{"image": {"b64": "A" * 40004}}]}).encode(), 413, "30000 bytes"),
    "decompression bomb": (None, 413, "4000 x 4000 pixels"),
    "too large in pixels": (None, 413, "more than the server's limit of 20000"),
    "too small": (None, 400, "at least 8"),
    "target out of range": (None, 400, "target 6 is not a class"),
    "negative target": (None, 400, "target -1 is not a class"),
    "target not an int": (None, 400, "must be a class index"),
}


def _bad_body(case: str, good: bytes) -> bytes:
    body, _, _ = BAD_REQUESTS[case]
    if body is not None:
        return body
    image, target = good, None
    if case == "decompression bomb":
        image = _bomb()
        assert len(image) < 30000  # under the byte cap: the pixel count refuses it
    elif case == "too large in pixels":
        image = _png(np.zeros((150, 150, 3), np.uint8))
    elif case == "too small":
        image = _png(np.zeros((4, 40, 3), np.uint8))
    else:
        target = {"target out of range": 6, "negative target": -1, "target not an int": "2"}[case]
    return json.dumps({"instances": [{"image": {"b64": _b64(image)}, "target": target}]}).encode()


def test_bad_requests_get_4xx_and_one_line_and_the_replica_stays(server, data):
    client, good = server["client"], data["images"]["a.png"]
    for case, (_, status, words) in BAD_REQUESTS.items():
        for verb in ("explain", "predict"):
            answer = client.post(f"/v1/models/{NAME}:{verb}", content=_bad_body(case, good))
            assert answer.status_code == status, (case, answer.text)
            error = answer.json()["error"]
            assert words in error and "\n" not in error and len(error) < 300, (case, error)
    big = client.post(f"/v1/models/{NAME}:explain", content=b"x" * 300_000)  # over the body cap
    assert big.status_code == 413 and "request body exceeds" in big.json()["error"]
    for path, method, status in (("/v1/models/other:explain", "POST", 404), (f"/v1/models/{NAME}:explain", "GET", 405),
                                 ("/nowhere", "GET", 404)):  # fmt: skip
        answer = client.request(method, path)
        assert answer.status_code == status and "\n" not in answer.json()["error"]
    # Still answering, by the same replica: no request took it down.
    answer = _explain(client, [{"image": {"b64": _b64(good)}}])
    assert answer.status_code == 200 and answer.json()["explanations"][0]["error"] is None
    assert _replicas() == server["replicas"] and len(server["replicas"]) == 1
    status = serve.status().applications["attr-engine"]
    assert status.status == "RUNNING" and status.deployments["ModelServer"].replica_states == {"RUNNING": 1}


def test_a_body_over_the_limit_is_answered_413_while_the_client_is_still_sending(server, data):
    """A body megabytes over --max-request-bytes, declared by its Content-Length or sent in chunks without one: the
    client gets the 413 and its one line, not a reset connection. A declared length over the limit is answered
    before a byte of the body is sent (a raw socket that sends the headers alone), and the same replica then
    answers a good request from the same client."""
    client, url = server["client"], httpx.URL(server["url"])
    limit = 200_000  # LIMITS' --max-request-bytes
    size = 5_000_000

    def chunks():  # no Content-Length: httpx sends it chunked
        for start in range(0, size, 1 << 16):
            yield b"x" * min(1 << 16, size - start)

    for body in (b"x" * size, chunks()):
        answer = client.post(f"/v1/models/{NAME}:explain", content=body)
        assert answer.status_code == 413, answer.text
        error = answer.json()["error"]
        assert error == f"the request body exceeds the server's limit of {limit} bytes", error
    with socket.create_connection((url.host, url.port), timeout=60) as raw:
        raw.sendall(f"POST /v1/models/{NAME}:explain HTTP/1.1\r\nHost: {url.host}\r\nContent-Length: {size}\r\n"
                    "Content-Type: application/json\r\n\r\n".encode())  # fmt: skip
        reply = b""
        while b"}" not in reply:  # the JSON error's end; the body is never sent
            piece = raw.recv(1 << 16)
            assert piece, reply
            reply += piece
    head, _, error_json = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 "), reply
    assert json.loads(error_json)["error"] == f"the request body exceeds the server's limit of {limit} bytes"
    answer = _explain(client, [{"image": {"b64": _b64(data["images"]["a.png"])}}])
    assert answer.status_code == 200 and answer.json()["explanations"][0]["error"] is None
    assert _replicas() == server["replicas"]


def test_a_bad_instance_gets_its_error_and_the_others_still_answer(server, data):
    good = {"image": {"b64": _b64(data["images"]["b.jpg"])}, "target": None}
    answer = _explain(server["client"], [good, {"image": {"b64": "!!"}}, {**good, "target": 99}, good])
    assert answer.status_code == 200, answer.text
    entries = answer.json()["explanations"]
    assert [e["error"] is None for e in entries] == [True, False, False, True]
    assert "base64" in entries[1]["error"] and "target 99" in entries[2]["error"] and entries[1]["map"] is None
    local_map, _ = data["local"][server["method"], "pred"]["b.jpg"]
    _assert_close(_decode_map(entries[3]), local_map, server["kind"])


def test_a_replica_of_the_exported_file_never_imports_torch(server, data):
    """After the request path has run (:explain with and without a target, :predict, a bad instance), the replica's
    process is asked what it has imported: torch for a PyTorch replica (so the probe sees it), onnxruntime and
    never torch for an ONNX one."""
    instance = {"image": {"b64": _b64(data["images"]["c.png"])}, "target": None}
    mixed = [instance, {**instance, "target": 2}, {"image": {"b64": "!!"}}]
    assert _explain(server["client"], mixed).status_code == 200
    assert _explain(server["client"], [instance], "predict").status_code == 200
    modules = serve.get_app_handle(APP).loaded_modules.remote().result(timeout_s=60)
    assert "starlette" in modules and "PIL" in modules
    if server["kind"] == "onnx":
        assert "onnxruntime" in modules and "torch" not in modules
    else:
        assert "torch" in modules


# ---------------------------------------------------------------------------------------------------------------
# Without a server: the wire encoding, the image checks, the command's own checks
# ---------------------------------------------------------------------------------------------------------------


def test_maps_on_the_wire_are_little_endian_float32_or_float16_with_a_range_check():
    amap = np.array([[0.1, -2.5, np.nan], [1e-3, 3.0, 7.0]], np.float32)
    wire = encode_map(amap, "float32")
    assert wire["shape"] == [2, 3] and wire["dtype"] == "float32"
    assert np.array_equal(np.frombuffer(base64.b64decode(wire["b64"]), "<f4").reshape(2, 3), amap, equal_nan=True)
    half = encode_map(amap, "float16")
    back = np.frombuffer(base64.b64decode(half["b64"]), "<f2").reshape(2, 3)
    assert np.array_equal(back, amap.astype(np.float16), equal_nan=True)
    with pytest.raises(InstanceError, match="float16's range"):
        encode_map(np.array([[1e5]], np.float32), "float16")


def test_logits_and_maps_take_the_fused_path_where_the_explainer_has_one():
    """Without ``predict_and_explain``: the classifier's logits and ``attribute`` of the predicted (or given)
    classes. With it (AHA's fused path): its own answer, the target passed through, ``attribute`` never called."""
    from attr_engine.explainer import get_explainer
    from tests.eval_helpers import images, tiny_convnet

    classifier, x = tiny_convnet(), images(3, 16)
    explainer = get_explainer("gradient", classifier)
    logits, maps = logits_and_maps(classifier, explainer, x, None)
    assert torch.equal(logits, classifier(x).detach())
    assert torch.equal(maps, explainer.attribute(x, logits.argmax(1)))
    given = torch.tensor([1, 0, 4])
    assert torch.equal(logits_and_maps(classifier, explainer, x, given)[1], explainer.attribute(x, given))

    class Fused:
        def __init__(self) -> None:
            self.targets: list = []

        def predict_and_explain(self, x, target=None):
            self.targets.append(target)
            return torch.full((len(x), 5), 2.0), torch.full((len(x), 16, 16), 7.0)

        def attribute(self, *args, **kwargs):
            raise AssertionError("the fused path must not call attribute")

    fused = Fused()
    logits, maps = logits_and_maps(classifier, fused, x, None)
    assert torch.equal(logits, torch.full((3, 5), 2.0)) and torch.equal(maps, torch.full((3, 16, 16), 7.0))
    logits_and_maps(classifier, fused, x, given)
    assert fused.targets[0] is None and torch.equal(fused.targets[1], given)


def test_an_image_is_checked_from_its_header_before_it_is_decoded():
    settings = ServeSettings(max_pixels=20_000, min_side=8)
    assert read_image(_png(np.zeros((20, 30, 3), np.uint8)), settings).size == (30, 20)
    with pytest.raises(InstanceError, match="4000 x 4000") as bomb:
        read_image(_bomb(), settings)
    assert bomb.value.status == 413
    with pytest.raises(InstanceError, match="not a PNG"):
        read_image(_png(np.zeros((20, 20, 3), np.uint8), "BMP"), settings)  # a format PIL reads but we do not take


def test_the_onnx_back_end_runs_where_torch_cannot_be_imported(artifact, data, tmp_path):
    """A replica's side without Ray: the artifact and settings as Ray hands them over (pickled), unpickled in a
    process where any import of torch fails, build the server, which reads and checks instances and computes their
    rows (:explain with and without a target, :predict) in onnxruntime."""
    import pickle

    from attr_engine.artifact import read_artifact

    settings = ServeSettings(max_pixels=20_000, min_side=8)
    (tmp_path / "source.pkl").write_bytes(pickle.dumps((read_artifact(artifact), settings)))
    (tmp_path / "b64.txt").write_text(_b64(data["images"]["b.jpg"]))
    program = """
import pickle, sys
sys.modules["torch"] = None  # any import of torch fails
import numpy as np
from attr_engine.serve import ModelServer
source, settings = pickle.loads(open("source.pkl", "rb").read())
server = ModelServer(source, settings)
instance = {"image": {"b64": open("b64.txt").read()}, "target": None}
rows = server._rows([instance, {**instance, "target": 2}, {"image": {"b64": "!!"}}], True)
rows += server._rows([instance], False)
answers = server.backend.compute([rows[0], rows[1], rows[3]])
np.save("maps.npy", np.stack([answers[0].map, answers[1].map]))
print(str(rows[2]), [a.target for a in answers], answers[2].map is None, server.names[0])
"""
    done = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    local_pred, predicted = data["local"]["aha", "pred"]["b.jpg"]
    assert done.stdout.split() == ["image.b64", "is", "not", "valid", "base64", f"[{predicted},", "2,",
                                   f"{predicted}]", "True", "class-0"]  # fmt: skip
    maps = np.load(tmp_path / "maps.npy")
    _assert_close(maps[0], local_pred, "onnx")
    _assert_close(maps[1], data["local"]["aha", "2"]["b.jpg"][0], "onnx")


def _plain_onnx(path: Path) -> Path:
    """A valid ONNX file that no attr-engine export wrote (an identity, no metadata)."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    tensor = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 3, 8, 8]) for n in ("images", "maps")]
    graph = helper.make_graph([helper.make_node("Identity", ["images"], ["maps"])], "plain", [tensor[0]], [tensor[1]])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("missing", "--artifact {path}: no such file"),
        ("not onnx", "--artifact {path} is not an ONNX file onnxruntime can load"),
        ("no metadata", "--artifact {path} has no attr_engine.export/1 metadata"),
        ("with --classifier", "drop --classifier"),
        ("with --method and --aha", "drop --method, --aha"),
        ("with --img-size", "drop --img-size"),
        ("bad crop", "--crop-pct must be in (0, 1], got 1.5"),
    ],
)
def test_the_command_refuses_a_bad_artifact_in_one_line(tmp_path, capsys, case, words):
    pytest.importorskip("onnxruntime", reason="the export extra (onnxruntime) is not installed")
    path = tmp_path / "aha.onnx"
    if case == "not onnx":
        path.write_text("not a model")
    elif case == "no metadata":
        _plain_onnx(path)
    extra = {"with --classifier": ["--classifier", "clf.safetensors"], "with --img-size": ["--img-size", "32"],
             "with --method and --aha": ["--method", "aha", "--aha", "runs/aha"],
             "bad crop": ["--crop-pct", "1.5"]}.get(case, [])  # fmt: skip
    assert main(["serve", "--artifact", str(path), "--port", str(_free_port()), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert words.format(path=path) in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--port", "70000"], "--port must be between 1 and 65535"),
        (["--name", "a/b"], "name must be"),
        (["--max-batch-size", "0"], "max-batch-size must be"),
        (["--method", "gradeint"], "unknown method 'gradeint'"),
        (["--method", "aha"], "--method aha needs --aha DIR"),
    ],
)
def test_the_command_refuses_bad_flags_in_one_line_before_starting(tmp_path, capsys, flags, words):
    checkpoint = untrained_resnet_checkpoint(tmp_path)
    assert main(["serve", "--classifier", str(checkpoint), "--port", str(_free_port()), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1, err


def test_the_command_refuses_a_port_in_use(tmp_path, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", "resnet10t", "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
