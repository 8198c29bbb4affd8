"""The attr-engine command line end to end, on tiny settings: demo, explain (corrupt files, resume, sharding),
training commands, config files and the one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from attr_engine import jobs
from attr_engine.aha.persistence import checkpoint_dir
from attr_engine.checkpoint import load_safetensors, save_safetensors
from attr_engine.cli import explain as explain_cli
from attr_engine.cli import main
from attr_engine.distributed import process_rank, shard
from attr_engine.visualize import figure_layout
from tests.eval_helpers import single_thread, untrained_resnet_checkpoint

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread: on a shared 2-core machine two threads spin on each other's barriers (10x slower)."""
    with single_thread():
        yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An untrained small ResNet at 32 px with 6 classes, saved as train-classifier would."""
    return untrained_resnet_checkpoint(tmp_path_factory.mktemp("clf"))


def _images(root: Path, names: list[str], size: tuple[int, int] = (40, 36)) -> list[str]:
    rng = np.random.default_rng(0)
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray((rng.random((*size, 3)) * 255).astype(np.uint8)).save(root / name)
    return names


def _manifests(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((out / "_manifest").glob("*.json"))]


def _explain(checkpoint: Path, src: Path, out: Path, *extra: str) -> int:
    args = ["explain", str(src), "--classifier", str(checkpoint), "--out", str(out), "--no-progress"]
    return main([*args, "--method", "gradient", "--batch-size", "2", *extra])


# ---------------------------------------------------------------------------------------------------------------


def test_demo_quick_writes_the_report_and_is_reproducible(tmp_path, capsys):
    tiny = [
        "--quick",
        "--num-train",
        "16",
        "--aha-batch",
        "2",
        "--epochs",
        "1",
        "--aha-steps",
        "2",
        "--num-eval",
        "4",
        "--num-show",
        "2",
    ]
    tiny += ["--img-size", "32", "--no-progress", "--methods", "pullback-soft,grad-cam"]
    results = []
    for run in ("a", "b"):
        out = tmp_path / run
        assert main(["demo", "--out", str(out), "--seed", "3", *tiny]) == 0
        for name in ("report.md", "overlays.png", "curves.png", "leaderboard.csv", "results.json"):
            assert (out / name).is_file() and (out / name).stat().st_size > 0, name
        assert (out / "checkpoints" / "classifier.safetensors").is_file()
        assert (checkpoint_dir(out / "checkpoints" / "aha") / "explainer.safetensors").is_file()
        results.append(json.loads((out / "results.json").read_text()))
    report = (tmp_path / "a" / "report.md").read_text()
    for method in ("AHA", "AHA (T=1)", "Soft pullback", "Grad-CAM"):
        assert f"| {method} |" in report
    summary = capsys.readouterr().out
    assert "attr-engine demo finished" in summary and "Grad-CAM" in summary
    rows = [[{k: v for k, v in row.items() if k != "ms/image"} for row in r["leaderboard"]] for r in results]
    assert [row["method"] for row in rows[0]] == ["AHA", "AHA (T=1)", "Soft pullback", "Grad-CAM"]
    assert all(0.0 <= row["deletion"] <= 1.0 for row in rows[0])
    # Same seed, same machine: the same scores and the same classifier weights.
    assert rows[0] == rows[1]
    weights = [load_safetensors(tmp_path / r / "checkpoints" / "classifier.safetensors")[0] for r in "ab"]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_explain_folder_with_a_corrupt_file_writes_the_others(checkpoint, tmp_path, capsys):
    src, out = tmp_path / "images", tmp_path / "maps"
    good = _images(src, ["cat/a.png", "cat/b.jpg", "dog/c.png", "dog/d.png"])
    (src / "dog" / "broken.jpg").write_bytes(b"definitely not a jpeg")
    assert _explain(checkpoint, src, out, "--png") == 0
    err = capsys.readouterr().err
    assert "broken.jpg" in err and "Traceback" not in err
    for name in good:
        amap = np.load(out / Path(name).with_suffix(".npy"))
        # In the image's frame (40 x 36): the rows the 32 px centre crop cut away are NaN, the rest is finite.
        assert amap.shape == (40, 36) and amap.dtype == np.float32
        assert np.isnan(amap[0]).all() and np.isfinite(amap[2:38]).all()
        # The picture: the 36 px short side drawn at 256 px, with its colour bar and caption around it.
        geo = figure_layout(40, 36)
        assert geo.panels[0][2:] == (256, 284)
        assert Image.open(out / Path(name).with_suffix(".overlay.png")).size == (geo.width, geo.height)
    assert not (out / "dog" / "broken.npy").exists()
    (manifest,) = _manifests(out)
    assert sorted(w["input"] for w in manifest["written"]) == sorted(good)
    assert [u["input"] for u in manifest["unreadable"]] == ["dog/broken.jpg"]


def test_explain_single_file_to_safetensors(checkpoint, tmp_path):
    _images(tmp_path, ["one.png"])
    out = tmp_path / "maps"
    assert _explain(checkpoint, tmp_path / "one.png", out, "--format", "safetensors", "--target", "4") == 0
    tensors, meta = load_safetensors(out / "one.safetensors")
    assert tensors["map"].shape == (40, 36)
    assert meta["target"] == "4" and meta["method"] == "gradient" and meta["input"] == "one.png"


def test_interrupted_explain_resumes_without_redoing_work(checkpoint, tmp_path, monkeypatch, capsys):
    src, out = tmp_path / "images", tmp_path / "maps"
    names = _images(src, [f"img{i}.png" for i in range(7)])
    # A chunked run: --limit stops after 2 maps.
    assert _explain(checkpoint, src, out, "--limit", "2") == 0
    first = {p.name: p.stat().st_mtime_ns for p in out.glob("*.npy")}
    assert len(first) == 2

    # Ctrl-C in the middle of the third write of the next run: what was written stays, nothing half-written appears.
    real_write, calls = jobs.outputs._write_map, []

    def interrupted(amap, path, fmt, meta):
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt
        real_write(amap, path, fmt, meta)

    monkeypatch.setattr(jobs.outputs, "_write_map", interrupted)
    assert _explain(checkpoint, src, out) == 130
    assert "interrupted" in capsys.readouterr().err
    assert len(list(out.glob("*.npy"))) == 4
    (out / ".img6.npy.abc123.tmp").write_bytes(b"torn")  # what a killed writer can leave behind: ignored

    monkeypatch.setattr(jobs.outputs, "_write_map", real_write)
    assert _explain(checkpoint, src, out) == 0
    maps = {p.name: p.stat().st_mtime_ns for p in out.glob("*.npy")}
    assert sorted(maps) == sorted(Path(n).with_suffix(".npy").name for n in names)
    assert all(maps[name] == t for name, t in first.items())  # the first two were not redone
    (manifest,) = _manifests(out)
    assert len(manifest["already_done"]) == 4 and len(manifest["written"]) == 3

    # Other settings into the same directory are refused instead of mixing maps.
    assert main(["explain", str(src), "--classifier", str(checkpoint), "--out", str(out), "--method", "saliency"]) == 2
    assert "other settings" in capsys.readouterr().err


def test_two_process_sharded_explain_covers_every_input_once(checkpoint, tmp_path):
    src, out = tmp_path / "images", tmp_path / "maps"
    names = _images(src, [f"{c}/{i}.png" for c in ("a", "b", "c") for i in range(3)])
    command = [sys.executable, "-m", "attr_engine", "explain", str(src), "--classifier", str(checkpoint)]
    command += ["--out", str(out), "--method", "gradient", "--no-progress", "--batch-size", "2"]
    procs = [
        subprocess.Popen(
            command,
            env={**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"},
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    for proc in procs:
        _, stderr = proc.communicate(timeout=240)
        assert proc.returncode == 0, stderr
    manifests = _manifests(out)
    assert [(m["rank"], m["world_size"]) for m in manifests] == [(0, 2), (1, 2)]
    written = [w["input"] for m in manifests for w in m["written"]]
    assert sorted(written) == sorted(names)  # every input once: none missing, none twice
    assert abs(len(manifests[0]["written"]) - len(manifests[1]["written"])) <= 1
    assert all((out / Path(n).with_suffix(".npy")).is_file() for n in names)


def test_shard_and_process_rank(monkeypatch):
    for n in (0, 1, 5, 8):
        for world in (1, 2, 3):
            shares = [shard(list(range(n)), r, world) for r in range(world)]
            assert sorted(i for share in shares for i in share) == list(range(n))
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert process_rank() == (0, 1)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="RANK"):
        process_rank()
    with pytest.raises(ValueError, match="rank"):
        shard([1, 2], 3, 2)


def test_train_explain_evaluate_pipeline_with_resume_and_config(tmp_path, capsys):
    clf_dir, aha_dir = tmp_path / "clf", tmp_path / "aha"
    common = ["--num-images", "16", "--img-size", "32"]
    assert main(["train-classifier", "--out", str(clf_dir), "--epochs", "1", "--batch-size", "8", *common]) == 0
    train_log = json.loads((clf_dir / "train.json").read_text())
    assert train_log["model"] == "resnet10t" and len(train_log["log"]) == 1 and 0 <= train_log["eval_accuracy"] <= 1
    assert main(["train-classifier", "--out", str(clf_dir), *common]) == 2  # refuses to overwrite silently

    clf = str(clf_dir / "classifier.safetensors")
    config = tmp_path / "aha.yaml"
    config.write_text("batch-size: 4\nmax_steps: 1\naha:\n  n_fractions: 4\n  n_iters: 5\n  targets: pred\n")
    base = ["train-aha", "--classifier", clf, "--out", str(aha_dir), "--config", str(config), "--no-progress", *common]
    assert main(base) == 0
    meta = json.loads((aha_dir / "config.json").read_text())
    assert meta["steps_trained"] == 1 and meta["config"]["n_fractions"] == 4 and meta["config"]["n_iters"] == 5
    # Flags override the file; --resume continues from step 1.
    assert main([*base, "--resume", "--max-steps", "2"]) == 0
    assert json.loads((aha_dir / "config.json").read_text())["steps_trained"] == 2
    assert "1 step(s) this run, 2 in total" in capsys.readouterr().out
    config.write_text("batch_sise: 4\n")
    assert main(base) == 2
    assert "unknown config key 'batch_sise' (did you mean batch_size?)" in capsys.readouterr().err

    names = _images(tmp_path / "photos", ["p.png", "q.png", "r.png"])
    out = tmp_path / "maps"
    explain = ["explain", str(tmp_path / "photos"), "--classifier", clf, "--aha", str(aha_dir), "--out", str(out)]
    assert main([*explain, "--refine-steps", "1", "--no-progress"]) == 0
    assert json.loads((out / "explain.json").read_text())["method"] == "aha"
    assert all(np.load(out / Path(n).with_suffix(".npy")).shape == (40, 36) for n in names)

    ev = tmp_path / "eval"
    evaluate = ["evaluate", "--classifier", clf, "--aha", str(aha_dir), "--methods", "aha,grad-cam", "--out", str(ev)]
    assert main([*evaluate, "--num-images", "3", "--refine-steps", "1", "--no-progress"]) == 0
    rows = json.loads((ev / "results.json").read_text())["leaderboard"]
    assert [r["method"] for r in rows] == ["aha", "aha (T=1)", "grad-cam"]
    assert {"deletion", "insertion", "pointing_game"} <= set(rows[0])
    assert "| aha (T=1) |" in (ev / "report.md").read_text() and (ev / "overlays.png").is_file()


def test_bench_engine_table(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["bench", "--skip-kernels", "--quick", "--batch-size", "2", "--img-size", "32", "--out", str(out)]
    assert main(args) == 0
    table = capsys.readouterr().out
    rows = json.loads(out.read_text())["engine"]
    assert [r["step"] for r in rows][:3] == [
        "classifier forward",
        "classifier forward + input gradient",
        "AHA training step (8 fractions)",
    ]
    assert all(r["ms/call"] > 0 and r["step"] in table for r in rows)


@pytest.mark.parametrize(
    ("args", "message", "status"),
    [
        ("{src} --classifier {ckpt} --method gradeint", "unknown method 'gradeint' (did you mean gradient?)", 2),
        ("{src} --classifier {ckpt} --method aha", "--method aha needs --aha DIR", 2),
        ("{src} --classifier {ckpt} --method aha --aha {tmp}", "no AHA checkpoint in", 2),
        ("{src} --classifier {tmp}/missing.safetensors", "classifier checkpoint not found", 2),
        ("{src} --model resnet5O", "unknown timm model 'resnet5O'", 2),
        ("{src} --classifier {ckpt} --out {tmp}/file.txt", "is not a directory", 2),
        ("{tmp}/empty --classifier {ckpt}", "no images with extensions", 2),
        ("{src} --classifier {ckpt} --method rise --option n_masks=0", "n_masks must be", 2),
        ("{src} --classifier {ckpt} --method rise --option p=2", "p must be in (0, 1)", 2),
        ("{src} --classifier {ckpt} --method occlusion --option window=-3", "window must be", 2),
        # Hardening #10: option types and Captum's argument checks, before any work (a list is a tuple here)
        ("{src} --classifier {ckpt} --method saliency --option abs=maybe", "'abs' must be true or false", 2),
        ("{src} --classifier {ckpt} --method captum:Saliency --option abs=maybe", "'abs' must be true or false", 2),
        ("{src} --classifier {ckpt} --method captum:IntegratedGradients --option n_steps=-3", "n_steps=-3", 2),
        (
            "{src} --classifier {ckpt} --method captum:Occlusion --option sliding_window_shapes=(3,8,8)",
            "'sliding_window_shapes' must be a list of integers",
            2,
        ),
        (
            "{src} --classifier {ckpt} --method captum:Occlusion --option sliding_window_shapes=[3,64,64]",
            "cannot exceed input dimensions",
            2,
        ),
        ("{src} --classifier {ckpt} --target 99999", "--target 99999 is not a class", 2),
        ("{tmp}/bad.png --classifier {ckpt}", "cannot read image", 2),
        ("{tmp}/nothing --classifier {ckpt}", "input not found", 2),
        ("{src} --classifier {ckpt} --out {src}/maps", "lies inside the input folder", 2),
        ("{src} --classifier {ckpt} --target class3", "--target must be pred, label or a class index", 2),
        ("{src} --classifier {ckpt} --target label", "--target label needs an ImageFolder tree", 2),
        ("{src} --classifier {ckpt} --device cuda:7", "cuda", 2),
        ("{src} --classifier {ckpt} --batch-size 0", "--batch-size must be >= 1", 2),
        ("{src} --classifier {ckpt} --format png", "invalid choice: 'png'", 2),
    ],
)
def test_user_mistakes_are_one_line_without_traceback(checkpoint, tmp_path, capsys, args, message, status):
    _images(tmp_path / "flat", ["x.png"])
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.png").write_bytes(b"\x89PNG broken")
    (tmp_path / "file.txt").write_text("a file where a directory should be")
    command = ["explain", "--out", str(tmp_path / "out"), "--no-progress"]
    command += args.format(src=tmp_path / "flat", ckpt=checkpoint, tmp=tmp_path).split()
    if status == 2 and "--format" in command:
        with pytest.raises(SystemExit) as exit_info:  # argparse's own errors exit from parse_args
            main(command)
        assert exit_info.value.code == status
    else:
        assert main(command) == status
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and err[0].startswith("attr-engine explain: error:"), err


def test_a_captum_window_given_as_a_list_runs(checkpoint, tmp_path, capsys):
    """Hardening #10: ``--option sliding_window_shapes=[3,8,8]`` (YAML has no tuples) is Captum's tuple."""
    _images(tmp_path / "flat", ["x.png"])
    window = ["--option", "sliding_window_shapes=[3,8,8]", "--option", "strides=[3,8,8]"]
    assert main(["explain", str(tmp_path / "flat"), "--classifier", str(checkpoint), "--out", str(tmp_path / "o"),
                 "--no-progress", "--method", "captum:Occlusion", *window]) == 0  # fmt: skip
    assert np.load(tmp_path / "o" / "x.npy").shape == (40, 36)  # the image's (h, w)


