"""attr_engine.ray and `explain --engine ray` on a local two-CPU Ray cluster: every image once, the local engine's
maps bit for bit, a worker killed mid-job, a corrupt image, resume across engines, the library's input layouts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

ray = pytest.importorskip("ray")

import attr_engine.ray as attr_ray  # noqa: E402  (after the skip: without Ray there is nothing to test)
from attr_engine.classifier import save_classifier  # noqa: E402
from attr_engine.classifier_training import small_model_config  # noqa: E402
from attr_engine.cli import main  # noqa: E402
from attr_engine.ray import BatchAttributor, attribute_dataset  # noqa: E402
from tests.eval_helpers import single_thread  # noqa: E402
from tests.ray_helpers import local_ray_cluster  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NAMES = [f"{c}/{i}.png" for c in ("cat", "dog") for i in range(12)]
CORRUPT = "dog/broken.jpg"
BATCH = "4"


@pytest.fixture(scope="module")
def cluster():
    """One local Ray cluster for the module: 2 CPUs (2 actors), started once; the worker that dies below travels by
    value."""
    with local_ray_cluster(sys.modules[__name__]):
        yield


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread, as every Ray actor of one CPU has: the same arithmetic, and no spinning on 2 shared cores."""
    with single_thread():
        yield


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """An untrained small ResNet at 32 px saved as train-classifier would, and an ImageFolder tree of 24 images
    of two sizes plus one corrupt file."""
    root = tmp_path_factory.mktemp("ray")
    torch.manual_seed(0)
    checkpoint = root / "classifier.safetensors"
    save_classifier(small_model_config("resnet", 32).build(6), checkpoint)
    rng = np.random.default_rng(0)
    for k, name in enumerate(NAMES):
        (root / "images" / name).parent.mkdir(parents=True, exist_ok=True)
        size = (40, 36) if k % 3 else (33, 48)
        Image.fromarray((rng.random((*size, 3)) * 255).astype(np.uint8)).save(root / "images" / name)
    (root / "images" / CORRUPT).write_bytes(b"definitely not a jpeg")
    return checkpoint, root / "images"


def _explain(checkpoint: Path, src: Path, out: Path, *extra: str) -> int:
    args = ["explain", str(src), "--classifier", str(checkpoint), "--out", str(out), "--no-progress"]
    return main([*args, "--method", "gradient", "--batch-size", BATCH, "--png", *extra])


def _outputs(out: Path) -> dict[str, bytes]:
    """Every output file's bytes (maps, overlays, settings), by path; the manifest is compared separately."""
    return {
        p.relative_to(out).as_posix(): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and "_manifest" not in p.parts
    }


def _journal(out: Path) -> list[str]:
    lines = (out / "_manifest" / "rank0-of-1.jsonl").read_text().splitlines()
    return [json.loads(line)["output"] for line in lines]


def _manifest(out: Path) -> dict:
    return json.loads((out / "_manifest" / "rank0-of-1.json").read_text())


@pytest.fixture(scope="module")
def local_run(data, tmp_path_factory) -> Path:
    checkpoint, src = data
    out = tmp_path_factory.mktemp("local") / "maps"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert _explain(checkpoint, src, out) == 0
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.fixture(scope="module")
def ray_run(cluster, data, tmp_path_factory) -> tuple[Path, str]:
    """`explain --engine ray` with two actors over the whole tree; its output directory and stderr."""
    checkpoint, src = data
    out = tmp_path_factory.mktemp("ray") / "maps"
    stderr = tmp_path_factory.mktemp("log") / "stderr"
    import contextlib

    with open(stderr, "w") as err, contextlib.redirect_stderr(err):
        assert _explain(checkpoint, src, out, "--engine", "ray", "--actors", "2") == 0
    return out, stderr.read_text()


# ---------------------------------------------------------------------------------------------------------------


def test_every_image_is_explained_exactly_once(ray_run):
    out, _ = ray_run
    manifest = _manifest(out)
    written = [w["input"] for w in manifest["written"]]
    assert sorted(written) == sorted(NAMES)  # none missing, none twice
    assert Counter(_journal(out)) == Counter(str(Path(n).with_suffix(".npy").as_posix()) for n in NAMES)
    assert all(0 <= w["target"] < 6 for w in manifest["written"])


