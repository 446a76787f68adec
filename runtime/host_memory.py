"""Memory this process can still get from the host.

The OS's "available" figure (``/proc/meminfo``, psutil) is the machine's; a container's memory
limit is its cgroup's and does not show there. Sized from the machine's figure, a KV pool (or a
calibration layer, `lite auto_awq --dry-run`) in a container limited below it is ended by the
kernel's OOM killer with nothing said. So the room is the smaller of the two, where the cgroup
has a limit: limit - (usage - inactive file pages), the inactive page cache being what the
kernel reclaims first (as `docker stats` counts usage).
"""

from __future__ import annotations

from pathlib import Path

import psutil

CGROUP = Path("/sys/fs/cgroup")
# (files under the memory controller: limit, usage, stat; the stat line of inactive file pages)
_V2 = ("memory.max", "memory.current", "memory.stat", "inactive_file")
_V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.stat", "total_inactive_file")


def available_bytes(root: Path = CGROUP, proc_cgroup: Path = Path("/proc/self/cgroup")) -> int:
    """Bytes a new allocation can have: the OS's available memory, capped by the cgroup's room."""
    free = psutil.virtual_memory().available
    room = cgroup_room(root, proc_cgroup)
    return free if room is None else min(free, room)


def cgroup_room(root: Path = CGROUP, proc_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """The room the process's memory cgroup leaves (v2, then v1), or None without a limit."""
    v2, v1 = _own_paths(proc_cgroup)
    for directory, files in (
        *((d, _V2) for d in (root / v2, root)),
        *((d, _V1) for d in (root / "memory" / v1, root / "memory")),
    ):
        limit, usage, stat = (directory / name for name in files[:3])
        try:
            limit_text, used = limit.read_text().strip(), int(usage.read_text())
        except (OSError, ValueError):
            continue  # not this version, or not mounted here
        if limit_text == "max" or int(limit_text) >= psutil.virtual_memory().total:
            return None  # no limit (v1 writes "no limit" as a number near 2^63)
        return max(0, int(limit_text) - used + _stat(stat, files[3]))
    return None


def _own_paths(proc_cgroup: Path) -> tuple[str, str]:
    """The process's cgroup paths, v2 (``0::/path``) and v1's memory controller, relative. In a
    container with its own cgroup namespace both are ``/``; without one they name the host's
    hierarchy, which the container's mount lacks (the callers then try the mount's root)."""
    v2 = v1 = ""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return v2, v1
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            v2 = path.lstrip("/")
        elif "memory" in controllers.split(","):
            v1 = path.lstrip("/")
    return v2, v1


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0
