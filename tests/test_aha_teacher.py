"""AHA's teacher: the per-image optimum computed once in resumable, shardable parts, and the ranking loss that
teaches the decoder (``AHAConfig.teacher_weight`` and ``teacher_loss``, ``fit(..., teacher=)``).

What a bug would break: a part holding another chunk's maps or seed, a resumed computation redoing finished parts, a
sharded computation differing from a single process's, a folder with a rank missing (or parts of other settings)
loading as complete, a loss not being zero on equal rankings or caring about the map's scale, training (with either
loss) not moving the decoder's maps toward the teacher, fit taking a teacher it ignores, a checkpoint losing the
weight or the loss, or a resumed taught run ending elsewhere than an uninterrupted one.
"""

from __future__ import annotations

import json

import pytest
import torch

from attr_engine.aha import AHA, AHAConfig
from attr_engine.aha.teacher import (
    TEACHER_PART,
    TeacherMaps,
    compute_teacher_maps,
    teacher_loss,
    teacher_pixel_loss,
    teacher_ranking_loss,
)
from tests.aha_helpers import FAST, colour_classifier, colour_images

# The AHA tests' smallest config with one target, and a learning rate that moves a decoder in a few steps.
CHEAP = {**FAST, "targets": "pred", "n_fractions": 4, "lr": 3e-3}


class _Items(torch.utils.data.Dataset):
    """(image, label) items; ``fail_after`` reads, a KeyboardInterrupt (a run killed mid-way)."""

    def __init__(self, n: int = 8, fail_after: int | None = None) -> None:
        self.x, self.y = colour_images(n)
        self.left = fail_after
        # A blue square in each image, away from the class's blob at random: the colour classifier ignores it.
        gen = torch.Generator().manual_seed(1)
        for image in self.x:
            top, left = torch.randint(0, 24, (2,), generator=gen).tolist()
            image[2, top : top + 8, left : left + 8] = 0.9

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if self.left is not None:
            if self.left == 0:
                raise KeyboardInterrupt("simulated kill")
            self.left -= 1
        return self.x[i], int(self.y[i])


def _blue_teacher(data: _Items) -> TeacherMaps:
    """A teacher ranking the pixels by their blue value (the blue square first), which the colour classifier
    ignores: the soft-AUC loss alone has no reason to learn that ranking."""
    maps = data.x[:, 2].to(torch.float16)
    with torch.no_grad():
        targets = colour_classifier()(data.x).argmax(dim=1)
    return TeacherMaps(maps, targets, {"steps": "0", "lr": "0", "seed": "0", "chunk": "1"})


# ---------------------------------------------------------------------------------------------------------------
# Computing and loading the parts
# ---------------------------------------------------------------------------------------------------------------


def test_each_part_holds_its_chunks_optimum_and_a_sharded_run_equals_one_process(tmp_path):
    data = _Items(7)
    aha = AHA(colour_classifier(), AHAConfig(**CHEAP))
    paths = compute_teacher_maps(aha, data, tmp_path / "one", steps=2, chunk=3, progress=False)
    assert [p.name for p in paths] == [TEACHER_PART.format(start=a, stop=b) for a, b in ((0, 3), (3, 6), (6, 7))]
    for rank in (1, 0):
        compute_teacher_maps(aha, data, tmp_path / "two", steps=2, chunk=3, rank=rank, world=2, progress=False)
    one, two = TeacherMaps.load(tmp_path / "one", 7), TeacherMaps.load(tmp_path / "two", 7)
    assert torch.equal(one.maps, two.maps) and torch.equal(one.targets, two.targets)
    assert one.maps.shape == (7, 32, 32) and one.maps.dtype == torch.float16
    # The middle part: items 3..5, the predicted classes, grids drawn from seed + 1.
    x = data.x[3:6]
    target = colour_classifier()(x).argmax(dim=1)
    direct = aha.optimise_maps(x, target, steps=2, lr=0.05, seed=aha.config.seed + 1)[2]
    torch.testing.assert_close(one.maps[3:6].float(), direct.to(torch.float16).float(), atol=0, rtol=0)
    assert torch.equal(one.targets[3:6], target)
    assert one.settings == {"steps": "2", "lr": "0.05", "seed": str(aha.config.seed), "chunk": "3"}
    with pytest.raises(ValueError, match="steps"):  # no step: the decoder's own maps, nothing to teach
        compute_teacher_maps(aha, data, tmp_path / "none", steps=0, progress=False)
    assert not (tmp_path / "none").exists()


