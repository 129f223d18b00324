"""The suite computes on the CPU on any host, so that its bit-for-bit comparisons with CPU
references hold on a GPU machine too (an engine's default device, `auto`, would take the GPU):
the GPU stays hidden from every test and every process a test starts. The CUDA tests
(tests/unit/test_cuda.py) run only when asked for:

    MESHPIPE_TEST_CUDA=1 python -m pytest tests/unit/test_cuda.py
"""

from __future__ import annotations

import os

CUDA_TESTS = os.environ.get("MESHPIPE_TEST_CUDA") == "1"
if not CUDA_TESTS:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
