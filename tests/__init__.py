"""gpukit's test suite.

OpenMP's threads wait for work asleep here rather than spinning (``OMP_WAIT_POLICY=PASSIVE``,
unless the caller set it): the suite runs two pytest workers and their ranks on a few cores,
where a rank's spinning threads take the CPU from the processes that have work (a two-rank
FSDP test file took half the CPU with it). No result depends on it. It is set here because
torch's OpenMP runtime reads it once, when torch is first imported: this package is imported
before any test module or conftest, and ranks and commands inherit it.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
