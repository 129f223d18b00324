"""This rank's torchft replica group: the per-step quorum its dp exchange goes through.

Under `--fault-tolerant` each pipeline replica (its pp × tp ranks) is one torchft replica
group with a world of its own (`engine.comm.replica_launch` starts it). Each rank holds a
torchft `Manager`: group rank 0 hosts the group's `ManagerServer`, which asks the Lighthouse
for a quorum each step; each rank's `ProcessGroupGloo` is then reconfigured over the same
group rank of every replica in the quorum, i.e. over the replicas of its stage, which is the
mesh's dp group made elastic. A replica behind the quorum's step (a relaunched one) receives
the state of the same group rank of a live replica through torchft's checkpoint transport.

The local launcher also hosts a small coordination store (`COORDINATOR_ENV`): replicas of
the first launch meet there before their first quorum (so all start at step 0 together), a
replica's group rank 0 records the step it last committed (a relaunch reads it to count the
steps it missed), and the launcher flags a replica it is relaunching until it is in a quorum,
so the live ones wait for it before their last step (else they could finish without it).
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import TCPStore  # type: ignore[attr-defined]

__all__ = [
    "ATTEMPT_ENV",
    "COORDINATOR_ENV",
    "LIGHTHOUSE_ENV",
    "REPLICAS_ENV",
    "REPLICA_ENV",
    "ReplicaGroup",
    "ReplicaPlace",
    "lighthouse_url",
]

LIGHTHOUSE_ENV = "MESHPIPE_FT_LIGHTHOUSE"
REPLICA_ENV = "MESHPIPE_FT_REPLICA"
REPLICAS_ENV = "MESHPIPE_FT_REPLICAS"
ATTEMPT_ENV = "MESHPIPE_FT_ATTEMPT"
COORDINATOR_ENV = "MESHPIPE_FT_COORDINATOR"


def lighthouse_url(address: str) -> str:
    """`host:port` (or a URL) as torchft's clients dial it."""
    address = address.strip()
    return address if "://" in address else f"http://{address}"


@dataclass(frozen=True, kw_only=True)
class ReplicaPlace:
    """Which replica this process belongs to and how it was launched (from the launcher's
    environment)."""

    replica: int
    replicas: int
    """The run's --dp: the replicas of a full quorum."""
    attempt: int
    """0 at the first launch, n after n relaunches of this replica."""
    lighthouse: str
    coordinator: str | None = None
    """host:port of the local launcher's coordination store (None on another machine)."""

    @staticmethod
    def from_env() -> ReplicaPlace | None:
        """This process's place, or None outside a fault-tolerant launch."""
        if LIGHTHOUSE_ENV not in os.environ:
            return None
        return ReplicaPlace(
            replica=int(os.environ[REPLICA_ENV]),
            replicas=int(os.environ[REPLICAS_ENV]),
            attempt=int(os.environ.get(ATTEMPT_ENV, "0")),
            lighthouse=os.environ[LIGHTHOUSE_ENV],
            coordinator=os.environ.get(COORDINATOR_ENV),
        )

    def env(self) -> dict[str, str]:
        """The variables `from_env` reads."""
        env = {
            LIGHTHOUSE_ENV: self.lighthouse,
            REPLICA_ENV: str(self.replica),
            REPLICAS_ENV: str(self.replicas),
            ATTEMPT_ENV: str(self.attempt),
        }
        if self.coordinator is not None:
            env[COORDINATOR_ENV] = self.coordinator
        return env


