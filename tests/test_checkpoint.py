"""Pickle-free persistence: safetensors/JSON round trips, atomic writes, clear errors, nested training state."""

import os
import random
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from attr_engine.atomic import atomic_write, fresh_dir, stale_temporaries
from attr_engine.checkpoint import (
    flatten_state,
    load_json,
    load_safetensors,
    load_state,
    save_json,
    save_safetensors,
    save_state,
    unflatten_state,
)


def test_safetensors_round_trip_keeps_values_dtypes_and_metadata(tmp_path: Path) -> None:
    shared = torch.randn(4, 5)
    tensors = {
        "w": shared,
        "w_tied": shared,  # aliases are copied on save, not rejected
        "view": shared[1:3],
        "half": torch.randn(3, dtype=torch.float16),
        "bf16": torch.randn(2, 2, dtype=torch.bfloat16),
        "idx": torch.arange(7),
        "flag": torch.tensor([True, False]),
        "scalar": torch.tensor(3.5),
    }
    path = tmp_path / "sub" / "t.safetensors"
    save_safetensors(tensors, path, {"note": "hello"})
    loaded, meta = load_safetensors(path)
    assert meta == {"note": "hello"}
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind


@pytest.mark.parametrize(
    "mangle",
    [lambda b: b[: len(b) // 2], lambda b: b"not a safetensors file at all", lambda b: b""],
    ids=["truncated", "garbage", "empty"],
)
def test_load_safetensors_rejects_corrupt_files_naming_them(tmp_path: Path, mangle) -> None:
    good = tmp_path / "good.safetensors"
    save_safetensors({"a": torch.randn(64)}, good)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(mangle(good.read_bytes()))
    with pytest.raises(ValueError, match=r"bad\.safetensors"):
        load_safetensors(bad)


def test_load_safetensors_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nope\.safetensors"):
        load_safetensors(tmp_path / "nope.safetensors")


def test_save_safetensors_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"must be a torch\.Tensor"):
        save_safetensors({"a": [1, 2]}, tmp_path / "x.safetensors")  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="metadata"):
        save_safetensors({"a": torch.zeros(1)}, tmp_path / "x.safetensors", {"k": 1})  # type: ignore[dict-item]
    assert not any(tmp_path.iterdir())


def test_atomic_write_keeps_old_file_when_writer_fails(tmp_path: Path) -> None:
    path = tmp_path / "f.txt"
    with atomic_write(path, "w") as f:
        f.write("first")
    with pytest.raises(RuntimeError, match="boom"), atomic_write(path, "w") as f:
        f.write("partial")
        raise RuntimeError("boom")
    assert path.read_text() == "first"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]
    with atomic_write(path) as f:
        f.write(b"second")
    assert path.read_bytes() == b"second"
    with pytest.raises(ValueError, match="mode"):
        atomic_write(path, "a").__enter__()