def test_a_killed_computation_resumes_without_redoing_finished_parts(tmp_path):
    aha = AHA(colour_classifier(), AHAConfig(**CHEAP))
    with pytest.raises(KeyboardInterrupt):  # dies reading the second chunk: the first part is written
        compute_teacher_maps(aha, _Items(6, fail_after=4), tmp_path, steps=1, chunk=3, progress=False)
    assert [p.name for p in tmp_path.iterdir()] == [TEACHER_PART.format(start=0, stop=3)]
    with pytest.raises(ValueError, match="indices from 3 are missing"):
        TeacherMaps.load(tmp_path, 6)
    calls = []
    real = aha.optimise_maps
    aha.optimise_maps = lambda x, *a, **k: calls.append(len(x)) or real(x, *a, **k)  # type: ignore[method-assign]
    compute_teacher_maps(aha, _Items(6), tmp_path, steps=1, chunk=3, progress=False)
    assert calls == [3]  # only the missing chunk
    compute_teacher_maps(aha, _Items(6), tmp_path, steps=2, chunk=3, progress=False)
    assert calls == [3, 3, 3]  # other settings: both parts are redone
    assert TeacherMaps.load(tmp_path, 6).settings["steps"] == "2"


def test_loading_refuses_a_missing_rank_other_settings_and_another_dataset_size(tmp_path):
    aha = AHA(colour_classifier(), AHAConfig(**CHEAP))
    data = _Items(6)
    compute_teacher_maps(aha, data, tmp_path / "half", steps=1, chunk=2, rank=0, world=2, progress=False)
    with pytest.raises(ValueError, match=r"missing.*finish every rank"):
        TeacherMaps.load(tmp_path / "half", 6)
    compute_teacher_maps(aha, data, tmp_path / "half", steps=2, chunk=2, rank=1, world=2, progress=False)
    with pytest.raises(ValueError, match="was made with"):
        TeacherMaps.load(tmp_path / "half", 6)
    compute_teacher_maps(aha, data, tmp_path / "whole", steps=1, chunk=2, progress=False)
    with pytest.raises(ValueError, match=r"cover indices \[0, 6\), the dataset has 4"):
        TeacherMaps.load(tmp_path / "whole", 4)
    with pytest.raises(ValueError, match="no teacher parts"):
        TeacherMaps.load(tmp_path / "empty", 6)


# ---------------------------------------------------------------------------------------------------------------
# The loss
# ---------------------------------------------------------------------------------------------------------------


def test_the_ranking_loss_is_zero_on_equal_rankings_blind_to_scale_and_pulls_toward_the_teacher():
    gen = torch.Generator().manual_seed(0)
    teacher = torch.rand(3, 16, 16, generator=gen)
    same = teacher_ranking_loss(5.0 * teacher - 2.0, teacher, grid=4)
    torch.testing.assert_close(same, torch.zeros(3), atol=1e-5, rtol=0)
    reversed_ = teacher_ranking_loss(-teacher, teacher, grid=4)
    assert (reversed_ > 0.5).all()
    student = torch.rand(3, 16, 16, generator=gen, requires_grad=True)
    before = teacher_ranking_loss(student, teacher, grid=4, offset=(0.3, 0.6))
    before.sum().backward()
    with torch.no_grad():
        after = teacher_ranking_loss(student - 0.5 * student.grad, teacher, grid=4, offset=(0.3, 0.6))
    assert (after < before.detach()).all()
    with pytest.raises(ValueError, match="both be"):
        teacher_ranking_loss(teacher, teacher[:, :8], grid=4)


