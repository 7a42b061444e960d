"""Suite-wide settings: one intra-op thread per process.

The test models are tiny, so a second thread only adds synchronisation; on a busy 2-core machine
(CI, or several suites at once) oversubscription made training tests up to 20x slower. The variable
is inherited by the servers and torchrun workers the tests start.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402  (after OMP_NUM_THREADS, which torch reads on import)

torch.set_num_threads(1)
