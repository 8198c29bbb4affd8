"""Folder jobs from Python (``attr_engine.jobs.explain``) and the cases of issues #33 / #34 the job layer owns:
the README's example, a kill and resume from Python, jobs of the same settings sharing one directory, a job whose
every input is unreadable, two inputs with one name, and the options ``explain.json`` records."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from attr_engine import jobs
from attr_engine.cli import main
from tests.eval_helpers import single_thread, untrained_resnet_checkpoint

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return untrained_resnet_checkpoint(tmp_path_factory.mktemp("clf"))


def _images(root: Path, names: list[str]) -> list[str]:
    rng = np.random.default_rng(0)
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray((rng.random((36, 40, 3)) * 255).astype(np.uint8)).save(root / name)
    return names


def _journal_lines(out: Path) -> list[dict]:
    return [json.loads(line) for p in (out / "_manifest").glob("*.jsonl") for line in p.read_text().splitlines()]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def test_the_readme_jobs_example_runs_as_written(checkpoint, tmp_path, monkeypatch, capsys):
    """The README's Python folder job, run with a tiny classifier under the names it uses; a rerun does nothing."""
    readme = (REPO / "README.md").read_text()
    block = re.search(r"<!-- jobs-example -->\n```python\n(.*?)```", readme, re.S)
    assert block is not None, "README.md lost its jobs example (marked <!-- jobs-example -->)"
    monkeypatch.chdir(tmp_path)
    shutil.copy(checkpoint, tmp_path / "classifier.safetensors")
    _images(tmp_path / "photos", ["a.png", "b/c.png", "b/d.png"])
    exec(compile(block.group(1), "README.md", "exec"), {})
    assert capsys.readouterr().out.splitlines()[-1] == "3 maps written, 0 already done"
    maps = sorted(p.relative_to("maps").as_posix() for p in Path("maps").rglob("*.npy"))
    assert maps == ["a.npy", "b/c.npy", "b/d.npy"]
    exec(compile(block.group(1), "README.md", "exec"), {})
    assert capsys.readouterr().out.splitlines()[-1] == "0 maps written, 3 already done"