def test_explain_lists_each_image_once_under_a_link_to_its_folder(tmp_path):
    """Hardening #12: ``in/loop -> .`` made ``loop`` a class folder holding every image again (two maps each)."""
    src = tmp_path / "in"
    _images(src, ["a.png", "b.png"])
    (src / "loop").symlink_to(".", target_is_directory=True)
    items = jobs.list_inputs(src, "npy")
    assert [(item.name, item.label) for item in items] == [("a.png", -1), ("b.png", -1)]


# ---------------------------------------------------------------------------------------------------------------
# Reliability (issue #10): no mixed outputs, settings recorded only with a map, torn files redone, one exit rule
# ---------------------------------------------------------------------------------------------------------------


def _summary(capsys) -> str:
    return capsys.readouterr().out.strip().splitlines()[-1]


def test_interrupted_overwrite_with_another_method_never_mixes_maps(checkpoint, tmp_path, monkeypatch, capsys):
    """Issue #10.3: the rerun used to report every map done while most were still the old method's."""
    src, out, clean = tmp_path / "images", tmp_path / "maps", tmp_path / "clean"
    names = _images(src, [f"img{i}.png" for i in range(6)])
    assert _explain(checkpoint, src, out) == 0  # gradient maps
    real_write, calls = jobs.outputs._write_map, []

    def interrupted(amap, path, fmt, meta):
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt
        real_write(amap, path, fmt, meta)

    monkeypatch.setattr(jobs.outputs, "_write_map", interrupted)
    assert _explain(checkpoint, src, out, "--overwrite", "--method", "saliency") == 130
    monkeypatch.setattr(jobs.outputs, "_write_map", real_write)
    capsys.readouterr()
    assert _explain(checkpoint, src, out, "--method", "saliency") == 0
    summary = _summary(capsys)
    assert "4 saliency map(s) written" in summary and "2 already done" in summary, summary
    assert _explain(checkpoint, src, clean, "--method", "saliency") == 0
    for name in names:
        npy = Path(name).with_suffix(".npy")
        np.testing.assert_array_equal(np.load(out / npy), np.load(clean / npy), err_msg=name)
    assert json.loads((out / "explain.json").read_text())["method"] == "saliency"


