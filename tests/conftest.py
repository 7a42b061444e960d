"""Suite-wide settings: one intra-op thread per process, and the ``cuda`` marker's skip without a GPU.

The test models are tiny, so a second thread only adds synchronisation; on a busy 2-core machine
(CI, or several suites at once) oversubscription made training tests up to 20x slower. The variable
is inherited by the servers and torchrun workers the tests start.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402  (after OMP_NUM_THREADS, which torch reads on import)

# Helper modules that assert: pytest rewrites their asserts too, so a failure shows the compared values.
pytest.register_assert_rewrite("tests.helpers", "tests.hf_compare", "tests.model.hf_marian", "tests.model.lora_toy",
                               "tests.reliability.helpers", "tests.service.fixtures")

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked ``cuda`` skip, with the reason, where torch sees no CUDA device (scripts/gpu-check runs them)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: torch.cuda.is_available() is False")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
