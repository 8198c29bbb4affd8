"""AHA's teacher maps on a Ray Data actor pool (attr_engine.ray.compute_teacher_maps_ray, train-aha --teacher-engine
ray) on a local two-CPU Ray cluster of this module's own.

What a bug would break: Ray's parts differing from the single process's, a rerun recomputing a finished part (or
missing a part a failed actor left out), an actor's error arriving as a traceback, the CLI not resuming, a pool
the cluster cannot host starting anyway.

Each test has a deadline: an actor pool that never gets its actors fails its test instead of holding the suite.
"""

from __future__ import annotations

import sys

import pytest
import torch

ray = pytest.importorskip("ray")

from attr_engine.cli import main  # noqa: E402
from tests.eval_helpers import single_thread  # noqa: E402
from tests.ray_helpers import local_ray_cluster, wait_for_free_cpus  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    """One local Ray cluster for the module: 2 CPUs; this module's dataset class travels by value."""
    with local_ray_cluster(sys.modules[__name__]):
        yield


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread, as every Ray actor of one CPU has: the same arithmetic as the actors."""
    with single_thread():
        yield


# Seconds a test of this module may take (each takes about 15 on 2 idle cores): a pool that waits for resources
# forever fails its test instead of holding the whole suite.
DEADLINE_S = 300


@pytest.fixture(autouse=True)
def _deadline():
    """SIGALRM after DEADLINE_S raises in the test (Ray Data's driver waits in Python, between bytecodes)."""
    import signal

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"the Ray teacher test took over {DEADLINE_S} s: the actor pool is waiting for resources")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(DEADLINE_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


class _ColourItems(torch.utils.data.Dataset):
    """The colour images of tests.aha_helpers as (image, label) items; reading item ``bad`` raises (an image an
    actor cannot read). Defined here, so it travels to the actors by value."""

    def __init__(self, n: int, bad: int | None = None) -> None:
        from tests.aha_helpers import colour_images

        self.x, self.y = colour_images(n)
        self.bad = bad

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if i == self.bad:
            raise ValueError(f"cannot read item {i}")
        return self.x[i], int(self.y[i])


def test_teacher_maps_on_ray_equal_one_process_and_a_rerun_computes_only_what_is_missing(cluster, tmp_path):
    """An actor's error (an unreadable item) is one line and leaves the parts finished so far; the rerun computes
    exactly the missing ones, and the parts equal the single process's (tensors and settings)."""
    import tests.aha_helpers as helpers
    from attr_engine.aha import AHA, AHAConfig
    from attr_engine.aha.teacher import TeacherMaps, compute_teacher_maps
    from attr_engine.checkpoint import load_safetensors
    from attr_engine.ray import RemoteWorkerError, compute_teacher_maps_ray

    ray.cloudpickle.register_pickle_by_value(helpers)  # the colour classifier travels by value too
    try:
        aha = AHA(helpers.colour_classifier(), AHAConfig(**{**helpers.FAST, "targets": "pred", "n_fractions": 4}))
        local = compute_teacher_maps(aha, _ColourItems(7), tmp_path / "local", steps=2, chunk=3, progress=False)
        with pytest.raises(RemoteWorkerError, match="cannot read item 4") as caught:
            compute_teacher_maps_ray(aha, _ColourItems(7, bad=4), tmp_path / "ray", steps=2, chunk=3, actors=2)
        assert "\n" not in str(caught.value)
        wait_for_free_cpus()  # the failed pool's actors are gone while its error is still held (by `caught`)
        kept = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "ray").iterdir()}
        assert local[1].name not in kept and set(kept) <= {local[0].name, local[2].name}

        parts = compute_teacher_maps_ray(aha, _ColourItems(7), tmp_path / "ray", steps=2, chunk=3, actors=2)
        assert [path.name for path, _ in parts] == [path.name for path in local]
        computed = {path.name: done for path, done in parts}
        # The failed chunk is computed now; a part there before is kept. A part that was neither may have been
        # written by the failed run's other actor after the error came back (its chunk in flight): either is right.
        assert computed[local[1].name] and not any(computed[name] for name in kept)
        for (path, _), own in zip(parts, local, strict=True):
            assert kept.get(path.name, path.stat().st_mtime_ns) == path.stat().st_mtime_ns  # finished: untouched
            (ours, meta), (theirs, own_meta) = load_safetensors(path), load_safetensors(own)
            assert meta == own_meta and ours.keys() == theirs.keys()
            assert all(torch.equal(ours[k], theirs[k]) for k in ours)
        assert TeacherMaps.load(tmp_path / "ray", 7).settings == TeacherMaps.load(tmp_path / "local", 7).settings
    finally:
        ray.cloudpickle.unregister_pickle_by_value(helpers)


def test_train_aha_computes_its_teacher_on_ray_then_resumes_without_recomputing(cluster, tmp_path, capsys):
    from attr_engine.aha.teacher import TEACHER_PART, TeacherMaps
    from tests.eval_helpers import untrained_resnet_checkpoint

    teacher, out = tmp_path / "teacher", tmp_path / "aha"
    base = ["train-aha", "--classifier", str(untrained_resnet_checkpoint(tmp_path)), "--out", str(out),
            "--num-images", "10", "--img-size", "32", "--batch-size", "4", "--no-progress", "--aha-option",
            "n_fractions=4", "--teacher", str(teacher), "--teacher-steps", "1", "--teacher-engine", "ray"]  # fmt: skip
    assert main([*base, "--max-steps", "1"]) == 0
    printed = capsys.readouterr().out
    assert "teacher: 1 of 1 parts computed on 1 Ray actor(s)" in printed, printed
    assert f"teacher: the optimum of 10 training images in {teacher}" in printed
    part = teacher / TEACHER_PART.format(start=0, stop=10)
    stamp = part.stat().st_mtime_ns
    assert TeacherMaps.load(teacher, 10).maps.shape == (10, 32, 32)
    assert main([*base, "--max-steps", "2", "--resume"]) == 0
    assert "teacher: 0 of 1 parts computed" in capsys.readouterr().out
    assert part.stat().st_mtime_ns == stamp
    assert main([*base, "--overwrite", "--teacher-actors", "3"]) == 2  # a local cluster of 2 CPUs
    assert "do not fit the Ray cluster" in capsys.readouterr().err