def test_the_pixel_loss_is_zero_on_equal_maps_blind_to_scale_four_when_reversed_and_pulls_toward_the_teacher():
    gen = torch.Generator().manual_seed(0)
    teacher = torch.rand(3, 16, 16, generator=gen)
    torch.testing.assert_close(teacher_pixel_loss(5.0 * teacher - 2.0, teacher), torch.zeros(3), atol=1e-5, rtol=0)
    torch.testing.assert_close(teacher_pixel_loss(-teacher, teacher), torch.full((3,), 4.0), atol=1e-4, rtol=0)
    # A change finer than every region, which the pooled ranking cannot see and the pixel loss does.
    checker = (torch.arange(16)[:, None] + torch.arange(16)[None]) % 2 * 0.2
    fine = teacher + checker
    assert teacher_pixel_loss(teacher, fine).min() > 0.05
    torch.testing.assert_close(teacher_ranking_loss(teacher, fine, grid=4), torch.zeros(3), atol=1e-5, rtol=0)
    student = torch.rand(3, 16, 16, generator=gen, requires_grad=True)
    before = teacher_loss(student, teacher, "pixel", grid=4)
    before.sum().backward()
    with torch.no_grad():
        after = teacher_pixel_loss(student - 0.5 * student.grad, teacher)
    assert (after < before.detach()).all()
    with pytest.raises(ValueError, match="both be"):
        teacher_pixel_loss(teacher, teacher[:, :8])
    with pytest.raises(ValueError, match=r"teacher's loss must be one of \('ranking', 'pixel'\), got 'mse'"):
        teacher_loss(teacher, teacher, "mse", grid=4)
    with pytest.raises(ValueError, match=r"teacher_loss must be one of \('ranking', 'pixel'\), got 'mse'"):
        AHAConfig(teacher_loss="mse")
    # train-aha spells the choices out (the command line does not import torch to show its help): the same ones.
    from attr_engine.aha.config import TEACHER_LOSSES
    from attr_engine.cli import build_parser

    flags = {a.dest: a for a in build_parser()[1]["train-aha"]._actions}
    assert tuple(flags["teacher_loss"].choices) == TEACHER_LOSSES


# ---------------------------------------------------------------------------------------------------------------
# Training with a teacher
# ---------------------------------------------------------------------------------------------------------------


def _teacher_loss(aha: AHA, data: _Items, teacher: TeacherMaps, kind: str = "ranking") -> float:
    with torch.no_grad():
        maps = aha.attribute(data.x, teacher.targets)
    losses = [teacher_loss(maps, teacher.maps.float(), kind, grid) for grid in (2, 4, 6)]
    return float(torch.stack(losses).mean())


@pytest.mark.parametrize("kind", ["ranking", "pixel"])
def test_the_teacher_phase_lowers_its_loss_against_the_teacher(kind):
    data = _Items(8)
    teacher = _blue_teacher(data)
    taught = AHA(colour_classifier(), AHAConfig(**CHEAP, teacher_weight=1.0, teacher_loss=kind))
    alone = AHA(colour_classifier(), AHAConfig(**CHEAP))
    alone.decoder.load_state_dict(taught.decoder.state_dict())
    start = _teacher_loss(taught, data, teacher, kind)
    history = taught.fit(data, batch_size=4, epochs=20, max_steps=24, progress=False, teacher=teacher)
    alone.fit(data, batch_size=4, epochs=20, max_steps=24, progress=False)
    assert all(v == v for v in history["teacher"])  # recorded every step (not NaN)
    taught_loss, alone_loss = _teacher_loss(taught, data, teacher, kind), _teacher_loss(alone, data, teacher, kind)
    assert taught_loss < 0.7 * start and taught_loss < 0.7 * alone_loss, (start, taught_loss, alone_loss)


@pytest.mark.parametrize("kind", ["ranking", "pixel"])
def test_a_step_records_the_teacher_loss_its_config_names(kind):
    # The first step's recorded loss is that loss of the untrained decoder's maps of the step's images, on its grid
    # and offset; the other loss gives another value, so a trainer that ignored teacher_loss would fail here.
    data = _Items(8)
    teacher = _blue_teacher(data)
    aha = AHA(colour_classifier(), AHAConfig(**CHEAP, teacher_weight=1.0, teacher_loss=kind))
    with torch.no_grad():
        maps = aha.attribute(data.x, teacher.targets)
    history = aha.fit(data, batch_size=4, max_steps=1, progress=False, teacher=teacher)
    step = history.steps[0]
    index = list(step.images)
    other = "pixel" if kind == "ranking" else "ranking"
    losses = {k: teacher_loss(maps[index], teacher.maps[index].float(), k, step.grid, step.offset).mean().item()
              for k in (kind, other)}  # fmt: skip
    assert history["teacher"][0] == pytest.approx(losses[kind], rel=1e-3, abs=1e-5)
    assert abs(losses[kind] - losses[other]) > 0.05, losses


