"""How much host memory the kernel's page cache can give this process: `MemAvailable`
(/proc/meminfo), capped by the memory limit of the process's own cgroup (v2 `memory.max`,
v1 `memory.limit_in_bytes`; both charge the page cache to the cgroup) less what the cgroup
already uses.

`--expert-direct-io auto` reads expert misses past the page cache (O_DIRECT) when the
checkpoint's routed experts do not fit in this room: the cache would only thrash, and every
buffered read would pay a copy out of it.
"""

from __future__ import annotations

import os

PROC_MEMINFO = "/proc/meminfo"
PROC_SELF_CGROUP = "/proc/self/cgroup"
CGROUP_ROOT = "/sys/fs/cgroup"
NO_LIMIT = 1 << 60
"""cgroup v1 reports "no limit" as a huge number (PAGE_COUNTER_MAX pages); anything at or
above this many bytes counts as no limit."""


def read_sys_text(path: str) -> str | None:
    """The stripped text of a small system file (/proc, /sys/fs/cgroup), or None when it cannot be
    read (absent: no such cgroup or controller)."""
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def mem_available(meminfo: str = PROC_MEMINFO) -> int | None:
    """`MemAvailable` of `meminfo` in bytes (the kernel's estimate of memory that can be given to
    a new workload, page cache included), or None where the file or the field is missing."""
    text = read_sys_text(meminfo)
    for line in (text or "").splitlines():
        name, _, value = line.partition(":")
        parts = value.split()
        if name == "MemAvailable" and parts and parts[0].isdigit():
            return int(parts[0]) * 1024  # kB
    return None


def cgroup_memory_room(self_cgroup: str = PROC_SELF_CGROUP, root: str = CGROUP_ROOT) -> int | None:
    """Bytes the process's own memory cgroup may still charge (limit - usage), or None when it has
    no limit or none can be read. cgroup v2: the "0::PATH" line of `self_cgroup`, files
    `memory.max` ("max": no limit) and `memory.current`; cgroup v1: the line naming the
    `memory` controller, files `memory.limit_in_bytes` and `memory.usage_in_bytes` under
    `root`/memory."""
    text = read_sys_text(self_cgroup) or ""
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            limit_file, usage_file, base = "memory.max", "memory.current", root
        elif "memory" in controllers.split(","):
            limit_file, usage_file, base = "memory.limit_in_bytes", "memory.usage_in_bytes", os.path.join(root, "memory")
        else:
            continue
        directory = os.path.join(base, path.lstrip("/"))
        limit, usage = (read_sys_text(os.path.join(directory, name)) for name in (limit_file, usage_file))
        if limit is None or not limit.isdigit() or int(limit) >= NO_LIMIT:
            continue  # "max", unreadable or no limit: try the other hierarchy's line
        return max(0, int(limit) - (int(usage) if usage is not None and usage.isdigit() else 0))
    return None


def page_cache_room(meminfo: str = PROC_MEMINFO, self_cgroup: str = PROC_SELF_CGROUP,
                    root: str = CGROUP_ROOT) -> int | None:
    """Bytes of host memory the page cache can hold for this process: the smaller of
    `mem_available` and `cgroup_memory_room`, or None when neither can be read."""
    room = [r for r in (mem_available(meminfo), cgroup_memory_room(self_cgroup, root)) if r is not None]
    return min(room) if room else None