@pytest.mark.parametrize("target", ["-1", "99999", "6"])
def test_a_class_the_classifier_lacks_is_refused_up_front_and_leaves_no_settings(checkpoint, tmp_path, target, capsys):
    """Issue #10.14: --target -1 / 99999 used to fail at the first batch (rc 1) and leave a blocking explain.json."""
    src, out = tmp_path / "images", tmp_path / "maps"
    _images(src, ["a.png", "b.png"])
    assert _explain(checkpoint, src, out, "--target", target) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--target {target} is not a class of this classifier (0 to 5)" in err[0]
    assert not (out / "explain.json").exists()
    assert _explain(checkpoint, src, out, "--target", "5") == 0  # the corrected rerun is not blocked
    assert json.loads((out / "explain.json").read_text())["target"] == "5"


def test_a_run_that_fails_before_its_first_map_records_no_settings(checkpoint, tmp_path, monkeypatch, capsys):
    src, out = tmp_path / "images", tmp_path / "maps"
    _images(src, ["a.png", "b.png"])

    def broken(x, target=None):
        raise ValueError("the explainer broke")

    from attr_engine.jobs import AttributionJob

    real_build = AttributionJob.get_explainer

    def build(*args, **kwargs):
        explainer = real_build(*args, **kwargs)
        explainer.attribute = broken
        return explainer

    monkeypatch.setattr(AttributionJob, "get_explainer", build)
    assert _explain(checkpoint, src, out) == 2  # the user's to fix, after the work started too (issue #34.1)
    assert "the explainer broke" in capsys.readouterr().err
    assert not (out / "explain.json").exists()
    monkeypatch.undo()
    assert _explain(checkpoint, src, out, "--method", "saliency") == 0  # another method is not refused


