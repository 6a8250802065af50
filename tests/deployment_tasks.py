"""A HorovodSpark task that tests/test_deployment.py runs the way the image runs it: through
the image's entrypoint in driver mode, spark-submit and flytekit's ``pyflyte-execute``."""

from flytekit import task

from flyte_hvd.flyte import HorovodSpark


@task(task_config=HorovodSpark(num_proc=2))
def ranks(offset: int) -> list[int]:
    """Every rank contributes ``rank + offset``; rank 0 returns the gathered list."""
    import numpy as np

    import flyte_hvd.core as hvd

    return [int(v) for v in hvd.allgather(np.array([hvd.rank() + offset]))]
