"""Names of one lab's resources, unique to the run, and the owner record stale cleanup reads.

Every namespace is called ``fsdplab-<owner pid>-<token>-<role>``, and the run's working
directory ``/tmp/fsdplab-<owner pid>-<token>`` holds ``owner.json`` (the owner's pid and
start time). Two labs never share a name, and cleanup can tell a dead lab's leftovers from a
live lab's resources without touching anything outside the prefix.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PREFIX", "RUN_ID", "RunNames", "owner_alive", "process_start_time"]

PREFIX = "fsdplab"
RUN_ID = re.compile(rf"^({PREFIX}-(\d+)-([0-9a-f]{{6}}))(?:-.*)?$")
ETC_NETNS = Path("/etc/netns")  # `ip netns exec NS` bind-mounts /etc/netns/NS/* over /etc
# not $TMPDIR: a lab started under another TMPDIR must still be found (and its ssh keys
# removed) by the stale cleanup of a lab started without it
WORKDIR_ROOT = Path("/tmp")


@dataclass(frozen=True)
class RunNames:
    owner_pid: int
    token: str

    @classmethod
    def new(cls) -> RunNames:
        return cls(os.getpid(), secrets.token_hex(3))

    @classmethod
    def parse(cls, name: str) -> RunNames | None:
        """The run a resource name belongs to, or None when it is not a lab name."""
        match = RUN_ID.match(name)
        return cls(int(match.group(2)), match.group(3)) if match else None

    @property
    def run_id(self) -> str:
        return f"{PREFIX}-{self.owner_pid}-{self.token}"

    def node(self, index: int) -> str:
        return f"{self.run_id}-node{index}"

    @property
    def switch(self) -> str:
        return f"{self.run_id}-switch"

    @property
    def storage(self) -> str:
        return f"{self.run_id}-storage"

    @property
    def infra(self) -> str:
        return f"{self.run_id}-infra"

    @property
    def probe(self) -> str:
        return f"{self.run_id}-probe"

    @property
    def workdir(self) -> Path:
        return WORKDIR_ROOT / self.run_id

    def write_owner(self) -> None:
        """Record who owns the run (pid and start time, so a reused pid is not mistaken)."""
        self.workdir.mkdir(mode=0o700, parents=True, exist_ok=False)
        record = {"pid": self.owner_pid, "start_time": process_start_time(self.owner_pid)}
        (self.workdir / "owner.json").write_text(json.dumps(record))

    def owner_is_alive(self) -> bool:
        """False once the owner has exited; a run without a record is judged by its pid."""
        try:
            record = json.loads((self.workdir / "owner.json").read_text())
        except (OSError, ValueError):
            record = {"pid": self.owner_pid, "start_time": None}
        return owner_alive(record["pid"], record.get("start_time"))


def process_start_time(pid: int) -> int | None:
    """Clock ticks after boot at which ``pid`` started (field 22 of /proc/PID/stat)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":  # exited, not yet reaped
        return None
    return int(fields[19])


def owner_alive(pid: int, start_time: int | None) -> bool:
    now = process_start_time(pid)
    return now is not None and (start_time is None or now == start_time)
