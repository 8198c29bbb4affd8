"""pointing_game and energy_pointing_game on hand-made maps and masks, and on ShapesDataset ground truth."""

from __future__ import annotations

import pytest
import torch

from attr_engine.data import ShapesDataset
from attr_engine.metrics.localisation import energy_pointing_game, pointing_game, top_k_mask_iou


def single_pixel_mask(height: int, width: int, y: int, x: int) -> torch.Tensor:
    mask = torch.zeros(1, height, width, dtype=torch.bool)
    mask[0, y, x] = True
    return mask


def test_pointing_game_hit_and_miss() -> None:
    maps = torch.zeros(2, 3, 4)
    maps[0, 1, 2] = 5.0
    maps[1, 2, 0] = 5.0
    masks = torch.zeros(2, 3, 4, dtype=torch.bool)
    masks[:, 1, 1:3] = True  # both images: object at (1, 1) and (1, 2)
    hits = pointing_game(maps, masks)
    assert hits.dtype == torch.bool
    assert hits.tolist() == [True, False]


def test_pointing_game_tolerance_is_a_euclidean_disc() -> None:
    maps = torch.zeros(1, 5, 5)
    maps[0, 0, 0] = 1.0
    mask = single_pixel_mask(5, 5, 2, 2)  # squared distance 8 from the maximum
    assert pointing_game(maps, mask, tolerance=0).tolist() == [False]
    assert pointing_game(maps, mask, tolerance=2).tolist() == [False]  # inside a 2 px square, outside the disc
    assert pointing_game(maps, mask, tolerance=2.83).tolist() == [True]  # sqrt(8) = 2.828...
    assert pointing_game(maps, mask, tolerance=3).tolist() == [True]
    # A neighbour one pixel away counts from tolerance 1 on.
    near = single_pixel_mask(5, 5, 0, 1)
    assert pointing_game(maps, near).tolist() == [False]
    assert pointing_game(maps, near, tolerance=1).tolist() == [True]


def test_pointing_game_ties_point_at_the_first_maximum() -> None:
    maps = torch.zeros(1, 4, 4)
    maps[0, 3, 3] = maps[0, 1, 2] = 2.0  # two maxima; row-major first is (1, 2)
    assert pointing_game(maps, single_pixel_mask(4, 4, 1, 2)).tolist() == [True]
    assert pointing_game(maps, single_pixel_mask(4, 4, 3, 3)).tolist() == [False]
    # A constant map points at the top-left pixel, so it does not win wherever the object is.
    flat = torch.ones(1, 4, 4)
    assert pointing_game(flat, single_pixel_mask(4, 4, 0, 0)).tolist() == [True]
    assert pointing_game(flat, single_pixel_mask(4, 4, 2, 2)).tolist() == [False]


def test_pointing_game_sums_channel_maps() -> None:
    maps = torch.zeros(1, 3, 4, 4)
    maps[0, 0, 0, 0] = 3.0  # largest single channel value ...
    maps[0, :, 2, 2] = 2.0  # ... but the largest channel sum (6) is at (2, 2)
    assert pointing_game(maps, single_pixel_mask(4, 4, 2, 2)).tolist() == [True]


def test_energy_pointing_game_by_hand() -> None:
    maps = torch.tensor([[[2.0, -1.0], [1.0, 0.0]], [[-1.0, -2.0], [-3.0, -4.0]], [[1.0, 1.0], [1.0, 1.0]]])
    masks = torch.tensor([[[True, False], [False, True]], [[True, True], [False, False]], [[True, True], [True, True]]])
    energy = energy_pointing_game(maps, masks)
    assert energy.dtype == torch.float32
    # 2/3 (positive mass 2 + 1, of which 2 inside); 0 for a map without positive mass; 1 when the mask is everything.
    torch.testing.assert_close(energy, torch.tensor([2 / 3, 0.0, 1.0]), atol=1e-7, rtol=0)
    channel_maps = torch.stack([maps, maps], dim=1)  # (B, 2, H, W): summing channels doubles mass, same shares
    torch.testing.assert_close(energy_pointing_game(channel_maps, masks), energy, atol=1e-7, rtol=0)


