"""A folder job from start to end: :func:`explain` plans, shards, resumes, claims and writes, on either engine.

The steps, in order: the classifier, preprocessing and method built from the job (or taken as given); the settings
and their digest, computed once; the output directory claimed for that digest (:func:`attr_engine.claims.
claim_output`: a live job with other settings is refused, recorded settings are compared under the same lock);
this process's share of the inputs (:func:`attr_engine.distributed.shard`); what the journal and the files on disk
say is done; then the engine's results written one by one (:class:`~attr_engine.jobs.outputs.OutputWriter`), each
output claimed while it is computed (:class:`attr_engine.claims.ItemClaims`), so jobs of the same settings in one
directory share the work: an output another job holds is skipped and checked again at the end. The manifest of the
share closes the run; the :class:`Summary` says what happened.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from attr_engine.claims import ItemClaims, claim_output
from attr_engine.jobs.inputs import Item, ItemResult, list_inputs
from attr_engine.jobs.job import AttributionJob, check_recorded_settings, job_settings, settings_digest
from attr_engine.jobs.local import run
from attr_engine.jobs.outputs import JOURNAL_SUFFIX, MANIFEST_DIR, Journal, OutputWriter, remove_stale_temporaries

if TYPE_CHECKING:
    from attr_engine.classifier import Classifier
    from attr_engine.imageops import DataConfig

__all__ = ["Engine", "NoMapWrittenError", "Summary", "explain"]

# How often a job waiting for outputs another job holds looks again (seconds).
_POLL_S = 0.05
# Reasons named in the one line of a job whose every input failed; the rest are counted.
_REASONS_SHOWN = 3


class Engine(Protocol):
    """What computes maps for :func:`explain`: :func:`attr_engine.jobs.run` (``"local"``) or an object such as
    :class:`attr_engine.ray.RayEngine`; yields one :class:`ItemResult` per input of ``items``."""

    def __call__(
        self, job: AttributionJob, items: list[Item], *, classifier: Any, explainer: Any, config: Any, limit: int
    ) -> Iterator[ItemResult]: ...


class NoMapWrittenError(ValueError):
    """Every input of the job failed to be read: nothing was written (the message names the reasons)."""


@dataclass
class Summary:
    """What one :func:`explain` run did with this process's share of the inputs (also ``OUT/_manifest/
    rank<R>-of-<N>.json``). ``written``: ``{"input", "output", "target"}`` per map; ``unreadable`` / ``failed``:
    ``{"input", "reason"}`` (failed: the method gave a non-finite map, never written)."""

    out: Path
    settings: dict[str, Any]
    rank: int = 0
    world: int = 1
    inputs: list[str] = field(default_factory=list)
    written: list[dict[str, Any]] = field(default_factory=list)
    already: list[str] = field(default_factory=list)
    unreadable: list[dict[str, str]] = field(default_factory=list)
    failed: list[dict[str, str]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def method(self) -> str:
        return str(self.settings["method"])

    @property
    def left(self) -> int:
        """Inputs of the share not done by this run (a ``limit`` stopped it)."""
        done = len(self.already) + len(self.written) + len(self.unreadable) + len(self.failed)
        return len(self.inputs) - done

    def manifest(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world_size": self.world,
            "inputs": self.inputs,
            "written": self.written,
            "already_done": self.already,
            "unreadable": self.unreadable,
            "failed": self.failed,
            "seconds": round(self.seconds, 3),
        }


@dataclass(frozen=True)
class _Output:
    """How the maps are stored and drawn (see :class:`~attr_engine.jobs.outputs.OutputWriter`)."""

    fmt: str = "npy"
    map_dtype: str = "float32"
    png: bool = False
    cmap: str | None = None
    alpha: float = 0.7
    layout: str = "overlay"
    max_side: int = 2048


def explain(
    job: AttributionJob,
    inputs: str | os.PathLike[str] | Sequence[Item],
    out: str | os.PathLike[str],
    *,
    engine: str | Engine = "local",
    fmt: str = "npy",
    map_dtype: str = "float32",
    png: bool = False,
    cmap: str | None = None,
    alpha: float = 0.7,
    png_layout: str = "overlay",
    png_max_side: int = 2048,
    overwrite: bool = False,
    limit: int | None = None,
    rank: int | None = None,
    world: int | None = None,
    workers: int = 0,
    classifier: Classifier | None = None,
    explainer: Any = None,
    progress: Callable[[ItemResult | None, int, int], None] | None = None,
) -> Summary:
    """Attribution maps for every input, written under ``out`` as ``attr-engine explain`` writes them: resumable
    (a rerun does only what is missing), shardable (``rank`` / ``world``, by default read from ``RANK`` /
    ``WORLD_SIZE``), shared (jobs of the same settings in one ``out`` write each map once).

    Args:
        job: the classifier, method, target, frame and batch size (``job.return_images`` is set from ``png``).
        inputs: an image file, a folder or ImageFolder tree (:func:`~attr_engine.jobs.list_inputs`), or its items.
        out: the output directory (created).
        engine: ``"local"`` (this process, :func:`attr_engine.jobs.run`) or an :class:`Engine` such as
            :class:`attr_engine.ray.RayEngine` (the classifier here is then built on the CPU, for the settings).
        fmt, map_dtype: map files (:data:`~attr_engine.jobs.FORMATS`, :data:`~attr_engine.jobs.MAP_DTYPES`);
            ``png``: a picture per input (``cmap``, ``alpha``, ``png_layout``, ``png_max_side``: its look).
        overwrite: redo every map, even those the journal says are done with these settings.
        limit: write at most this many maps in this run (chunked runs); workers: image-decoding processes.
        classifier, explainer: already built from ``job`` (saves building them again).
        progress: called once with ``(None, 0, total)`` when the work starts (everything checked, ``total`` inputs
            to do), then after each input with its result, how many are finished and ``total``.

    Returns:
        The :class:`Summary` of this process's share (also written as its manifest).

    Raises:
        ValueError: settings the job or ``out`` refuses (other settings recorded in ``out``, a live job with other
            settings, a target the classifier lacks); :class:`NoMapWrittenError` when every input was unreadable.
    """
    from attr_engine.distributed import process_rank, shard

    if isinstance(engine, str) and engine != "local":
        raise ValueError(f"engine must be 'local' or an engine object (attr_engine.ray.RayEngine), got {engine!r}")
    if rank is None or world is None:
        rank, world = process_rank()
    items = list_inputs(Path(inputs), fmt) if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    output = _Output(fmt, map_dtype, png, cmap, alpha, png_layout, png_max_side)
    job = dataclasses.replace(job, return_images=png)
    classifier, explainer, config = _build(job, engine, classifier, explainer)
    _check_targets(job, items, classifier.num_classes)
    settings = job_settings(job, fmt, classifier, config, map_dtype=map_dtype, explainer=explainer)
    job = dataclasses.replace(job, preprocess=config, fingerprint=settings["classifier"])
    digest = settings_digest(settings)
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    check = lambda: check_recorded_settings(root, settings, overwrite)  # under the claims lock
    with claim_output(root, digest, f"method {settings['method']}", check=check) as sharing:
        summary = Summary(root, settings, rank, world)
        mine = shard(items, rank, world)
        summary.inputs = [item.name for item in mine]
        if world > 1 or not sharing:
            # Alone (or one of disjoint shards): temporaries of this process's outputs are a killed run's leftovers.
            remove_stale_temporaries(root, mine, rank, world)
        state = _State(job, summary, digest, output, config, overwrite, _class_names(job, items, classifier, png))
        finished = [False] * len(mine) if overwrite else [state.done(item) for item in mine]
        todo = [item for item, f in zip(mine, finished, strict=True) if not f]
        summary.already = [item.name for item, f in zip(mine, finished, strict=True) if f]
        start = time.perf_counter()
        try:
            state.work(todo, engine, classifier, explainer, limit, workers, progress)
        finally:
            state.close()
        summary.seconds = time.perf_counter() - start
        _save_manifest(summary)
    _check_something_written(summary)
    return summary


def _build(job: AttributionJob, engine: str | Engine, classifier: Any, explainer: Any) -> tuple[Any, Any, Any]:
    """The job's classifier, method and preprocessing: built here unless given (with an engine elsewhere, the
    classifier is built on the CPU only to record the settings)."""
    from attr_engine.distributed import local_device

    if classifier is None:
        classifier = job.load_classifier(local_device("cpu" if engine != "local" else job.device))
    config = job.data_config(classifier)
    if explainer is None:
        explainer = job.get_explainer(classifier)
    return classifier, explainer, config


def _check_targets(job: AttributionJob, items: list[Item], num_classes: int) -> None:
    if isinstance(job.target, int) and not 0 <= job.target < num_classes:
        raise ValueError(f"--target {job.target} is not a class of this classifier (0 to {num_classes - 1})")
    if job.target == "label" and any(item.label >= num_classes for item in items):
        raise ValueError(f"--target label: the tree has more class folders than the classifier's {num_classes} classes")


def _class_names(job: AttributionJob, items: list[Item], classifier: Any, png: bool) -> dict[int, str]:
    """``{class id: name}`` for the captions, only where the names are known to be the classifier's classes.

    With ``target="label"`` the explained class *is* an ImageFolder label, so its folder's name is that class's
    name. A classifier checkpoint written by ``train-classifier`` has a ``train.json`` beside it listing the classes
    it was trained on: used when it names this model and as many classes as the classifier has. Otherwise none: the
    caption says ``class 3``.
    """
    if not png:
        return {}
    if job.target == "label":
        return {item.label: Path(item.name).parts[0] for item in items if item.label >= 0}
    if job.classifier:
        from attr_engine.classifier import checkpoint_class_names

        return checkpoint_class_names(job.classifier, classifier)
    return {}


class _State:
    """One run's writing side: the journal (read and appended), the writer, the item claims and the summary."""

    def __init__(
        self,
        job: AttributionJob,
        summary: Summary,
        digest: str,
        output: _Output,
        config: DataConfig,
        overwrite: bool,
        class_names: Mapping[int, str],
    ) -> None:
        self.job, self.summary, self.digest, self.output, self.config = job, summary, digest, output, config
        self.journal = Journal(summary.out)
        self.claims = ItemClaims(summary.out)
        self.overwrite = overwrite
        self.class_names = dict(class_names)
        self.deferred: list[Item] = []
        self.finished = 0
        self.total = 0

    def done(self, item: Item) -> bool:
        """Whether ``item``'s outputs exist, read back whole, and the journal says these settings made them."""
        from attr_engine.jobs.outputs import valid_output

        out, output = self.summary.out, self.output
        if self.journal.refresh().get(item.map_file.as_posix()) != self.digest:
            return False  # missing, or made with other settings (an interrupted --overwrite)
        shape = self.config.input_size if self.job.frame == "model" else None
        if not valid_output(out / item.map_file, output.fmt, shape, output.map_dtype):
            return False
        return not output.png or valid_output(out / item.png_file, "png")

    def claim(self, item: Item) -> bool:
        """Claim ``item`` for this run: False when another job holds it (checked again at the end) or finished it
        since the plan was made."""
        key = item.map_file.as_posix()
        if not self.claims.try_claim(key):
            self.deferred.append(item)
            return False
        if not self.overwrite and self.done(item):
            self.claims.release(key)
            self.summary.already.append(item.name)
            self.finished += 1
            return False
        return True

    def work(
        self,
        todo: list[Item],
        engine: str | Engine,
        classifier: Any,
        explainer: Any,
        limit: int | None,
        workers: int,
        progress: Callable[[ItemResult | None, int, int], None] | None,
    ) -> None:
        """Write every result of the engine for ``todo``, then the outputs other jobs held, once they let go."""
        o = self.output
        left = len(todo) if limit is None else limit
        self.total = len(todo) if limit is None else min(len(todo), limit)
        path = self.summary.out / MANIFEST_DIR / f"rank{self.summary.rank}-of-{self.summary.world}{JOURNAL_SUFFIX}"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as journal:
            writer = OutputWriter(
                self.summary.out, self.summary.settings, journal, digest=self.digest, fmt=o.fmt, png=o.png,
                cmap=o.cmap, alpha=o.alpha, map_dtype=o.map_dtype, layout=o.layout, max_side=o.max_side,
                class_names=self.class_names,
            )  # fmt: skip
            self.summary.written = writer.written
            if progress is not None:
                progress(None, 0, self.total)
            batches = [todo]
            while batches and left > 0:
                items = batches.pop()
                for result in self._results(engine, items, classifier, explainer, left, workers):
                    self._take(result, writer, progress)
                    left = (len(todo) if limit is None else limit) - len(writer.written)
                    if left <= 0:
                        break
                batches.extend(self._wait_for_others() if left > 0 else [])

    def _results(
        self, engine: str | Engine, items: list[Item], classifier: Any, explainer: Any, limit: int, workers: int
    ) -> Iterator[ItemResult]:
        if not items:
            return iter(())
        kwargs = {"classifier": classifier, "explainer": explainer, "config": self.config, "limit": limit}
        if engine == "local":
            return run(self.job, items, workers=workers, claim=self.claim, **kwargs)
        assert not isinstance(engine, str)  # explain() refuses other names
        # Another engine is handed whole lists: the items are claimed before it starts.
        return engine(self.job, [item for item in items if self.claim(item)], **kwargs)

    def _take(
        self, result: ItemResult, writer: OutputWriter, progress: Callable[[ItemResult | None, int, int], None] | None
    ) -> None:
        name = result.item.name
        try:
            if result.failed:
                self.summary.failed.append({"input": name, "reason": str(result.error)})
            elif result.error is not None:
                self.summary.unreadable.append({"input": name, "reason": result.error})
            else:
                writer.write(result)
        finally:
            self.claims.release(result.item.map_file.as_posix())
        self.finished += 1
        if progress is not None:
            progress(result, self.finished, self.total)

    def _wait_for_others(self) -> list[list[Item]]:
        """The held outputs another job has let go of without finishing (it died); waits while any is held."""
        while self.deferred:
            waiting, self.deferred = self.deferred, []
            mine = [item for item in waiting if self.claim(item)]
            if mine:
                # claim() took these; the engine's own claim() call finds them held by this process already.
                return [mine]
            time.sleep(_POLL_S)
        return []

    def close(self) -> None:
        self.claims.close()


def _save_manifest(summary: Summary) -> None:
    from attr_engine.checkpoint import save_json

    save_json(summary.manifest(), summary.out / MANIFEST_DIR / f"rank{summary.rank}-of-{summary.world}.json")


def _check_something_written(summary: Summary) -> None:
    """A run whose every input was unreadable wrote nothing: that is an error, naming the reasons."""
    if summary.written or summary.already or summary.failed or summary.left or not summary.unreadable:
        return
    reasons = [f"{u['input']}: {u['reason']}" for u in summary.unreadable]
    if len(reasons) == 1:
        raise NoMapWrittenError(summary.unreadable[0]["reason"])
    shown = "; ".join(reasons[:_REASONS_SHOWN])
    more = f"; and {len(reasons) - _REASONS_SHOWN} more" if len(reasons) > _REASONS_SHOWN else ""
    raise NoMapWrittenError(f"no map written: all {len(reasons)} inputs are unreadable: {shown}{more}")
