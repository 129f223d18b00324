"""The suite computes on the CPU on any host, so that its bit-for-bit comparisons with CPU
references hold on a GPU machine too (an engine's default device, `auto`, would take the GPU):
the GPU stays hidden from every test and every process a test starts. The CUDA tests
(tests/unit/test_cuda.py) run only when asked for:

    MESHPIPE_TEST_CUDA=1 python -m pytest tests/unit/test_cuda.py
"""

from __future__ import annotations

import os

CUDA_TESTS = os.environ.get("MESHPIPE_TEST_CUDA") == "1"
# Every trace made afresh (and none written to the home folder); tests/unit/test_trace_cache.py
# turns the cache on in a folder of its own.
os.environ.setdefault("MESHPIPE_TRACE_CACHE", "off")
if not CUDA_TESTS:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def pytest_sessionstart(session: object) -> None:
    """Build DeepSpeed's CPU Adam extension once, before any test and outside every test's
    timeout: its first JIT compile takes from under a minute to several on a busy 2-core
    machine, and a test killed by its timeout mid-compile leaves torch's build lock behind,
    so every later test that needs the extension would wait on that lock forever."""
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder
    except ImportError:
        return
    try:
        CPUAdamBuilder().load(verbose=False)
    except Exception as error:  # the tests that need it fail with the builder's own words
        print(f"DeepSpeed CPU Adam did not build ({error}); its tests will say why")
