"""The host memory a KV pool or a calibration layer is sized from: the OS's available memory,
capped by the process's cgroup limit (a container's, which /proc/meminfo does not show). The
cgroup trees are written here in the kernel's file formats, v2 and v1."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from runtime import host_memory

GIB = 2**30


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def _proc(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "proc-self-cgroup"
    path.write_text(text)
    return path


def test_a_v2_container_limit_caps_the_room(tmp_path: Path) -> None:
    root = _tree(
        tmp_path / "cg",
        {
            "memory.max": f"{GIB}\n",
            "memory.current": f"{GIB // 2}\n",
            "memory.stat": f"anon {GIB // 4}\ninactive_file {GIB // 8}\nactive_file 4096\n",
        },
    )
    proc = _proc(tmp_path, "0::/\n")
    room = GIB - GIB // 2 + GIB // 8  # the inactive page cache is reclaimed first
    assert host_memory.cgroup_room(root, proc) == room
    assert host_memory.available_bytes(root, proc) == min(room, psutil.virtual_memory().available)


def test_the_process_own_v2_cgroup_is_read_where_it_is_mounted(tmp_path: Path) -> None:
    """Without a cgroup namespace /proc/self/cgroup names the process's place in the host's
    hierarchy; the limit is there, not at the root."""
    root = _tree(
        tmp_path / "cg",
        {
            "memory.max": "max\n",
            "memory.current": f"{8 * GIB}\n",
            "app.slice/job.scope/memory.max": f"{2 * GIB}\n",
            "app.slice/job.scope/memory.current": f"{GIB}\n",
        },
    )
    proc = _proc(tmp_path, "0::/app.slice/job.scope\n")
    assert host_memory.cgroup_room(root, proc) == GIB  # no memory.stat: nothing reclaimable


def test_no_limit_leaves_the_os_figure(tmp_path: Path) -> None:
    v2 = _tree(tmp_path / "v2", {"memory.max": "max\n", "memory.current": "123\n"})
    assert host_memory.cgroup_room(v2, _proc(tmp_path, "0::/\n")) is None
    unlimited = str(9223372036854771712)  # how v1 writes "no limit"
    v1 = _tree(
        tmp_path / "v1",
        {"memory/memory.limit_in_bytes": unlimited, "memory/memory.usage_in_bytes": "4096"},
    )
    assert host_memory.cgroup_room(v1, _proc(tmp_path, "4:memory:/\n")) is None
    nothing = tmp_path / "no-cgroup-fs"
    nothing.mkdir()
    assert host_memory.cgroup_room(nothing, tmp_path / "no-such-file") is None


@pytest.mark.parametrize("own", ["/", "/docker/0123abcd"])
def test_a_v1_limit_caps_the_room(tmp_path: Path, own: str) -> None:
    """v1's memory controller, where a container's mount holds its own cgroup at the root
    while /proc/self/cgroup names the host's path for it."""
    root = _tree(
        tmp_path / "cg",
        {
            "memory/memory.limit_in_bytes": f"{4 * GIB}\n",
            "memory/memory.usage_in_bytes": f"{3 * GIB}\n",
            "memory/memory.stat": f"cache {GIB}\ninactive_file 1\ntotal_inactive_file {GIB}\n",
        },
    )
    proc = _proc(tmp_path, f"12:pids:/\n5:memory:{own}\n1:name=systemd:/\n")
    assert host_memory.cgroup_room(root, proc) == 2 * GIB
    over = _tree(
        tmp_path / "over",
        {"memory/memory.limit_in_bytes": "100", "memory/memory.usage_in_bytes": "200"},
    )
    assert host_memory.cgroup_room(over, proc) == 0


def test_this_host() -> None:
    """Whatever cgroup this test runs in, the room is at most the OS's available memory."""
    assert 0 <= host_memory.available_bytes() <= psutil.virtual_memory().total