def test_maps_and_overlays_equal_the_local_engines_bit_for_bit(local_run, ray_run):
    out, _ = ray_run
    local, remote = _outputs(local_run), _outputs(out)
    assert len(local) == 2 * len(NAMES) + 1  # a map and an overlay per image, and explain.json
    assert sorted(remote) == sorted(local)
    assert [name for name in local if local[name] != remote[name]] == []
    amap = np.load(out / "cat" / "0.npy")
    assert amap.shape == (33, 48) and np.isnan(amap).any() and np.isfinite(amap).any()  # image frame, NaN border
    assert sorted(_manifest(out)["written"], key=str) == sorted(_manifest(local_run)["written"], key=str)


def test_a_corrupt_image_is_reported_without_failing_the_job(ray_run):
    out, stderr = ray_run
    assert [u["input"] for u in _manifest(out)["unreadable"]] == [CORRUPT]
    assert "skipped unreadable input" in stderr and "broken.jpg" in stderr and "Traceback" not in stderr
    assert not (out / "dog" / "broken.npy").exists()


class _DiesOnce(BatchAttributor):
    """An actor whose worker process dies (os._exit, no clean-up) in its second batch - once in the whole job,
    whichever actor gets there first (an O_EXCL marker file decides)."""

    marker = ""

    def __call__(self, batch):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 2:
            try:
                fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                pass
            else:
                os.close(fd)
                os._exit(1)
        return super().__call__(batch)


def test_a_worker_killed_mid_job_resumes_a_local_run_and_yields_every_output_once(
    cluster, data, local_run, tmp_path, monkeypatch
):
    checkpoint, src = data
    out = tmp_path / "maps"
    # A local run stopped after 6 maps (chunked, --limit): the Ray job must do only the rest.
    assert _explain(checkpoint, src, out, "--limit", "6") == 0
    first = {p: p.stat().st_mtime_ns for p in out.rglob("*.npy")}
    assert len(first) == 6

    marker = tmp_path / "killed"
    monkeypatch.setattr(_DiesOnce, "marker", str(marker))
    monkeypatch.setattr(attr_ray, "BatchAttributor", _DiesOnce)
    assert _explain(checkpoint, src, out, "--engine", "ray", "--actors", "2") == 0
    assert marker.exists()  # a worker did die mid-job; Ray restarted the actor and retried its batch

    manifest = _manifest(out)
    assert len(manifest["already_done"]) == 6 and len(manifest["written"]) == len(NAMES) - 6
    assert sorted(manifest["already_done"] + [w["input"] for w in manifest["written"]]) == sorted(NAMES)
    assert Counter(_journal(out)).most_common(1)[0][1] == 1  # no output journalled twice
    assert all(p.stat().st_mtime_ns == t for p, t in first.items())  # the local run's maps were not redone
    local = _outputs(local_run)
    assert _outputs(out) == local


def test_attribute_dataset_reads_bytes_and_read_images_layouts(cluster, data, local_run):
    checkpoint, src = data
    # Image bytes plus paths (read_binary_files), maps in the image's frame, deletion / insertion scores.
    ds = ray.data.read_binary_files(str(src), include_paths=True)
    rows = attribute_dataset(
        ds, "gradient", checkpoint, frame="image", scores=True, batch_size=8, concurrency=1
    ).take_all()
    by_name = {Path(r["path"]).relative_to(src.resolve()).as_posix(): r for r in rows}
    assert sorted(by_name) == sorted([*NAMES, CORRUPT])
    assert "cannot read image" in by_name[CORRUPT]["error"] and "broken.jpg" in by_name[CORRUPT]["error"]
    assert by_name[CORRUPT]["map"].shape == (0, 0) and by_name[CORRUPT]["target"] == -1
    good = [by_name[n] for n in NAMES]
    assert all(r["error"] == "" and 0.0 <= r["deletion"] <= 1.0 and 0.0 <= r["insertion"] <= 1.0 for r in good)
    for name, row in zip(NAMES, good, strict=True):
        # Other batches than the CLI's (8, as Ray's reader groups the files): equal up to float rounding.
        local = np.load(local_run / Path(name).with_suffix(".npy"))
        np.testing.assert_allclose(row["map"], local, rtol=1e-5, atol=1e-7)
        assert (row["height"], row["width"]) == local.shape

    # Decoded images (read_images), maps in the classifier's frame.
    paths = [str(src / n) for n in NAMES[:8]]
    rows = attribute_dataset(
        ray.data.read_images(paths, include_paths=True, mode="RGB"), "gradient", checkpoint, batch_size=4
    ).take_all()
    assert sorted(Path(r["path"]).name for r in rows) == sorted(Path(p).name for p in paths)
    for row in rows:
        assert row["map"].shape == (32, 32) and row["error"] == "" and "image" not in row