@pytest.fixture
def umask():
    """Set the process umask for a test and restore it afterwards."""
    old = os.umask(0o022)
    try:
        yield lambda mask: os.umask(mask)
    finally:
        os.umask(old)


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_atomic_outputs_respect_the_umask(tmp_path: Path, umask, mask: int) -> None:
    """Issue #10.16: every atomically written file used to be created 0600 whatever the umask."""
    umask(mask)
    with atomic_write(tmp_path / "a.bin") as f:
        f.write(b"x")
    save_json({"a": 1}, tmp_path / "b.json")
    save_safetensors({"t": torch.zeros(2)}, tmp_path / "c.safetensors")
    for name in ("a.bin", "b.json", "c.safetensors"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~mask, name
    d = fresh_dir(tmp_path, ".d.")
    assert stat.S_IMODE(d.stat().st_mode) == 0o777 & ~mask and d.name.endswith(".tmp")


def test_stale_temporaries_match_only_what_a_killed_writer_leaves(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    torn = [tmp_path / ".a.npy.0123abcd.tmp", tmp_path / "sub" / ".b.png.deadbeef.tmp"]
    for p in torn:
        p.write_bytes(b"torn")
    for name in ("notes.tmp", ".hidden.tmp", ".a.npy.xyz.tmp", "a.npy"):
        (tmp_path / name).write_bytes(b"mine")
    assert stale_temporaries(tmp_path) == sorted(torn)


def test_json_round_trip_and_corrupt_file(tmp_path: Path) -> None:
    obj = {"a": [1, 2.5, None, True], "b": {"c": "d"}, "nan": float("inf")}
    save_json(obj, tmp_path / "x.json")
    assert load_json(tmp_path / "x.json") == obj
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"bad\.json"):
        load_json(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError, match=r"missing\.json"):
        load_json(tmp_path / "missing.json")


def _adamw_run(steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(
        [{"params": model[0].parameters(), "weight_decay": 0.1}, {"params": model[2].parameters(), "lr": 3e-3}],
        lr=1e-2,
        betas=(0.8, 0.95),
    )
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    x = torch.randn(16, 4)
    for _ in range(steps):
        _step(model, opt, sched, x)
    return model, opt, sched


def _step(model, opt, sched, x) -> None:
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    sched.step()


def test_adamw_scheduler_and_rng_state_round_trip(tmp_path: Path) -> None:
    model, opt, sched = _adamw_run(steps=3)
    gen = torch.Generator().manual_seed(123)
    random.seed(7)
    pcg = np.random.default_rng(7)
    mt = np.random.Generator(np.random.MT19937(7))  # its state holds a uint32 array, which torch cannot store
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "torch_rng": gen.get_state(),
        "numpy_rng": [pcg.bit_generator.state, mt.bit_generator.state],
        "python_rng": random.getstate(),
        "epoch": 3,
    }
    path = tmp_path / "trainer.safetensors"
    save_state(state, path, {"step": "3"})
    loaded, meta = load_state(path)
    assert meta == {"step": "3"}

    # Optimizer state keeps int keys, tuples and tensor step counters exactly.
    assert set(loaded["optimizer"]["state"]) == set(opt.state_dict()["state"])
    assert loaded["optimizer"]["param_groups"][0]["betas"] == (0.8, 0.95)
    assert loaded["scheduler"] == sched.state_dict()
    assert loaded["epoch"] == 3

    # Resuming from the loaded state continues exactly like the uninterrupted run.
    model2, opt2, sched2 = _adamw_run(steps=0)
    model2.load_state_dict(loaded["model"])
    opt2.load_state_dict(loaded["optimizer"])
    sched2.load_state_dict(loaded["scheduler"])
    x = torch.randn(16, 4)
    for _ in range(2):
        _step(model, opt, sched, x)
        _step(model2, opt2, sched2, x)
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)

    gen2 = torch.Generator()
    gen2.set_state(loaded["torch_rng"])
    assert torch.equal(torch.rand(5, generator=gen), torch.rand(5, generator=gen2))
    pcg2, mt2 = np.random.default_rng(), np.random.Generator(np.random.MT19937())
    pcg2.bit_generator.state, mt2.bit_generator.state = loaded["numpy_rng"]
    assert np.array_equal(pcg2.random(3), pcg.random(3)) and np.array_equal(mt2.random(3), mt.random(3))
    expected = random.random()
    random.setstate(loaded["python_rng"])
    assert random.random() == expected


def test_flatten_state_structure_and_errors() -> None:
    t = torch.arange(3)
    tensors, skeleton = flatten_state({"a": (1, [t, None]), 2: {"b": "s"}})
    assert list(tensors) == ["a.1.0"]
    rebuilt = unflatten_state(tensors, skeleton)
    assert rebuilt[2] == {"b": "s"} and rebuilt["a"][0] == 1 and isinstance(rebuilt["a"], tuple)
    assert torch.equal(rebuilt["a"][1][0], t)
    with pytest.raises(TypeError, match=r"set at x"):
        flatten_state({"x": {1, 2}})
    with pytest.raises(ValueError, match="missing"):
        unflatten_state({}, skeleton)


def test_load_state_rejects_plain_tensor_file(tmp_path: Path) -> None:
    save_safetensors({"a": torch.zeros(1)}, tmp_path / "plain.safetensors")
    with pytest.raises(ValueError, match="not a nested state"):
        load_state(tmp_path / "plain.safetensors")
