"""evaluate(): the leaderboard agrees with the metrics called directly, its table / CSV / figures, and its checks."""

from __future__ import annotations

import csv
from collections.abc import Iterator

import pytest
import torch

from attr_engine.baselines import Gradient, GradientXInput
from attr_engine.data import ShapesDataset
from attr_engine.evaluate import DEFAULT_METRICS, METRICS, evaluate
from attr_engine.metrics import deletion_insertion, infidelity, max_sensitivity, pointing_game, random_logit
from attr_engine.report import leaderboard_markdown, markdown_table, write_leaderboard_csv, write_report
from tests.eval_helpers import single_thread, tiny_resnet

FAST = {
    "infidelity": {"n_samples": 2},
    "infidelity_quantus": {"n_samples": 1, "patch_sizes": (8,)},
    "max_sensitivity": {"n_samples": 2},
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with single_thread():
        yield


@pytest.fixture(scope="module")
def setting():
    clf = tiny_resnet(num_classes=6)
    data = ShapesDataset(4, img_size=32, seed=3)
    metrics = {name: FAST.get(name, {}) for name in METRICS}
    board = evaluate(clf, {"grad": "gradient", "gxi": GradientXInput(clf)}, data, metrics, batch_size=3, keep=2)
    return clf, data, board


def test_leaderboard_rows_equal_the_metrics_called_directly(setting) -> None:
    clf, data, board = setting
    x, _, masks = data.tensors()
    with torch.no_grad():
        y = clf(x).argmax(1)
    explainer = Gradient(clf)
    maps = explainer.attribute(x, y)
    row = board.rows[0]
    assert row["method"] == "grad" and board.columns == ["method", "ranked by", *METRICS, "ms/image"]
    assert row["ranked by"] == "map"
    di = deletion_insertion(clf, x, maps, y, protocol="aha")
    assert row["deletion"] == pytest.approx(di.deletion.mean().item(), rel=1e-5)
    assert row["insertion"] == pytest.approx(di.insertion.mean().item(), rel=1e-5)
    gen = torch.Generator().manual_seed(0)  # evaluate() seeds every random metric with seed=0
    per_channel = explainer.attribute(x, y, reduce=None)  # infidelity scores the gradient's signed channels
    expected = infidelity(
        clf, x, per_channel, y, patch_sizes=(8, 16), baseline="uniform", n_samples=2, scaling="optimal", generator=gen
    )
    assert row["infidelity"] == pytest.approx(expected.mean().item(), rel=1e-5)
    gen = torch.Generator().manual_seed(0)
    sens = max_sensitivity(explainer, x, y, maps=maps, radius=0.02, n_samples=2, generator=gen, batch_size=3)
    assert row["max_sensitivity"] == pytest.approx(sens.mean().item(), rel=1e-5)
    gen = torch.Generator().manual_seed(0)
    rl = random_logit(explainer, x, y, maps=maps, similarity="pearson", generator=gen)
    assert row["random_logit"] == pytest.approx(rl.mean().item(), rel=1e-5)
    assert row["pointing_game"] == pytest.approx(pointing_game(maps, masks).float().mean().item())
    assert row["ms/image"] > 0
    assert board.scores["grad"]["deletion"].shape == (4,)
    assert board.curves["gxi"]["deletion"].shape == (21,) and board.maps["gxi"].shape == (2, 32, 32)


def test_best_markdown_and_csv(setting, tmp_path) -> None:
    _, _, board = setting
    dele = board.column("deletion")
    assert board.best("deletion") == min(dele, key=dele.get)
    ins = board.column("insertion")
    assert board.best("insertion") == max(ins, key=ins.get)
    text = leaderboard_markdown(board)
    assert "| method | ranked by | deletion ↓ | insertion ↑ |" in text and text.count("**") >= 2
    path = write_leaderboard_csv(board, tmp_path / "board.csv")
    with path.open() as f:
        rows = list(csv.DictReader(f))
    assert [r["method"] for r in rows] == ["grad", "gxi"]
    assert float(rows[1]["deletion"]) == pytest.approx(board.rows[1]["deletion"])


def test_write_report_writes_table_and_figures(setting, tmp_path) -> None:
    _, _, board = setting
    paths = write_report(board, tmp_path / "out", stem="tiny")
    assert set(paths) == {"markdown", "csv", "curves", "maps"}
    for path in paths.values():
        assert path.exists() and path.stat().st_size > 100
    assert paths["curves"].read_bytes()[:4] == b"\x89PNG"
    assert paths["markdown"].read_text() == leaderboard_markdown(board)


def test_one_report_writer_for_the_library_and_the_cli(setting, tmp_path) -> None:
    """evaluate --out / demo and the library wrote a leaderboard's files with two writers; write_report is the one,
    under each's file names: the same board gives the same bytes either way."""
    import json

    from attr_engine.cli.evaluate import CLI_REPORT_FILES, markdown, write_board

    _, _, board = setting
    lib = write_report(board, tmp_path / "lib")
    cli = write_board(board, tmp_path / "cli", results={"setup": {"seed": 0}})
    assert {k: p.name for k, p in cli.items()} == {
        "csv": "leaderboard.csv", "curves": "curves.png", "overlays": "overlays.png", "results": "results.json"
    }  # fmt: skip
    assert not (tmp_path / "cli" / "leaderboard.md").exists()  # the CLI writes its own report.md around the table
    for kind, cli_kind in (("csv", "csv"), ("curves", "curves"), ("maps", "overlays")):
        assert lib[kind].read_bytes() == cli[cli_kind].read_bytes(), kind
    record = json.loads(cli["results"].read_text())
    assert record["setup"] == {"seed": 0} and [r["method"] for r in record["leaderboard"]] == ["grad", "gxi"]
    assert record["curves"]["grad"]["deletion"] == pytest.approx(board.curves["grad"]["deletion"].tolist())
    # report.md's table is the library's, notes included.
    assert markdown(board) == leaderboard_markdown(board)
    # Any kind renamed or left out; an unknown kind is refused.
    only = write_report(board, tmp_path / "only", files={**CLI_REPORT_FILES, "curves": None, "maps": None})
    assert set(only) == {"csv", "results"}
    with pytest.raises(ValueError, match="unknown report file kind"):
        write_report(board, tmp_path / "bad", files={"overlay": "x.png"})


def test_markdown_table_bolds_the_best_by_direction() -> None:
    rows = [{"method": "a", "x": 1.0, "y": 5.0}, {"method": "b", "x": 2.0, "y": float("nan")}]
    text = markdown_table(rows, directions={"x": "lower", "y": "higher"})
    assert "| a | **1.000** | **5.000** |" in text and "| b | 2.000 | nan |" in text


def test_evaluate_checks_its_arguments() -> None:
    clf = tiny_resnet(num_classes=6)
    x = torch.rand(2, 3, 32, 32)
    with pytest.raises(ValueError, match="unknown metric"):
        evaluate(clf, ["gradient"], (x,), ["speed"])
    with pytest.raises(ValueError, match="masks"):
        evaluate(clf, ["gradient"], (x, torch.zeros(2)), [*DEFAULT_METRICS])  # asked for by name
    with pytest.raises(ValueError, match="unknown explainer"):
        evaluate(clf, ["lime"], (x,), ["deletion"])
    with pytest.raises(ValueError, match="different classifier"):
        evaluate(clf, [Gradient(tiny_resnet(num_classes=6))], (x,), ["deletion"])
    with pytest.raises(ValueError, match="labels"):
        evaluate(clf, ["gradient"], (x,), ["deletion"], target="label")


def test_each_method_is_scored_with_its_declared_reductions() -> None:
    """The pullback ranks pixels by mean |value| (its official evaluation), scores infidelity on its signed
    channels, and reports the deletion / insertion of x·(x−r) and of the signed mean beside it."""
    from attr_engine.explainer import get_explainer, reduce_channels, resolve_baselines

    clf = tiny_resnet(num_classes=6)
    x, _, _ = ShapesDataset(3, img_size=32, seed=4).tensors()
    metrics = {"deletion": {}, "insertion": {}, "infidelity": {"n_samples": 1}}
    board = evaluate(clf, {"SfP": "pullback-soft"}, (x,), metrics, batch_size=3, extra_rankings=True)
    assert [r["method"] for r in evaluate(clf, {"SfP": "pullback-soft"}, (x,), ["deletion"]).rows] == ["SfP"]
    with torch.no_grad():
        y = clf(x).argmax(1)
    full = get_explainer("pullback-soft", clf).attribute(x, y, reduce=None)
    rows = {r["method"]: r for r in board.rows}
    assert list(rows) == ["SfP", "SfP [x·(x−r)]", "SfP [signed mean]"]
    assert rows["SfP"]["ranked by"] == "mean abs"
    di = deletion_insertion(clf, x, full.abs().mean(1), y, protocol="aha")
    assert rows["SfP"]["deletion"] == pytest.approx(di.deletion.mean().item(), rel=1e-5)
    gen = torch.Generator().manual_seed(0)
    expected = infidelity(
        clf, x, full, y, patch_sizes=(8, 16), baseline="uniform", n_samples=1, scaling="optimal", generator=gen
    )
    assert rows["SfP"]["infidelity"] == pytest.approx(expected.mean().item(), rel=1e-5)
    towards = reduce_channels(full, "input", x, resolve_baselines("mean", x, clf))
    di = deletion_insertion(clf, x, towards, y, protocol="aha")
    assert rows["SfP [x·(x−r)]"]["insertion"] == pytest.approx(di.insertion.mean().item(), rel=1e-5)
    di = deletion_insertion(clf, x, full.mean(1), y, protocol="aha")
    assert rows["SfP [signed mean]"]["deletion"] == pytest.approx(di.deletion.mean().item(), rel=1e-5)
    assert "infidelity" not in rows["SfP [signed mean]"] and set(board.column("infidelity")) == {"SfP"}
    text = leaderboard_markdown(board)
    assert "by the mean absolute value of its colour channels" in text and "signed attribution of each" in text
