"""The local engine: a job's maps computed in this process, batch by batch, one :class:`ItemResult` per input."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from attr_engine.jobs.inputs import Item, ItemResult
from attr_engine.jobs.job import AttributionJob

if TYPE_CHECKING:
    import torch

    from attr_engine.classifier import Classifier
    from attr_engine.imageops import DataConfig

__all__ = ["run"]


@dataclass
class _Input:
    """A decoded input: the classifier's view ``x (3, H, W)``, the original's ``(h, w)`` and, for overlays, the
    original as ``(3, h, w)`` uint8 (uint8 because a batch of 12-megapixel photos in float32 is gigabytes)."""

    item: Item
    x: torch.Tensor | None
    size: tuple[int, int] = (0, 0)
    original: torch.Tensor | None = None
    error: str | None = None


class _Decoded:
    """Decodes and preprocesses items; a file that fails comes back as its error message, not an exception.

    A map-style dataset (``__len__`` and ``__getitem__`` are all a DataLoader needs), not a ``torch`` subclass, so
    that defining it imports nothing.
    """

    def __init__(self, items: list[Item], config: DataConfig, keep_original: bool) -> None:
        self.items, self.config, self.keep_original = items, config, keep_original

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> _Input:
        item = self.items[i]
        from attr_engine.imageops import decode_image, prepare_input

        try:
            img = decode_image(item.path)
        except ValueError as err:
            return _Input(item, None, error=str(err))

        return _Input(item, *prepare_input(img, self.config, self.keep_original))


def _target_tensor(target: str | int, items: list[Item]) -> torch.Tensor | None:
    import torch

    if target == "pred":
        return None
    if target == "label":
        return torch.tensor([item.label for item in items])
    return torch.full((len(items),), int(target))


def run(
    job: AttributionJob,
    items: list[Item],
    *,
    classifier: Classifier,
    explainer: Any,
    config: DataConfig,
    limit: int | None = None,
    workers: int = 0,
    claim: Callable[[Item], bool] | None = None,
) -> Iterator[ItemResult]:
    """The local engine: each input's :class:`ItemResult`, in order, from batches of ``job.batch_size`` inputs.

    Args:
        job: the job (target, frame, overlays, batch size, seed).
        items: the inputs (:func:`~attr_engine.jobs.list_inputs`), decoded by
            :func:`~attr_engine.imageops.decode_image`.
        classifier, explainer: built from the job (:meth:`AttributionJob.load_classifier`,
            :meth:`AttributionJob.get_explainer`).
        config: the preprocessing every input is cut with.
        limit: yield at most this many maps (unreadable inputs do not count): a batch is cut to the maps still
            allowed before it is explained, so the maps of a run stopped at its limit are those a run without
            one makes of the same batches.
        workers: image-decoding worker processes.
        claim: asked for each readable input just before its batch is explained; an input it refuses (another job
            of the same settings is computing it) is left out, without a result.
    """
    import torch
    from torch.utils.data import DataLoader

    from attr_engine.explainer import NONFINITE_MAP, explain_batch_with_probability, finite_maps
    from attr_engine.imageops import to_image_frame

    keep_original = job.return_images and job.frame == "image"
    decoded = _Decoded(items, config, keep_original=keep_original)
    # _Decoded is map-style by protocol (see its docstring), not a torch Dataset subclass.
    loader: DataLoader[Any] = DataLoader(
        decoded,  # type: ignore[arg-type]
        batch_size=job.batch_size,
        num_workers=workers,
        collate_fn=list,
    )
    left = len(items) if limit is None else limit
    torch.manual_seed(job.seed)
    device = classifier.norm_mean.device
    for batch in loader:
        if left <= 0:
            return
        good = []
        for entry in batch:
            if entry.error is None:
                good.append(entry)
            else:
                yield ItemResult(entry.item, error=entry.error)
        good = _claimed(good, left, claim)
        if not good:
            continue
        x = torch.stack([entry.x for entry in good if entry.x is not None]).to(device)
        target = _target_tensor(job.target, [entry.item for entry in good])
        maps, target, probability = explain_batch_with_probability(classifier, explainer, x, target)
        finite = finite_maps(maps)
        rows = zip(good, x.cpu(), maps, target.tolist(), probability.tolist(), finite, strict=True)
        for entry, image, amap, t, p, ok in rows:
            if not ok:
                yield ItemResult(entry.item, target=t, error=NONFINITE_MAP, probability=p)
                continue
            if job.frame == "image":
                amap = to_image_frame(amap, entry.size, config)
            shown = None
            if job.return_images:
                shown = image if job.frame == "model" else entry.original.float().div_(255)
            yield ItemResult(entry.item, amap, shown, t, probability=p)
        left -= sum(finite)  # --limit counts maps written


def _claimed(entries: list[_Input], left: int, claim: Callable[[Item], bool] | None) -> list[_Input]:
    """The first ``left`` entries that ``claim`` takes (all of them, up to ``left``, without one)."""
    if claim is None:
        return entries[:left]
    taken: list[_Input] = []
    for entry in entries:
        if len(taken) >= left:
            break
        if claim(entry.item):
            taken.append(entry)
    return taken
