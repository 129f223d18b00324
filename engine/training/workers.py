"""The entry points of the ranks `meshpipe train` launches: `train` with the rank's heartbeat
record for the launcher's watchdog, Ctrl-C ended quietly, and a checkpoint's error returned
instead of raised so that --max-restarts does not retry what fails the same way each time."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from dataclasses import dataclass

import torch.distributed as dist

from engine.checkpoint.files import CheckpointError
from engine.comm.heartbeat import HEARTBEAT_DIR_ENV, Heartbeat
from engine.comm.mesh import coordinates
from engine.training.config import TrainConfig
from engine.training.loop import TrainResult, train

__all__ = ["Refused", "local_worker", "train_worker"]


def _heartbeat(config: TrainConfig) -> contextlib.AbstractContextManager[object]:
    """This rank's heartbeat record where the local launcher reads them (else nothing)."""
    folder = os.environ.get(HEARTBEAT_DIR_ENV)
    if folder is None or "RANK" not in os.environ:
        return contextlib.nullcontext()
    rank = int(os.environ["RANK"])
    layout = config.parallel
    pp_rank, dp_rank, tp_rank = coordinates(
        rank, dp=layout.dp, tp=layout.tp, pp=layout.pp, order=layout.mesh_order
    )
    stages = config.schedule.stages_per_rank
    where = (
        f"stage {pp_rank} of {layout.pp}"
        if stages == 1
        else f"pipeline rank {pp_rank} of {layout.pp} ({stages} stages each)"
    )
    where += f", dp replica {dp_rank}" if layout.dp > 1 else ""
    where += f", tp rank {tp_rank}" if layout.tp > 1 else ""
    return Heartbeat(folder, rank=rank, where=where)


def train_worker(config: TrainConfig, progress: bool) -> TrainResult:
    """Entry point of each locally launched rank. Ctrl-C reaches every rank of the terminal's
    process group; the launcher reports it once, so a rank ends without a traceback."""
    try:
        with _heartbeat(config):
            return train(config, progress=progress)
    except KeyboardInterrupt:
        if "LOCAL_RANK" not in os.environ:
            raise
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the agent passes the signal on too
        sys.exit(130)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass(frozen=True)
class Refused:
    """A checkpoint's error (corrupt, incomplete, another model), returned instead of raised
    under the local launcher: its agent restarts failed ranks (--max-restarts), and the same
    checkpoint would fail the same way each time."""

    error: str
    """"CheckpointError: message"."""


def local_worker(config: TrainConfig, progress: bool) -> TrainResult | Refused:
    """Entry point of each rank `meshpipe train` launches itself: `train_worker`, with a
    `CheckpointError` returned as `Refused`. Every rank raises a checkpoint's error together
    (they agree on each load and save), so all of them return; other errors may strike one
    rank alone, whose peers would then wait out --timeout for it: those still fail the rank."""
    try:
        return train_worker(config, progress)
    except CheckpointError as error:
        return Refused(f"{type(error).__name__}: {error}")
