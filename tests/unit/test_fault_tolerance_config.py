"""--fault-tolerant and its flags: what a run refuses before any rank starts, naming flag and
fix; an unreachable --lighthouse is refused within its timeout, never a hang."""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest

from engine.comm.launch import free_port
from engine.comm.replica_group import lighthouse_url
from engine.comm.replica_launch import check_lighthouse
from engine.training import TrainConfig

LAYOUT: dict[str, Any] = {"model": "gpt-tiny", "pp": 2, "dp": 2, "seq_len": 16}


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"dp": 1, "fault_tolerant": True}, r"--dp is 1: use --dp 2 or more, or drop --fault-"),
        ({"fault_tolerant": True, "zero": 1}, r"--fault-tolerant with --zero 1: .* use --zero 0"),
        ({"fault_tolerant": True, "dp_sync": "diloco", "sync_every": 2}, r"--dp-sync diloco"),
        ({"fault_tolerant": True, "tp": 2}, r"--fault-tolerant with --tp 2: .* use --tp 1"),
        ({"lighthouse": "host:1"}, r"--lighthouse and --replica-id apply to --fault-tolerant"),
        ({"fault_tolerant": True, "replica_id": 1}, r"--replica-id 1 .* add --lighthouse"),
        (
            {"fault_tolerant": True, "lighthouse": "h:1", "replica_id": 2},
            r"--replica-id 2 is out of range for --dp 2: use 0 to 1",
        ),
        ({"fault_tolerant": True, "lighthouse": " "}, r"--lighthouse is empty"),
    ],
)
def test_bad_fault_tolerant_settings_are_refused_by_flag(
    settings: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig.of(**{**LAYOUT, **settings})


def test_fault_tolerant_relaunches_need_no_resume() -> None:
    """A relaunched replica heals from a live one: --max-restarts needs no --resume here."""
    config = TrainConfig.of(**LAYOUT, fault_tolerant=True, max_restarts=2)
    assert config.fault_tolerance.fault_tolerant and config.run.max_restarts == 2
    with pytest.raises(ValueError, match=r"--max-restarts 2 restarts would start over"):
        TrainConfig.of(**LAYOUT, max_restarts=2)


def test_an_unreachable_lighthouse_is_refused_at_once() -> None:
    port = free_port()  # nothing listens there
    start = time.monotonic()
    with pytest.raises(ValueError, match=rf"--lighthouse 127.0.0.1:{port}: no Lighthouse .*"
                       r"torchft_lighthouse --min_replicas 1"):  # fmt: skip
        check_lighthouse(f"127.0.0.1:{port}", timeout_s=2.0)
    assert time.monotonic() - start < 2.5


def test_a_listening_lighthouse_address_passes() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        check_lighthouse(f"http://127.0.0.1:{server.getsockname()[1]}")


def test_a_lighthouse_address_without_a_port_is_refused() -> None:
    with pytest.raises(ValueError, match=r"--lighthouse 'somehost': give HOST:PORT"):
        check_lighthouse("somehost")
    assert lighthouse_url("h:29510") == "http://h:29510"
