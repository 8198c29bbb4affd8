"""Folder jobs: attribution maps for every image under a folder, resumable, shardable and shared, from Python or the
command line.

::

    from attr_engine import jobs

    job = jobs.AttributionJob(method="saliency", classifier="runs/clf/classifier.safetensors")
    summary = jobs.explain(job, "photos/", "maps/")  # a rerun does only what is missing
    print(len(summary.written), "maps;", len(summary.already), "already done")

- :class:`AttributionJob` (:mod:`~attr_engine.jobs.job`): what to explain with, as plain values that pickle in bytes;
  every engine rebuilds the same classifier and method from it. :func:`job_settings` / :func:`settings_digest`:
  what an output directory records of it.
- :func:`list_inputs`, :class:`Item`, :class:`ItemResult` (:mod:`~attr_engine.jobs.inputs`): the inputs and one
  input's outcome.
- :func:`run` (:mod:`~attr_engine.jobs.local`): the local engine; :class:`attr_engine.ray.RayEngine` the Ray one.
- :class:`OutputWriter`, :func:`read_journal`, :func:`valid_output` (:mod:`~attr_engine.jobs.outputs`): files
  written atomically, the journal, what a rerun may skip.
- :func:`explain` (:mod:`~attr_engine.jobs.runner`): the whole run (plan, shard, resume, claim, write), the one
  ``attr-engine explain`` calls.

torch is imported by the functions that need it, so defining a job costs nothing.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from attr_engine.jobs.inputs import Item, ItemResult, list_inputs
from attr_engine.jobs.job import (
    FORMATS,
    FRAMES,
    MAP_DTYPES,
    SETTINGS_FILE,
    AttributionJob,
    check_recorded_settings,
    job_settings,
    settings_digest,
)
from attr_engine.jobs.local import run
from attr_engine.jobs.outputs import (
    JOURNAL_SUFFIX,
    MANIFEST_DIR,
    Journal,
    OutputWriter,
    read_journal,
    remove_stale_temporaries,
    valid_output,
)
from attr_engine.jobs.runner import Engine, NoMapWrittenError, Summary, explain

if TYPE_CHECKING:
    import torch

    from attr_engine.classifier import Classifier
    from attr_engine.explainer import Explainer

__all__ = [
    "FORMATS",
    "FRAMES",
    "JOURNAL_SUFFIX",
    "MANIFEST_DIR",
    "MAP_DTYPES",
    "SETTINGS_FILE",
    "AttributionJob",
    "Engine",
    "Item",
    "ItemResult",
    "Journal",
    "NoMapWrittenError",
    "OutputWriter",
    "Summary",
    "build_classifier",
    "build_explainer",
    "check_recorded_settings",
    "explain",
    "job_settings",
    "list_inputs",
    "read_journal",
    "remove_stale_temporaries",
    "run",
    "settings_digest",
    "valid_output",
]


def build_classifier(job: AttributionJob, device: torch.device | str = "cpu") -> Classifier:
    """Deprecated (the README's 0.x name): use ``job.load_classifier(device)``."""
    warnings.warn("jobs.build_classifier(job) is deprecated: use job.load_classifier()", DeprecationWarning, 2)
    return job.load_classifier(device)


def build_explainer(job: AttributionJob, classifier: Classifier) -> Explainer | Any:
    """Deprecated (the README's 0.x name): use ``job.get_explainer(classifier)``."""
    warnings.warn("jobs.build_explainer(job, clf) is deprecated: use job.get_explainer(clf)", DeprecationWarning, 2)
    return job.get_explainer(classifier)