def test_fit_refuses_a_missing_unwanted_or_mismatched_teacher():
    data = _Items(8)
    teacher = _blue_teacher(data)
    taught = AHA(colour_classifier(), AHAConfig(**CHEAP, teacher_weight=1.0))
    with pytest.raises(ValueError, match=r"teacher_weight is 1\.0: fit needs teacher="):
        taught.fit(data, batch_size=4, max_steps=1, progress=False)
    with pytest.raises(ValueError, match="teacher_weight is 0"):
        AHA(colour_classifier(), AHAConfig(**CHEAP)).fit(data, batch_size=4, progress=False, teacher=teacher)
    with pytest.raises(ValueError, match="not a DataLoader"):
        loader = torch.utils.data.DataLoader(data, batch_size=4)
        taught.fit(loader, max_steps=1, progress=False, teacher=teacher)
    with pytest.raises(ValueError, match="holds 8 maps, the dataset 6 items"):
        taught.fit(_Items(6), batch_size=2, max_steps=1, progress=False, teacher=teacher)
    small = TeacherMaps(teacher.maps[:, :16, :16], teacher.targets, teacher.settings)
    with pytest.raises(ValueError, match=r"teacher's maps are \(16, 16\), the training images \(32, 32\)"):
        taught.fit(data, batch_size=4, max_steps=1, progress=False, teacher=small)
    with pytest.raises(ValueError, match="teacher_weight"):
        AHAConfig(teacher_weight=-1.0)


def test_a_taught_run_keeps_its_weight_in_the_checkpoint_and_resumes_exactly(tmp_path):
    config = AHAConfig(**CHEAP, teacher_weight=0.5, teacher_loss="pixel")
    teacher = _blue_teacher(_Items(8))
    whole = AHA(colour_classifier(), config)
    whole.fit(_Items(8), batch_size=4, epochs=2, progress=False, teacher=teacher)  # 2 steps an epoch, 4 in all

    crashed = AHA(colour_classifier(), config)
    with pytest.raises(KeyboardInterrupt):  # during step 4: the checkpoint after step 2 is the last
        crashed.fit(_Items(8, fail_after=13), batch_size=4, epochs=2, progress=False, checkpoint_dir=tmp_path,
                    checkpoint_every=2, teacher=teacher)  # fmt: skip
    saved = AHA.load(tmp_path, colour_classifier()).config
    assert (saved.teacher_weight, saved.teacher_loss) == (0.5, "pixel")
    resumed = AHA(colour_classifier(), config)
    history = resumed.fit(_Items(8), batch_size=4, epochs=2, progress=False, resume=tmp_path, teacher=teacher)
    assert [record.step for record in history.steps] == [2, 3]
    for key, value in whole.decoder.state_dict().items():
        torch.testing.assert_close(resumed.decoder.state_dict()[key], value, atol=0, rtol=0, msg=key)


# ---------------------------------------------------------------------------------------------------------------
# The command line: train-aha --teacher
# ---------------------------------------------------------------------------------------------------------------


