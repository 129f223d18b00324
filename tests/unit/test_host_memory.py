"""On the CPU the engine keeps freed host memory for reuse (glibc's thresholds raised), unless
the process set glibc's own; each case runs in a fresh interpreter, since the setting is the
process's."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.runtime import host_memory

ROOT = Path(__file__).resolve().parents[2]

_ENGINE = """
import resource, torch
import engine.runtime.engine as runtime
from engine.comm.mesh import init_mesh
from engine.runtime.engine import PipelineEngine
from models import layer_specs
from partitioners import Partition
kept = []
runtime.keep_freed_host_memory = lambda: kept.append(True)
specs = layer_specs("gpt-tiny")
PipelineEngine(specs, init_mesh(1, 1), partition=Partition(boundaries=(0, len(specs))),
               micro_batches=2)
print(kept)
"""

_PROFILE = """
import engine.plan.profile as profile
from models import layer_specs
from partitioners import Partition
kept = []
profile.keep_freed_host_memory = lambda: kept.append(True)
specs = layer_specs("gpt-tiny")
profile.measured_forward(specs, 1, 16, repeats=1)
profile.profile_stage_costs(specs, Partition(boundaries=(0, len(specs))), seq_len=16, repeats=1)
print(kept)
"""

_FREED = """
import ctypes
from engine.runtime.host_memory import keep_freed_host_memory
print(keep_freed_host_memory())
libc = ctypes.CDLL(None)
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks",
                "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = Info
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
block = libc.malloc(20 * 2**20)
ctypes.memset(block, 1, 20 * 2**20)
libc.free(block)
print(libc.mallinfo2().keepcost)  # free bytes at the heap's top, not handed back
"""


def _python(script: str, **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**clean, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return done.stdout.split("\n")[:-1]


def test_an_engine_on_the_cpu_keeps_freed_host_memory() -> None:
    assert _python(_ENGINE)[-1] == "[True]"


def test_the_planner_s_profile_times_layers_with_freed_memory_kept_as_the_engine_runs() -> None:
    assert _python(_PROFILE)[-1] == "[True, True]"


@pytest.mark.skipif(
    sys.platform != "linux" or not hasattr(ctypes.CDLL(None), "mallinfo2"),
    reason="glibc 2.33 or later reports what it keeps",
)
def test_a_freed_block_stays_in_the_process_for_the_next_allocation() -> None:
    applied, kept = _python(_FREED)
    assert applied == "True"
    assert int(kept) >= 20 * 2**20
    _, handed_back = _python(_FREED, MALLOC_TRIM_THRESHOLD_="131072")  # glibc's default
    assert int(handed_back) < 2**20


@pytest.mark.parametrize("name", ["MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"])
def test_a_process_that_set_glibc_s_thresholds_keeps_its_own(name: str) -> None:
    assert _python(_FREED, **{name: "131072"})[0] == "False"


def test_off_linux_nothing_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_memory.sys, "platform", "darwin")
    assert host_memory.keep_freed_host_memory.__wrapped__() is False
