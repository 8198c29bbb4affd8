"""The local Ray cluster the Ray tests start: one per test module, so each module's classes travel by value."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from types import ModuleType


@contextlib.contextmanager
def local_ray_cluster(module: ModuleType) -> Iterator[None]:
    """A local Ray cluster of 2 CPUs (:func:`start_local_ray`), no progress bars, shut down on exit.

    ``module`` (the test module) is pickled by value while it runs: the classes it defines (a dataset, an actor that
    dies on purpose) reach workers that could not import tests/.
    """
    import ray

    ray.cloudpickle.register_pickle_by_value(module)
    start_local_ray()
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        yield
    finally:
        ray.shutdown()
        ray.cloudpickle.unregister_pickle_by_value(module)


def start_local_ray() -> None:
    """``ray.init`` of a new local cluster of 2 CPUs, no dashboard, its workers at niceness 0.

    Ray starts its workers at niceness 15 (the raylet's ``worker_niceness``). Beside a process at niceness 0 that
    keeps both cores busy (a benchmark run while the suite runs) such a worker gets a few per cent of a core: an
    actor took minutes to import torch, and a pool of two actors looked as if it waited for resources without end
    (both CPUs reserved by actors still in ``__init__``). At niceness 0 the actors share the cores with whatever
    else runs, as the test process itself does; on a quiet machine nothing changes.
    """
    import ray

    # Only this variable is put back afterwards, not the whole environment (``mock.patch.dict`` would): ray.init
    # sets variables of its own in it (``RAY_AUTH_MODE=token``) that the processes the tests start need to join
    # the cluster; without them ``attr-engine serve --address`` is refused (missing authentication token).
    previous = os.environ.get("RAY_worker_niceness")
    os.environ["RAY_worker_niceness"] = "0"  # read by the raylet that ray.init starts
    try:
        ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    finally:
        if previous is None:
            del os.environ["RAY_worker_niceness"]
        else:
            os.environ["RAY_worker_niceness"] = previous


def wait_for_free_cpus(seconds: float = 30.0) -> float:
    """Seconds until every CPU of the connected cluster is free again (its actors gone); AssertionError after
    ``seconds``. A pool that keeps its actors after it failed makes the next pool on the cluster wait for ever."""
    import time

    import ray

    total, start = ray.cluster_resources().get("CPU", 0.0), time.monotonic()
    while (free := ray.available_resources().get("CPU", 0.0)) < total:
        assert time.monotonic() - start < seconds, f"{total - free:g} of {total:g} CPUs still held after {seconds} s"
        time.sleep(0.5)
    return time.monotonic() - start