def test_a_python_job_killed_midway_resumes_with_nothing_lost_or_duplicated(checkpoint, tmp_path):
    src, out = tmp_path / "images", tmp_path / "maps"
    names = _images(src, [f"img{i}.png" for i in range(7)])
    job = jobs.AttributionJob(method="gradient", classifier=str(checkpoint), batch_size=2)
    script = textwrap.dedent(f"""
        import os, signal, torch
        from attr_engine import jobs
        torch.set_num_threads(1)

        def progress(result, finished, total):
            if finished == 3:  # killed outright after its third map: no clean-up runs
                os.kill(os.getpid(), signal.SIGKILL)

        job = jobs.AttributionJob(method="gradient", classifier={str(checkpoint)!r}, batch_size=2)
        jobs.explain(job, {str(src)!r}, {str(out)!r}, progress=progress)
    """)
    killed = subprocess.run([sys.executable, "-c", script], env=_env(), capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr
    assert len(list(out.glob("*.npy"))) == 3
    summary = jobs.explain(job, src, out)
    assert len(summary.already) == 3 and len(summary.written) == 4 and summary.left == 0
    outputs = [line["output"] for line in _journal_lines(out)]
    assert sorted(outputs) == sorted(f"{Path(n).stem}.npy" for n in names)  # one line per map, none twice
    for name in names:
        assert np.load(out / f"{Path(name).stem}.npy").shape == (32, 32)  # the job's default frame: the model's


_SLOW_EXPLAIN = """
import glob, sys, time
import attr_engine.cli, attr_engine.jobs, torch, timm  # imported before waiting: the wait is for the other job only
outputs = getattr(attr_engine.jobs, "outputs", attr_engine.jobs)
real = outputs._write_map

def slow(*args):  # a slow method, so that the two jobs overlap for certain
    time.sleep(0.4)
    real(*args)

outputs._write_map = slow
journal = sys.argv[1]
while journal != "-" and not any(open(p).read().strip() for p in glob.glob(journal)):
    time.sleep(0.02)
sys.exit(attr_engine.cli.main(sys.argv[2:]))
"""


def test_two_jobs_with_the_same_settings_write_each_map_once(checkpoint, tmp_path):
    """Issue #34 item 8: two explain runs into one --out each wrote all maps (a journal line per map each)."""
    src, out = tmp_path / "images", tmp_path / "maps"
    names = _images(src, [f"img{i:02d}.png" for i in range(12)])
    args = ["--threads", "1", "explain", str(src), "--classifier", str(checkpoint), "--out", str(out),
            "--method", "gradient", "--batch-size", "2", "--no-progress"]  # fmt: skip
    first = subprocess.Popen([sys.executable, "-c", _SLOW_EXPLAIN, "-", *args], env=_env(), stdout=subprocess.PIPE)
    # The second starts once the first has written a map, with most of its work still to do.
    journal = str(out / "_manifest" / "*.jsonl")
    second = subprocess.Popen([sys.executable, "-c", _SLOW_EXPLAIN, journal, *args], env=_env(), stdout=subprocess.PIPE)
    lines = [p.communicate(timeout=300)[0].decode() for p in (first, second)]
    assert first.returncode == 0 and second.returncode == 0, lines
    outputs = [line["output"] for line in _journal_lines(out)]
    assert sorted(outputs) == sorted(f"{Path(n).stem}.npy" for n in names), "a map was written twice (or not at all)"
    written = [int(text.split()[0]) for text in lines]
    assert sum(written) == len(names) and min(written) >= 1, lines  # the work was shared, none done twice
    assert all(np.load(out / f"{Path(n).stem}.npy").shape == (36, 40) for n in names)


def test_a_lone_unreadable_input_is_an_error_not_success(checkpoint, tmp_path, capsys):
    """Issue #34 item 5: ``explain zero.png`` (a link to /dev/zero) exited 0 with "0 map(s) written (1 unreadable)"."""
    if not Path("/dev/zero").exists():
        pytest.skip("no /dev/zero on this system")
    (tmp_path / "zero.png").symlink_to("/dev/zero")
    out = tmp_path / "maps"
    args = ["explain", str(tmp_path / "zero.png"), "--classifier", str(checkpoint), "--out", str(out), "--no-progress"]
    assert main([*args, "--method", "gradient"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "zero.png" in err[0] and "error:" in err[0], err
    assert not (out / "explain.json").exists()


def test_a_folder_of_unreadable_inputs_says_why_and_fails(checkpoint, tmp_path, capsys):
    src = tmp_path / "images"
    src.mkdir()
    for k in range(5):
        (src / f"bad{k}.png").write_bytes(b"not a picture" * k)
    args = ["explain", str(src), "--classifier", str(checkpoint), "--out", str(tmp_path / "maps"), "--no-progress"]
    assert main([*args, "--method", "gradient"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 6, err  # one warning per input as it is met, then the one error line
    assert "no map written: all 5 inputs are unreadable: bad0.png: " in err[-1] and err[-1].endswith("and 2 more")
    with pytest.raises(jobs.NoMapWrittenError, match="all 5 inputs are unreadable"):
        jobs.explain(jobs.AttributionJob(method="gradient", classifier=str(checkpoint)), src, tmp_path / "py")


def test_two_inputs_with_one_name_are_announced_once(checkpoint, tmp_path, capsys):
    """Issue #33 item 8: chelsea.jpg and chelsea.png became chelsea.jpg.npy and chelsea.png.npy without a word."""
    src, out = tmp_path / "images", tmp_path / "maps"
    _images(src, ["chelsea.jpg", "chelsea.png", "other.png"])
    args = ["explain", str(src), "--classifier", str(checkpoint), "--out", str(out), "--no-progress"]
    assert main([*args, "--method", "gradient"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "chelsea.jpg, chelsea.png" in err[0] and "keep the image's suffix" in err[0], err
    assert sorted(p.name for p in out.glob("*.npy")) == ["chelsea.jpg.npy", "chelsea.png.npy", "other.npy"]


def test_explain_json_records_the_options_the_method_used(checkpoint, tmp_path):
    """Issue #33 item 5: explain.json recorded ``options: {}`` instead of the values used (IG's n_steps: 32)."""
    src = tmp_path / "images"
    _images(src, ["a.png"])
    args = ["explain", str(src), "--classifier", str(checkpoint), "--no-progress", "--method", "ig"]
    assert main([*args, "--out", str(tmp_path / "default")]) == 0
    options = json.loads((tmp_path / "default" / "explain.json").read_text())["options"]
    assert options["n_steps"] == 32 and options["method"] == "gausslegendre", options
    assert main([*args, "--out", str(tmp_path / "given"), "--option", "n_steps=4"]) == 0
    assert json.loads((tmp_path / "given" / "explain.json").read_text())["options"] == {**options, "n_steps": 4}
    # The same settings spelled differently (a default given explicitly) are the same settings: resumed, not refused.
    assert main([*args, "--out", str(tmp_path / "default"), "--option", "n_steps=32"]) == 0


def test_explain_takes_an_engine_object_and_reports_progress(checkpoint, tmp_path):
    """Any engine with the local engine's call shape runs under explain(); progress starts with (None, 0, total)."""
    src = tmp_path / "images"
    _images(src, ["a.png", "b.png", "c.png"])
    calls: list[tuple[str | None, int, int]] = []
    seen: list[int] = []

    def engine(job, items, **kwargs):
        seen.append(len(items))
        return jobs.run(job, items, **kwargs)

    job = jobs.AttributionJob(method="saliency", classifier=str(checkpoint))
    summary = jobs.explain(
        job, src, tmp_path / "maps", engine=engine, limit=2,
        progress=lambda r, done, total: calls.append((r and r.item.name, done, total)),
    )  # fmt: skip
    assert seen == [3] and len(summary.written) == 2 and summary.left == 1
    assert calls == [(None, 0, 2), ("a.png", 1, 2), ("b.png", 2, 2)]
    with pytest.raises(ValueError, match="engine must be 'local' or an engine object"):
        jobs.explain(job, src, tmp_path / "maps", engine="ray")
    start = time.perf_counter()
    assert len(jobs.explain(job, src, tmp_path / "maps").already) == 2
    assert time.perf_counter() - start < 60


def test_a_job_names_a_folder_or_an_explainer_given_where_a_file_goes(checkpoint, tmp_path):
    """A job is checked where it is defined: the classifier checkpoint's folder, an AHA checkpoint in its place or
    its weights file given for the AHA directory each get one line saying what to pass; the CLI's bounds hold."""
    folder = re.escape(str(checkpoint.parent))
    with pytest.raises(ValueError, match=rf"{folder} is a directory: pass the classifier checkpoint in it"):
        jobs.AttributionJob(method="gradient", classifier=str(checkpoint.parent))
    with pytest.raises(ValueError, match=r"is a classifier checkpoint, not an AHA one"):
        jobs.AttributionJob(method="aha", classifier=str(checkpoint), aha=str(checkpoint))
    with pytest.raises(ValueError, match=r"num_classes must be between 1 and 100,000, got 10,000,000"):
        jobs.AttributionJob(method="gradient", model="resnet18", num_classes=10**7)
    with pytest.raises(ValueError, match=r"img_size must be between 1 and 4096 px"):
        jobs.AttributionJob(method="gradient", classifier=str(checkpoint), img_size=100_000)


def test_defining_a_job_imports_no_torch():
    """What the package says of itself: a job is plain values, checked without torch."""
    code = (
        "import sys\n"
        "from attr_engine import jobs\n"
        "jobs.AttributionJob(method='gradient', model='resnet18')\n"
        "print(sorted(m for m in ('torch', 'timm', 'kernels') if m in sys.modules))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