class ReplicaGroup:
    """This rank's torchft `Manager` and the meshpipe-side bookkeeping around it."""

    def __init__(self, place: ReplicaPlace, *, timeout_s: float) -> None:
        from torchft import Manager, ProcessGroupGloo

        # torchft logs each peer's failure with a traceback; `refusal` says it in a line
        logging.getLogger("torchft").setLevel(logging.CRITICAL)
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        self.place, self._timeout_s = place, timeout_s
        self.group_rank = int(os.environ.get("RANK", "0"))
        timeout = timedelta(seconds=timeout_s)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=None,
            state_dict=None,
            min_replica_size=1,
            use_async_quorum=False,  # heal before the forward: the step runs on the new weights
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
            rank=self.group_rank,
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
            store_addr=os.environ["MASTER_ADDR"],
            store_port=int(os.environ["MASTER_PORT"]),
            lighthouse_addr=lighthouse_url(place.lighthouse),
            replica_id=f"meshpipe_replica_{place.replica}",
            hostname=os.environ["MASTER_ADDR"],
            init_sync=False,  # every replica builds the same seeded weights
        )
        self._coordinator = _connect(place.coordinator, timeout)
        self.died_at = self._read_int(f"step/{place.replica}") if place.attempt else None
        """A relaunched replica: the step its previous attempt last committed."""
        self._in = False
        self.healed: tuple[int, int] | None = None
        """(step before, step after) of the heal that brought this replica up to date."""

    @property
    def missed_steps(self) -> int:
        """Steps the quorum committed while this replica was dead or behind (0 if it never
        healed)."""
        if self.healed is None:
            return 0
        before, after = self.healed
        return after - (self.died_at if self.died_at is not None else before)

    def register_state(self, load: Callable[[Any], None], save: Callable[[], Any]) -> None:
        """What a live replica sends a healing one (this rank's share of the replica)."""
        self.manager.register_state_dict_fn("meshpipe", load, save)

    def set_step(self, step: int) -> None:
        """Start counting at `step` (a resumed checkpoint's)."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

    @property
    def step(self) -> int:
        """Steps committed so far (by this replica or, after a heal, by its source)."""
        return self.manager.current_step()

    def joined(self) -> None:
        """The Manager is up (its group heartbeats to the Lighthouse). First launch: wait for
        every replica's, so the first quorum holds them all from step 0."""
        store = self._coordinator
        if store is None or self.group_rank != 0 or self.place.attempt:
            return
        store.add("started", 1)
        self._wait(lambda: store.add("started", 0) >= self.place.replicas, "every replica")

    def begin_step(self, *, last: bool = False) -> int:
        """The step's quorum (and the heal, if this replica is behind); the step to run.

        Before the `last` step a live replica asks again while the launcher is relaunching
        a peer that is not in the quorum yet: the Lighthouse forms a quorum at once when the
        previous one's members have asked, so only a peer already waiting gets in, and the
        relaunched replica could otherwise find nobody left to heal from."""
        before = self.step
        self.manager.start_quorum()
        deadline = time.monotonic() + self._timeout_s
        while last and self.participants() < self.place.replicas and self._relaunching():
            if time.monotonic() > deadline:
                break  # train the last step without it rather than wait forever
            time.sleep(0.1)
            self.manager.start_quorum()
        if self.step != before and self.healed is None:
            self.healed = (before, self.step)
        store = self._coordinator
        if self.place.attempt and self.group_rank == 0 and store is not None and not self._in:
            store.set(f"relaunching/{self.place.replica}", "0")  # in a quorum now
            self._in = True
        return self.step

    def all_reduce(self, tensor: torch.Tensor) -> Any:
        """Average `tensor` over the quorum's replicas (torchft's Work; errors are recorded
        by the Manager and make `commit` refuse the step)."""
        return self.manager.allreduce(tensor)

    def commit(self) -> bool:
        """Whether every rank of this replica may step its optimizer (torchft's verdict)."""
        committed = bool(self.manager.should_commit())
        if committed and self.group_rank == 0 and self._coordinator is not None:
            self._coordinator.set(f"step/{self.place.replica}", str(self.step))
        return committed

    def refusal(self, step: int) -> str:
        """Why torchft did not commit `step` (0-based), in a line."""
        error = self.manager.errored()
        cause = str(getattr(error, "original_exception", error)) if error else ""
        cause = cause.splitlines()[0].split(". This is typically")[0] if cause else ""
        return (
            f"replica {self.place.replica}: step {step + 1} was not committed "
            f"({cause or 'too few replicas'}); it runs again under the next quorum"
        )

    def participants(self) -> int:
        """Replicas in this step's quorum."""
        return self.manager.num_participants()

    def _relaunching(self) -> bool:
        """Whether the launcher is relaunching another replica that has not rejoined."""
        others = [r for r in range(self.place.replicas) if r != self.place.replica]
        return any(self._read_int(f"relaunching/{r}") == 1 for r in others)

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)

    def _read_int(self, key: str) -> int | None:
        store = self._coordinator
        if store is None or not store.check([key]):
            return None
        return int(store.get(key))

    def _wait(self, done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self._timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"replica {self.place.replica} waited {self._timeout_s:.0f} s for {what} "
                    "(--timeout): the launcher's other replicas did not come up"
                )
            time.sleep(0.05)


def _connect(address: str | None, timeout: timedelta) -> TCPStore | None:
    if address is None:
        return None
    host, port = address.rsplit(":", 1)
    return TCPStore(host, int(port), is_master=False, timeout=timeout, wait_for_workers=False)