def test_stale_temporaries_are_removed_and_damaged_maps_redone(checkpoint, tmp_path, capsys):
    """Issue #10.15: .tmp files of a killed run stayed for ever and zero-byte or truncated maps counted as done."""
    src, out = tmp_path / "images", tmp_path / "maps"
    _images(src, [f"d/img{i}.png" for i in range(5)])
    assert _explain(checkpoint, src, out, "--png") == 0
    good = (out / "d" / "img0.npy").read_bytes()
    (out / "d" / "img1.npy").write_bytes(b"")  # zero bytes
    (out / "d" / "img2.npy").write_bytes(good[: len(good) // 2])  # truncated
    overlay = (out / "d" / "img3.overlay.png").read_bytes()
    (out / "d" / "img3.overlay.png").write_bytes(overlay[: len(overlay) - 40])  # truncated overlay
    stale = [out / "d" / ".img4.npy.0a1b2c3d.tmp", out / "d" / ".img4.overlay.png.deadbeef.tmp"]
    for path in stale:
        path.write_bytes(b"torn")
    (out / "d" / "notes.tmp").write_text("the user's own file")
    capsys.readouterr()
    assert _explain(checkpoint, src, out, "--png") == 0
    summary = _summary(capsys)
    assert "3 gradient map(s) written" in summary and "2 already done" in summary, summary
    assert not any(p.exists() for p in stale) and (out / "d" / "notes.tmp").is_file()
    for i in range(5):
        assert np.load(out / "d" / f"img{i}.npy").shape == (40, 36)
        Image.open(out / "d" / f"img{i}.overlay.png").verify()


def test_smoothgrad_maps_do_not_depend_on_the_batch_size(checkpoint, tmp_path):
    """Issue #10.6: through explain, a SmoothGrad map changed with --batch-size (and so with a resumed run)."""
    src = tmp_path / "images"
    names = _images(src, [f"img{i}.png" for i in range(8)])
    maps = {}
    for size in ("1", "8"):
        out = tmp_path / f"b{size}"
        args = ["explain", str(src), "--classifier", str(checkpoint), "--out", str(out), "--no-progress"]
        assert main([*args, "--method", "smoothgrad", "--option", "n_samples=3", "--batch-size", size]) == 0
        maps[size] = np.stack([np.load(out / Path(n).with_suffix(".npy")) for n in names])
    np.testing.assert_allclose(maps["1"], maps["8"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("command", "status"),
    [
        (["train-aha", "--classifier", "{ckpt}", "--num-images", "4", "--batch-size", "8", "--img-size", "32"], 2),
        (["train-aha", "--classifier", "{ckpt}", "--aha-option", "n_fractions=1", "--img-size", "32"], 2),
        (["evaluate", "--model", "resnet5O"], 2),
        (["evaluate", "--classifier", "{ckpt}", "--methods", "rise", "--data", "{tmp}/empty"], 2),
        (["train-classifier", "--model", "resnet5O", "--num-images", "4", "--epochs", "1"], 2),
    ],
)
def test_exit_status_rule_bad_settings_are_2_before_any_work(checkpoint, tmp_path, capsys, command, status):
    """Issue #10.17: bad settings found while a command sets up exited 1 where the README promises 2."""
    (tmp_path / "empty").mkdir()
    args = [a.format(ckpt=checkpoint, tmp=tmp_path) for a in command] + ["--out", str(tmp_path / "out")]
    assert main([*args, "--no-progress"]) == status
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error:" in err[0], err


def test_exit_status_rule_a_full_disk_while_running_is_2(checkpoint, tmp_path, monkeypatch, capsys):
    """Issue #34.1: an error the user can fix exits 2 whenever it comes, in one line."""
    src, out = tmp_path / "images", tmp_path / "maps"
    _images(src, ["a.png"])

    def full_disk(amap, path, fmt, meta):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(jobs.outputs, "_write_map", full_disk)
    assert _explain(checkpoint, src, out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "No space left on device" in err[-1] and "Traceback" not in "".join(err)


def test_explain_writes_maps_for_images_next_to_class_folders(checkpoint, tmp_path, capsys):
    """Issue #10.5: "4 maps written", not 6, when a folder had both images and class subfolders."""
    src, out = tmp_path / "images", tmp_path / "maps"
    names = _images(src, ["top1.png", "top2.png", "cat/a.png", "cat/b.png", "dog/c.png", "dog/d.png"])
    assert _explain(checkpoint, src, out) == 0
    assert "6 gradient map(s) written" in _summary(capsys)
    assert all((out / Path(n).with_suffix(".npy")).is_file() for n in names)
    assert _explain(checkpoint, src, tmp_path / "labels", "--target", "label") == 2
    assert "2 image(s) directly in" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model_kwargs": '{"bogus": 1}'}, "cannot build resnet10t"),
        ({"model_kwargs": '{"checkpoint_path": "weights.pth"}'}, "refusing model kwarg 'checkpoint_path'"),
        ({"model_name": "hf-hub:someone/model"}, "not in timm's registry; pass --model to confirm"),
        ({"model_name": "local-dir:/elsewhere"}, "not in timm's registry; pass --model to confirm"),
        ({"model_name": "vit_tiny_patch16_224"}, "cannot build vit_tiny_patch16_224"),
    ],
)
def test_crafted_classifier_checkpoints_are_one_line(checkpoint, tmp_path, capsys, changes, message):
    """Issue #10.13: crafted checkpoint metadata printed a traceback or sent the loader to other files."""
    state, meta = load_safetensors(checkpoint)
    crafted = tmp_path / "crafted.safetensors"
    save_safetensors(state, crafted, {**meta, **changes})
    _images(tmp_path / "images", ["a.png"])
    assert _explain(crafted, tmp_path / "images", tmp_path / "maps") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "Traceback" not in err[0], err


def test_model_frame_keeps_the_crop_and_limit_counts_maps_written(checkpoint, tmp_path, capsys):
    src = tmp_path / "images"
    _images(src, ["a.png", "c.png", "d.png"])
    (src / "b.png").write_bytes(b"not a png")  # sorted between the good ones: it must not use up --limit
    out = tmp_path / "maps"
    assert _explain(checkpoint, src, out, "--model-frame", "--limit", "2", "--png") == 0
    assert np.load(out / "a.npy").shape == (32, 32) and np.load(out / "c.npy").shape == (32, 32)
    assert Image.open(out / "a.overlay.png").size == (figure_layout(32, 32).width, figure_layout(32, 32).height)
    assert not (out / "d.npy").exists()
    summary = capsys.readouterr().out
    assert "2 gradient map(s) written" in summary and "1 unreadable" in summary, summary
    # The image frame is another setting: refused in the same directory, not mixed.
    assert _explain(checkpoint, src, out) == 2
    assert "frame 'model' -> 'image'" in capsys.readouterr().err


def test_random_weights_warn_and_offline_pretrained_fails_in_one_line(tmp_path, monkeypatch, capsys):
    import socket
    import time

    import huggingface_hub.constants

    from attr_engine import model_sources

    src = tmp_path / "p.png"
    _images(tmp_path, ["p.png"])
    common = ["explain", str(src), "--model", "resnet10t", "--img-size", "32", "--no-progress", "--method", "gradient"]
    assert main([*common, "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert "uses random weights" in err and len(err.strip().splitlines()) == 1

    def unreachable(*args, **kwargs):
        raise OSError("no network")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(socket, "create_connection", unreachable)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert model_sources.hub_reachable_or_offline() is False
    assert os.environ["HF_HUB_OFFLINE"] == "1" and huggingface_hub.constants.HF_HUB_OFFLINE is True
    start = time.perf_counter()
    assert main([*common, "--pretrained", "--out", str(tmp_path / "b")]) == 2
    assert time.perf_counter() - start < 20
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "hub is unreachable" in err[0], err


# ---------------------------------------------------------------------------------------------------------------
# Pictures, pictures only, float16 maps
# ---------------------------------------------------------------------------------------------------------------


def test_format_none_writes_pictures_only_and_resumes_on_them(checkpoint, tmp_path, capsys):
    src, out = tmp_path / "images", tmp_path / "maps"
    _images(src, ["a.png", "b.png", "c.png"])
    assert _explain(checkpoint, src, out, "--format", "none", "--png") == 0
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == [
        "a.overlay.png", "b.overlay.png", "c.overlay.png", "explain.json",
    ]  # fmt: skip
    settings = json.loads((out / "explain.json").read_text())
    assert settings["format"] == "none" and "map_dtype" not in settings
    (manifest,) = _manifests(out)
    assert [w["output"] for w in manifest["written"]] == ["a.overlay.png", "b.overlay.png", "c.overlay.png"]
    capsys.readouterr()
    # Done means "the picture is valid": nothing redone; a damaged picture is redone.
    assert _explain(checkpoint, src, out, "--format", "none", "--png") == 0
    assert "3 already done" in capsys.readouterr().out
    data = (out / "b.overlay.png").read_bytes()
    (out / "b.overlay.png").write_bytes(data[: len(data) // 2])
    assert _explain(checkpoint, src, out, "--format", "none", "--png") == 0
    assert "1 gradient map(s) written" in capsys.readouterr().out
    Image.open(out / "b.overlay.png").verify()
    # Nothing to write, or a map dtype without maps: refused before anything is done.
    assert _explain(checkpoint, src, tmp_path / "x", "--format", "none") == 2
    assert _explain(checkpoint, src, tmp_path / "x", "--format", "none", "--png", "--map-dtype", "float16") == 2
    assert _explain(checkpoint, src, tmp_path / "x", "--png", "--png-max-side", "100") == 2
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").rglob("*.png"))


@pytest.mark.parametrize("fmt", ["npy", "safetensors"])
def test_float16_maps_halve_the_bytes_and_count_as_done(checkpoint, tmp_path, capsys, fmt):
    src = tmp_path / "images"
    _images(src, ["a.png", "b.png"])
    full, half = tmp_path / "f32", tmp_path / "f16"
    assert _explain(checkpoint, src, full, "--format", fmt) == 0
    assert _explain(checkpoint, src, half, "--format", fmt, "--map-dtype", "float16") == 0
    assert "map_dtype" not in json.loads((full / "explain.json").read_text())  # the default adds no key
    assert json.loads((half / "explain.json").read_text())["map_dtype"] == "float16"
    if fmt == "npy":
        a32, a16 = np.load(full / "a.npy"), np.load(half / "a.npy")
    else:
        a32, a16 = (
            load_safetensors(full / "a.safetensors")[0]["map"].numpy(),
            load_safetensors(half / "a.safetensors")[0]["map"].numpy(),
        )
    assert a32.dtype == np.float32 and a16.dtype == np.float16 and a16.shape == a32.shape == (40, 36)
    np.testing.assert_array_equal(a16, a32.astype(np.float16))  # NaN border included
    assert (half / f"a.{fmt}").stat().st_size < 0.6 * (full / f"a.{fmt}").stat().st_size
    capsys.readouterr()
    assert _explain(checkpoint, src, half, "--format", fmt, "--map-dtype", "float16") == 0
    assert "2 already done" in capsys.readouterr().out
    # float32 into the float16 directory is another setting: refused, not mixed.
    assert _explain(checkpoint, src, half, "--format", fmt) == 2
    assert "map_dtype" in capsys.readouterr().err


def test_pictures_caption_class_names_only_when_they_are_the_classifiers(checkpoint, tmp_path, monkeypatch):
    import attr_engine.visualize as visualize

    captions: list[str] = []
    draw = visualize.save_map_figure

    def spy(*args, **kwargs):
        captions.append(kwargs["caption"])
        return draw(*args, **kwargs)

    monkeypatch.setattr(visualize, "save_map_figure", spy)
    src = tmp_path / "images"
    _images(src, ["cat/a.png", "dog/b.png"])
    assert _explain(checkpoint, src, tmp_path / "label", "--png", "--target", "label") == 0
    assert [c.rsplit(" · p = ", 1)[0] for c in captions] == ["gradient · cat (class 0)", "gradient · dog (class 1)"]
    probability = float(captions[0].rsplit(" · p = ", 1)[1])
    assert 0 < probability < 1
    captions.clear()
    # The tree's folders say nothing about class 4 of this classifier: the id alone.
    assert _explain(checkpoint, src, tmp_path / "four", "--png", "--target", "4") == 0
    assert [c.rsplit(" · p = ", 1)[0] for c in captions] == ["gradient · class 4"] * 2
    captions.clear()
    # A train-classifier checkpoint's train.json names its classes: used for the predicted class.
    trained = tmp_path / "clf"
    trained.mkdir()
    (trained / "classifier.safetensors").write_bytes(checkpoint.read_bytes())
    names = ["circle", "square", "triangle", "star", "cross", "ring"]
    model_name = load_safetensors(checkpoint)[1]["model_name"]
    (trained / "train.json").write_text(json.dumps({"model": model_name, "classes": names}))
    trained_args = ["explain", str(src), "--classifier", str(trained / "classifier.safetensors"), "--no-progress",
                    "--method", "gradient", "--png"]  # fmt: skip
    assert main([*trained_args, "--out", str(tmp_path / "named")]) == 0
    for caption in captions:
        cls = int(caption.split("(class ")[1].split(")")[0])
        assert caption.startswith(f"gradient · {names[cls]} (class {cls}) · p = "), caption
    captions.clear()
    # A train.json of another model (or another number of classes) is not this classifier's: ids only.
    (trained / "train.json").write_text(json.dumps({"model": "other-net", "classes": names}))
    assert main([*trained_args, "--out", str(tmp_path / "unnamed")]) == 0
    assert all(c.split(" · ")[1].startswith("class ") for c in captions), captions


def test_picture_layout_and_size_flags(checkpoint, tmp_path):
    src = tmp_path / "images"
    _images(src, ["a.png"], size=(300, 1000))
    assert _explain(checkpoint, src, tmp_path / "side", "--png", "--png-layout", "side-by-side") == 0
    geo = figure_layout(300, 1000, layout="side-by-side")
    assert Image.open(tmp_path / "side" / "a.overlay.png").size == (geo.width, geo.height)
    assert _explain(checkpoint, src, tmp_path / "small", "--png", "--png-max-side", "512") == 0
    with Image.open(tmp_path / "small" / "a.overlay.png") as im:
        assert max(im.size) <= 512 and im.size == (figure_layout(300, 1000, max_side=512).width,
                                                   figure_layout(300, 1000, max_side=512).height)  # fmt: skip
    assert np.load(tmp_path / "small" / "a.npy").shape == (300, 1000)  # the map keeps the image's resolution


def test_the_parsers_formats_are_the_job_layers():
    """cli/explain repeats jobs.FORMATS so that `explain --help` needs no torch: the two must not drift."""
    assert explain_cli.FORMATS == jobs.FORMATS