def test_library_and_cli_mistakes_are_clear(data, tmp_path, capsys):
    checkpoint, src = data
    with pytest.raises(ValueError, match="frame must be one of"):
        attr_ray.AttributionJob(classifier=str(checkpoint), frame="photo")
    with pytest.raises(FileNotFoundError, match="classifier checkpoint not found"):
        attr_ray.AttributionJob(classifier=str(tmp_path / "missing.safetensors"))
    with pytest.raises(ValueError, match="a batch needs an 'image', 'bytes' or 'path' column"):
        BatchAttributor(attr_ray.AttributionJob(method="saliency", classifier=str(checkpoint)))({"x": np.zeros(2)})
    assert _explain(checkpoint, src, tmp_path / "o", "--address", "auto") == 2
    assert "--address applies to --engine ray only" in capsys.readouterr().err


def test_import_attr_engine_and_help_do_not_import_ray():
    code = (
        "import sys, contextlib, io\n"
        "import attr_engine\n"
        "from attr_engine.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n"
        "        main(['explain', '--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print('ray' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False"]


class _BrokenActor(BatchAttributor):
    """An actor whose set-up fails where the driver's checks cannot see it (e.g. a file only the nodes read)."""

    def __init__(self, job: attr_ray.AttributionJob) -> None:
        raise ValueError("this actor cannot build its method")


def _one_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if "warning: --model" not in line and line]
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


def test_a_request_the_cluster_cannot_meet_is_one_line_before_anything_starts(cluster, data, tmp_path, capsys):
    """Issue #20.7/8: --gpus-per-actor on a cluster without GPUs hung; --device cuda died in the actors."""
    checkpoint, src = data
    cases = [(("--gpus-per-actor", "1"), "do not fit the Ray cluster"), (("--actors", "3"), "do not fit")]
    if not ray.cluster_resources().get("GPU"):
        cases.append((("--device", "cuda"), "the actors would get no GPU (the Ray cluster has no GPUs)"))
    for extra, message in cases:
        out = tmp_path / "out"
        assert _explain(checkpoint, src, out, "--engine", "ray", *extra) == 2
        assert message in _one_line(capsys)
        assert not out.exists()


def test_an_error_inside_an_actor_is_its_own_one_line_message(cluster, data, tmp_path, monkeypatch, capsys):
    checkpoint, src = data
    monkeypatch.setattr(attr_ray, "BatchAttributor", _BrokenActor)
    assert _explain(checkpoint, src, tmp_path / "out", "--engine", "ray", "--limit", "1") == 2
    assert "explain: error: this actor cannot build its method" in _one_line(capsys)


@pytest.mark.parametrize("address", ["127.0.0.1:{port}", "ray://127.0.0.1:{port}"])
def test_an_unreachable_cluster_is_one_line_fast_and_writes_nothing(data, tmp_path, address):
    """Issue #20.9: an unreachable --address took 21 s, exited 1 and left OUT/_manifest; ray:// gave a traceback."""
    import socket

    checkpoint, src = data
    with socket.socket() as s:  # a port nobody listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        out = tmp_path / "out"
        args = ["explain", str(src), "--classifier", str(checkpoint), "--out", str(out), "--engine", "ray"]
        done = subprocess.run(
            [sys.executable, "-m", "attr_engine", *args, "--address", address.format(port=port)],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=120,
            env={**os.environ, "RAY_ADDRESS": ""},
        )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "cannot reach the Ray cluster" in lines[0] or "needs the Ray client" in lines[0]
    assert not out.exists()


def test_a_cluster_that_refuses_the_connection_says_why_in_one_line(cluster, data, tmp_path):
    """A process without the cluster's authentication token (Ray turns token authentication on for the clusters it
    starts) is refused: the line names the reason Ray chains, not only Ray's "Failed to connect" to the address."""
    if os.environ.get("RAY_AUTH_MODE") != "token":  # set by ray.init when it starts a cluster with tokens
        pytest.skip("this Ray version starts its local clusters without token authentication")
    checkpoint, src = data
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")} | {"RAY_AUTH_MODE": "disabled"}
    args = ["explain", str(src), "--classifier", str(checkpoint), "--out", str(out), "--engine", "ray"]
    address = ray.get_runtime_context().gcs_address
    done = subprocess.run([sys.executable, "-m", "attr_engine", *args, "--address", address],
                          capture_output=True, text=True, cwd=REPO, timeout=120, env=env)  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert f"cannot connect to the Ray cluster at {address}" in lines[0] and "token" in lines[0], lines[0]
    assert not out.exists()
