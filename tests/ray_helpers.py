"""The local Ray cluster the Ray tests start: one per test module, so each module's classes travel by value."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType


@contextlib.contextmanager
def local_ray_cluster(module: ModuleType) -> Iterator[None]:
    """A local Ray cluster of 2 CPUs (2 actors of one CPU), no dashboard, no progress bars, shut down on exit.

    ``module`` (the test module) is pickled by value while it runs: the classes it defines (a dataset, an actor that
    dies on purpose) reach workers that could not import tests/.
    """
    import ray

    ray.cloudpickle.register_pickle_by_value(module)
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        yield
    finally:
        ray.shutdown()
        ray.cloudpickle.unregister_pickle_by_value(module)