def test_train_aha_with_a_teacher_computes_it_once_learns_from_it_and_resumes(tmp_path, capsys):
    from attr_engine.cli import main
    from tests.eval_helpers import untrained_resnet_checkpoint

    config = tmp_path / "aha.yaml"
    fields = {**CHEAP, "grid_range": list(FAST["grid_range"])}
    config.write_text(json.dumps({"aha": fields}))  # JSON is YAML
    teacher, out = tmp_path / "teacher", tmp_path / "aha"
    base = ["train-aha", "--classifier", str(untrained_resnet_checkpoint(tmp_path)), "--out", str(out),
            "--num-images", "10", "--img-size", "32", "--batch-size", "4", "--config", str(config), "--no-progress",
            "--teacher", str(teacher), "--teacher-steps", "2"]  # fmt: skip
    assert main([*base, "--max-steps", "1"]) == 0
    printed = capsys.readouterr().out
    assert f"teacher: the optimum of 10 training images in {teacher}" in printed and "teacher loss (ranking)" in printed
    parts = sorted(teacher.glob("teacher-*.safetensors"))
    assert [p.name for p in parts] == [TEACHER_PART.format(start=0, stop=10)]  # one chunk of 16 holds all 10
    summary = json.loads((out / "train.json").read_text())
    assert summary["teacher_settings"]["steps"] == "2" and summary["teacher"] == str(teacher)
    assert json.loads((out / "config.json").read_text())["config"]["teacher_weight"] == 1.0  # the flag's default
    loaded = TeacherMaps.load(teacher, 10)
    assert loaded.maps.shape == (10, 32, 32) and torch.isfinite(loaded.maps.float()).all()

    # Resuming keeps the finished parts (same bytes, not rewritten) and trains on.
    stamp = parts[0].stat().st_mtime_ns
    assert main([*base, "--max-steps", "2", "--resume"]) == 0
    assert parts[0].stat().st_mtime_ns == stamp
    assert json.loads((out / "config.json").read_text())["steps_trained"] == 2
    # The loss's flag reaches the config (the same teacher maps serve either loss).
    assert main([*base, "--overwrite", "--max-steps", "1", "--teacher-loss", "pixel"]) == 0
    assert "teacher loss (pixel)" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["config"]["teacher_loss"] == "pixel"

    # The teacher's flags are checked before any work, in one line each.
    for extra, message in (
        (["--teacher-steps", "0"], "--teacher-steps"),
        (["--teacher-lr", "nan"], "--teacher-lr must be a finite number > 0"),
        (["--teacher-weight", "0"], "--teacher-weight must be a finite number > 0"),
    ):
        assert main([*base, "--overwrite", *extra]) == 2
        assert message in capsys.readouterr().err
    no_teacher = base[: base.index("--teacher")]
    for weight in ("2", "0"):  # any value: the flag itself needs --teacher
        assert main([*no_teacher, "--overwrite", "--teacher-weight", weight]) == 2
        assert "--teacher-weight needs --teacher" in capsys.readouterr().err
    assert main([*no_teacher, "--overwrite", "--teacher-loss", "pixel"]) == 2
    assert "--teacher-loss needs --teacher" in capsys.readouterr().err
    assert main([*no_teacher, "--overwrite", "--aha-option", "teacher_loss=pixel"]) == 2
    assert "teacher_loss='pixel' needs --teacher" in capsys.readouterr().err
    assert main([*no_teacher, "--overwrite", "--teacher-actors", "0"]) == 2
    assert "--teacher-actors needs --teacher" in capsys.readouterr().err
    assert main([*no_teacher, "--overwrite", "--teacher-engine", "ray"]) == 2
    assert "--teacher-engine needs --teacher" in capsys.readouterr().err
    for extra in (["--teacher-actors", "2"], ["--address", "auto"]):  # Ray's flags without the Ray engine
        assert main([*base, "--overwrite", *extra]) == 2
        assert f"{extra[0]} applies to --teacher-engine ray only" in capsys.readouterr().err
    # A stray part in the folder is refused by name, not mixed in.
    (teacher / TEACHER_PART.format(start=0, stop=4)).write_bytes(parts[0].read_bytes())
    assert main([*base, "--overwrite", "--max-steps", "1"]) == 2
    err = capsys.readouterr().err
    assert f"--teacher {teacher}: teacher part teacher-000000000-000000004.safetensors does not hold" in err, err


def _train_aha_worker(rank: int, world: int, port: int, args: list[str], status: str) -> None:
    import os

    from attr_engine.cli import main

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank))
    torch.set_num_threads(1)
    if rank == 0:  # rank 0 starts its share late: rank 1 must wait for it before loading the whole teacher
        import time

        import attr_engine.aha.teacher as module

        compute = module.compute_teacher_maps

        def late(*args, **kwargs):
            time.sleep(3)
            return compute(*args, **kwargs)

        module.compute_teacher_maps = late
    code = main(args)
    with open(f"{status}.{rank}", "w") as f:
        f.write(str(code))
    torch.distributed.destroy_process_group()


def test_under_two_processes_each_computes_its_chunks_and_both_train_on_all(tmp_path):
    import socket

    import torch.multiprocessing as mp

    from tests.eval_helpers import untrained_resnet_checkpoint

    config = tmp_path / "aha.yaml"
    config.write_text(json.dumps({"aha": {**CHEAP, "grid_range": list(FAST["grid_range"])}}))
    teacher, out = tmp_path / "teacher", tmp_path / "aha"
    args = ["train-aha", "--classifier", str(untrained_resnet_checkpoint(tmp_path)), "--out", str(out),
            "--num-images", "40", "--img-size", "32", "--batch-size", "4", "--config", str(config), "--no-progress",
            "--teacher", str(teacher), "--teacher-steps", "1", "--max-steps", "1", "--device", "cpu"]  # fmt: skip
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_train_aha_worker, args=(2, port, args, str(tmp_path / "status")), nprocs=2, join=True)
    assert [(tmp_path / f"status.{r}").read_text() for r in (0, 1)] == ["0", "0"]
    spans = [(0, 16), (16, 32), (32, 40)]  # chunks 0 and 2 are rank 0's, chunk 1 rank 1's
    assert sorted(p.name for p in teacher.iterdir()) == [TEACHER_PART.format(start=a, stop=b) for a, b in spans]
    assert len(TeacherMaps.load(teacher, 40)) == 40
    assert json.loads((out / "config.json").read_text())["steps_trained"] == 1