def test_top_k_mask_iou_by_hand() -> None:
    on = [[True, True, False, False], [True, True, False, False]]  # (2, 4): a 2 x 2 object on the left
    masks = torch.tensor([on, on, [[True, False, False, False], [False, False, False, False]]])
    maps = torch.tensor(
        [
            [[8.0, 7.0, 2.0, 1.0], [6.0, 5.0, 4.0, 3.0]],  # the object's 4 pixels ranked first
            [[1.0, 2.0, 7.0, 8.0], [3.0, 4.0, 5.0, 6.0]],  # ranked last
            [[2.0, 5.0, 1.0, 0.0], [-1.0, -2.0, -3.0, -4.0]],  # one-pixel object, ranked second
        ]
    )
    iou = top_k_mask_iou(maps, masks)
    assert iou.dtype == torch.float32
    torch.testing.assert_close(iou, torch.tensor([1.0, 0.0, 0.0]), atol=1e-7, rtol=0)
    # Half the object in the top 4: {(0, 0), (0, 1), (0, 2), (0, 3)} against {(0, 0), (0, 1), (1, 0), (1, 1)}.
    half = torch.tensor([[[8.0, 7.0, 6.0, 5.0], [4.0, 3.0, 2.0, 1.0]]])
    torch.testing.assert_close(top_k_mask_iou(half, masks[:1]), torch.tensor([2 / 6]), atol=1e-7, rtol=0)
    # Order only: any increasing transform gives the same IoU (the energy pointing game would change).
    torch.testing.assert_close(top_k_mask_iou(maps.exp() - 5.0, masks), iou, atol=0, rtol=0)


def test_on_shapes_dataset_masks() -> None:
    data = ShapesDataset(3, img_size=32, seed=1)
    masks = torch.stack([data[i][2] for i in range(3)])
    on_object = masks.float() + 0.1 * torch.rand(3, 32, 32)
    off_object = (~masks).float() + 0.1 * torch.rand(3, 32, 32)
    assert pointing_game(on_object, masks).all()
    assert not pointing_game(off_object, masks).any()
    torch.testing.assert_close(
        energy_pointing_game(on_object, masks),
        (on_object * masks).flatten(1).sum(1) / on_object.flatten(1).sum(1),
    )
    assert bool((energy_pointing_game(on_object, masks) > energy_pointing_game(off_object, masks)).all())
    torch.testing.assert_close(top_k_mask_iou(on_object, masks), torch.ones(3), atol=0, rtol=0)
    torch.testing.assert_close(top_k_mask_iou(off_object, masks), torch.zeros(3), atol=0, rtol=0)


@pytest.mark.parametrize("metric", [pointing_game, energy_pointing_game, top_k_mask_iou])
def test_bad_inputs_raise(metric) -> None:
    maps = torch.randn(2, 4, 4)
    masks = torch.ones(2, 4, 4, dtype=torch.bool)
    empty = masks.clone()
    empty[1] = False
    nan_maps = maps.clone()
    nan_maps[0, 0, 0] = float("nan")
    cases = [
        ((maps, empty), r"masks is empty .*\[1\]"),
        ((maps, masks.float()), "masks must be a bool"),
        ((maps, masks[:, :3]), "masks must have shape"),
        ((maps[0], masks), "maps must be"),
        ((nan_maps, masks), "maps contains NaN"),
        ((maps.long(), masks), "maps must be float"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            metric(*args)
    if metric is pointing_game:
        for tolerance in (-1, float("nan"), float("inf")):
            with pytest.raises(ValueError, match="tolerance"):
                pointing_game(maps, masks, tolerance=tolerance)
