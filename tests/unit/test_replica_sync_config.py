"""--dp-sync and its options: what a run refuses before any rank starts, naming flag and fix."""

from __future__ import annotations

from typing import Any

import pytest

from engine.config import ReplicaSync
from engine.training import TrainConfig

LAYOUT: dict[str, Any] = {"model": "gpt-tiny", "pp": 2, "dp": 2, "seq_len": 16}


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"dp_sync": "local-sgd", "sync_every": 0}, r"--sync-every 0 must be at least 1"),
        ({"dp_sync": "gossip"}, r"--dp-sync 'gossip': choose one of every-step, local-sgd"),
        ({"sync_every": 10}, r"--sync-every 10 applies to --dp-sync local-sgd or diloco"),
        ({"dp_sync": "local-sgd", "outer_lr": 1.0}, r"--outer-lr only apply to --dp-sync dil"),
        ({"outer_momentum": 0.0}, r"--outer-momentum only apply to --dp-sync diloco"),
        ({"dp_sync": "diloco", "outer_momentum": 1.0}, r"--outer-momentum 1.0 must be in"),
        ({"dp_sync": "diloco", "outer_lr": 0.0}, r"--outer-lr 0.0 must be > 0"),
        ({"max_staleness": 2}, r"--max-staleness 2 applies to --dp-sync parameter-server, b"),
        ({"dp_sync": "parameter-server", "max_staleness": -1}, r"--max-staleness -1 must be 0"),
        ({"dp_sync": "parameter-server", "sync_every": 4}, r"--dp-sync is parameter-server: a"),
    ],
)
def test_bad_sync_settings_are_refused_by_flag(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig.of(**LAYOUT, **settings)


@pytest.mark.parametrize("sync", ["local-sgd", "parameter-server"])
def test_semi_synchronous_sync_needs_replicas(sync: str) -> None:
    with pytest.raises(ValueError, match=r"--dp is 1: use --dp 2 or more, or drop --dp-sync"):
        TrainConfig.of(**{**LAYOUT, "dp": 1}, dp_sync=sync)


@pytest.mark.parametrize(("zero", "sync"), [(1, "diloco"), (2, "diloco"), (3, "parameter-server")])
def test_semi_synchronous_sync_refuses_zero(zero: int, sync: str) -> None:
    with pytest.raises(ValueError, match=rf"--zero {zero}: ZeRO shards .* Use --zero 0"):
        TrainConfig.of(**LAYOUT, dp_sync=sync, zero=zero, optimizer_impl="per_tensor")


def test_the_parameter_server_refuses_checkpoints() -> None:
    with pytest.raises(ValueError, match=r"parameter-server with --checkpoint-dir: the server's"):
        TrainConfig.of(**LAYOUT, dp_sync="parameter-server", checkpoint_dir="c", save_every=2)


def test_staleness_is_a_setting_of_the_parameter_server() -> None:
    sync = TrainConfig.of(**LAYOUT, dp_sync="parameter-server", max_staleness=4).replica_sync
    assert sync == ReplicaSync(dp_sync="parameter-server", max_staleness=4)


def test_checkpoints_are_taken_only_right_after_a_meeting() -> None:
    with pytest.raises(ValueError, match=r"give --save-every and --steps multiples of 4"):
        TrainConfig.of(
            **LAYOUT, dp_sync="local-sgd", sync_every=4, checkpoint_dir="c", save_every=6, steps=8
        )


def test_diloco_defaults_are_the_papers_outer_optimizer() -> None:
    sync = TrainConfig.of(**LAYOUT, dp_sync="diloco", sync_every=50).replica_sync
    assert sync == ReplicaSync(dp_sync="diloco", sync_every=50, outer_lr=0.7, outer_momentum=0.9)
