"""The cores this process may use, not the machine's: what a container's cpuset and CPU
quota leave it. The offline model's runs, the search slots and the parse processes are
sized by it (docs/configuration.md)."""

from __future__ import annotations

import math
import os
from pathlib import Path


def usable_cores(cgroup_root: Path | None = None) -> int:
    """The cores this process may use, not the machine's: its affinity (which a container's
    cpuset sets), capped by its cgroup's CPU quota (``docker --cpus``, Kubernetes'
    ``limits.cpu``), which the affinity does not show. ``cgroup_root``: where ``/proc`` and
    ``/sys`` are read from (tests give a folder of fake files; default ``CGROUP_ROOT``)."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity outside Linux
        affinity = os.cpu_count() or 1
    quota = cgroup_cpu_quota(CGROUP_ROOT if cgroup_root is None else cgroup_root)
    return affinity if quota is None else max(1, min(affinity, quota))


# Read when usable_cores is called, so a test can point it at fake files.
CGROUP_ROOT: Path = Path("/")


def cpu_quota() -> int | None:
    """The CPUs this process's cgroup quota allows (cgroup_cpu_quota), or None: for a start
    log line to say which bound sized the process, the affinity or the quota."""
    return cgroup_cpu_quota(CGROUP_ROOT)


def cgroup_cpu_quota(root: Path) -> int | None:
    """The CPUs the process's cgroup quota allows, rounded up (1.5 CPUs: 2), or None: no
    quota, no cgroup, or nothing readable. The lowest quota of the process's own cgroup and
    its ancestors up to the mount (a container usually sees its own cgroup as the mount
    root), cgroup v2 ``cpu.max`` and v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us`` alike."""
    quotas = [
        quota
        for folder in _cpu_cgroup_folders(root)
        if (quota := _folder_quota(folder)) is not None
    ]
    return min(quotas, default=None)


def _cpu_cgroup_folders(root: Path) -> list[Path]:
    mounts = root / "sys" / "fs" / "cgroup"
    # Without /proc/self/cgroup, the mounts' roots alone.
    memberships = [("", "/"), ("cpu", "/")]
    try:
        lines = (root / "proc" / "self" / "cgroup").read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        lines = []
    for line in lines:
        parts = line.split(":", 2)
        # A path with ".." (a process outside its cgroup namespace's root) names no folder
        # under the mount: the mount's root alone then.
        if ".." in parts[-1].split("/"):
            continue
        if len(parts) == 3 and (parts[1] == "" or "cpu" in parts[1].split(",")):
            memberships.append((parts[1], parts[2]))
    folders = []
    for controllers, path in memberships:
        # v2: one hierarchy at the mount; v1: the cpu controller's own mount.
        for mount in [mounts] if controllers == "" else [mounts / controllers, mounts / "cpu"]:
            folder = mount / path.strip("/")
            folders += [up for up in (folder, *folder.parents) if up.is_relative_to(mount)]
    return folders


def _folder_quota(folder: Path) -> int | None:
    try:
        if (folder / "cpu.max").is_file():
            quota, period = (folder / "cpu.max").read_text().split()
            if quota == "max":
                return None
        elif (folder / "cpu.cfs_quota_us").is_file():
            quota = (folder / "cpu.cfs_quota_us").read_text().strip()
            period = (folder / "cpu.cfs_period_us").read_text().strip()
        else:
            return None
        cpus, periods = int(quota), int(period)
    except (OSError, UnicodeDecodeError, ValueError):  # unreadable or garbage: no quota
        return None
    if cpus <= 0 or periods <= 0:  # v1 writes -1 for none
        return None
    return max(1, math.ceil(cpus / periods))
