"""`--threads auto` (moestream.threads): the cgroup CPU quota caps the affinity count, a
loaded machine gets fewer threads (logged), and `slow_step_hint` words the advice when a
run's decode rate collapsed. Files and load are injected: nothing here reads the machine's
own quota or load."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from moestream.threads import available_cores, cgroup_cpu_limit, free_cores, resolve_threads, slow_step_hint

AFFINITY = len(os.sched_getaffinity(0))
CPUS = os.cpu_count()


def cpu_max(tmp_path: Path, text: str) -> str:
    path = tmp_path / "cpu.max"
    path.write_text(text + "\n")
    return str(path)


def no_v1(tmp_path: Path) -> str:
    return str(tmp_path / "no-cgroup-v1")


@pytest.mark.parametrize("text, cpus", [("max 100000", None), ("150000 100000", 2), ("50000 100000", 1),
                                        ("200000 100000", 2), ("1 100000", 1), ("400000 50000", 8)])
def test_cgroup_v2_quota_is_rounded_up(tmp_path: Path, text: str, cpus: int | None) -> None:
    assert cgroup_cpu_limit(cpu_max(tmp_path, text), no_v1(tmp_path)) == cpus


@pytest.mark.parametrize("text, cpus", [("max 100000", AFFINITY), ("150000 100000", min(AFFINITY, 2)),
                                        ("50000 100000", 1)])
def test_auto_is_the_affinity_count_capped_by_the_quota(tmp_path: Path, text: str, cpus: int) -> None:
    path = cpu_max(tmp_path, text)
    assert available_cores(path, no_v1(tmp_path)) == cpus
    assert resolve_threads("auto", "cpu", load=0.0, cpu_max_path=path, cgroup_v1_dir=no_v1(tmp_path)) == cpus
    assert resolve_threads("auto", "cpu", reserve=1, load=0.0, cpu_max_path=path,
                           cgroup_v1_dir=no_v1(tmp_path)) == max(1, cpus - 1)
    assert resolve_threads("auto", "cuda:0", load=0.0, cpu_max_path=path) is None  # torch's default there


def test_no_quota_file_is_the_affinity_count(tmp_path: Path) -> None:
    missing = str(tmp_path / "absent" / "cpu.max")
    assert cgroup_cpu_limit(missing, no_v1(tmp_path)) is None
    assert available_cores(missing, no_v1(tmp_path)) == AFFINITY
    assert resolve_threads("auto", "cpu", load=0.0, cpu_max_path=missing, cgroup_v1_dir=no_v1(tmp_path)) == AFFINITY


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    v1 = tmp_path / "cpu"
    v1.mkdir()
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    missing = str(tmp_path / "cpu.max")
    (v1 / "cpu.cfs_quota_us").write_text("250000\n")
    assert cgroup_cpu_limit(missing, str(v1)) == 3
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")  # no limit
    assert cgroup_cpu_limit(missing, str(v1)) is None
    (v1 / "cpu.cfs_quota_us").write_text("50000\n")
    assert available_cores(missing, str(v1)) == 1
    # v2 wins where both exist
    assert cgroup_cpu_limit(cpu_max(tmp_path, "max 100000"), str(v1)) is None


def test_malformed_quota_is_ignored_and_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="moestream.threads"):
        assert cgroup_cpu_limit(cpu_max(tmp_path, "lots"), no_v1(tmp_path)) is None
    assert "ignoring the CPU quota" in caplog.text and "'lots'" in caplog.text


def test_free_cores() -> None:
    assert free_cores(0.0, 8) == 8
    assert free_cores(1.4, 2) == 1  # 0.6 of a core free rounds to 1
    assert free_cores(1.6, 2) == 0
    assert free_cores(0.4, 2) == 2  # a light load takes no core
    assert free_cores(12.0, 8) == 0


@pytest.mark.skipif(AFFINITY < 2, reason="needs 2 usable cores to fall back from")
def test_auto_falls_back_under_load_and_says_why(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    missing = str(tmp_path / "cpu.max")
    kw = dict(cpu_max_path=missing, cgroup_v1_dir=no_v1(tmp_path))
    with caplog.at_level(logging.INFO, logger="moestream.threads"):
        # Every CPU but one busy: one thread, whatever the core count.
        assert resolve_threads("auto", "cpu", load=CPUS - 1.0, **kw) == 1
        # Fully loaded: still at least 1.
        assert resolve_threads("auto", "cpu", load=CPUS + 5.0, **kw) == 1
    records = [r.getMessage() for r in caplog.records if r.name == "moestream.threads"]
    assert len(records) == 2
    assert records[0] == (f"threads auto: the 1-minute load average {CPUS - 1.0:.2f} leaves 1 of this machine's "
                          f"{CPUS} CPUs free; using 1 torch thread(s) instead of {AFFINITY} ({AFFINITY} usable "
                          "core(s)); give --threads N to choose")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="moestream.threads"):
        assert resolve_threads("auto", "cpu", load=0.0, **kw) == AFFINITY  # idle: every core, no log
        assert resolve_threads(3, "cpu", load=CPUS + 5.0, **kw) == 3  # an explicit count is kept
    assert not [r for r in caplog.records if r.name == "moestream.threads"]


def test_auto_falls_back_part_way_on_a_loaded_8_cpu_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    kw = dict(cpu_max_path=str(tmp_path / "cpu.max"), cgroup_v1_dir=no_v1(tmp_path))
    assert resolve_threads("auto", "cpu", load=0.3, **kw) == 8
    assert resolve_threads("auto", "cpu", reserve=1, load=0.3, **kw) == 7
    with caplog.at_level(logging.INFO, logger="moestream.threads"):
        assert resolve_threads("auto", "cpu", load=4.8, **kw) == 3  # 3.2 CPUs idle -> 3
        # serve: 3 CPUs free, 1 of them kept for the event loop, the engine gets 2
        assert resolve_threads("auto", "cpu", reserve=1, load=4.8, **kw) == 2
    assert [r.getMessage() for r in caplog.records][1] == (
        "threads auto: the 1-minute load average 4.80 leaves 3 of this machine's 8 CPUs free; using 2 torch "
        "thread(s) instead of 7 (8 usable core(s), 1 reserved); give --threads N to choose")
    # a quota of 4 CPUs in a container on the 8-CPU host: the load is counted against the host's CPUs
    quota = cpu_max(tmp_path, "400000 100000")
    assert resolve_threads("auto", "cpu", load=4.8, cpu_max_path=quota, cgroup_v1_dir=no_v1(tmp_path)) == 3
    assert resolve_threads("auto", "cpu", load=2.0, cpu_max_path=quota, cgroup_v1_dir=no_v1(tmp_path)) == 4


def test_slow_step_hint() -> None:
    # docs/performance.md finding 1: 1.6 tok/s on 2 shared threads against 13.7 on an idle core
    assert slow_step_hint(1.6, 2, 13.7) == ("decoding at 1.6 tok/s on 2 threads, down from 13.7 tok/s earlier in "
                                            "this run: if the cores are shared, try --threads 1")
    assert slow_step_hint(10.0, 2, 13.7) is None  # within the ratio: ordinary variation
    assert slow_step_hint(3.0, 2, 12.0) is None  # exactly 4x: not yet
    assert slow_step_hint(2.9, 2, 12.0) is not None
    assert slow_step_hint(1.6, 1, 13.7) is None  # one thread: nothing to lower
    assert slow_step_hint(0.0, 4, 0.0) is None  # no rate seen yet
    assert slow_step_hint(5.0, 2, 13.7, ratio=2.0) is not None
    for bad in [(-1.0, 2, 5.0), (1.0, 0, 5.0), (1.0, 2, float("nan")), (1.0, True, 5.0)]:
        with pytest.raises(ValueError):
            slow_step_hint(*bad)
    with pytest.raises(ValueError, match="ratio must be above 1"):
        slow_step_hint(1.0, 2, 5.0, ratio=1.0)


def test_page_cache_room_reads_meminfo_and_the_own_memory_cgroup(tmp_path) -> None:
    """`page_cache_room`: MemAvailable, capped by the process's own memory cgroup's limit less its
    usage (v1 and v2 layouts, as /proc/self/cgroup names them); no limit, an unreadable or
    absent file: the other figure alone, or None."""
    from moestream.host_memory import cgroup_memory_room, mem_available, page_cache_room

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n")
    assert mem_available(str(meminfo)) == 20000000 * 1024
    assert mem_available(str(tmp_path / "absent")) is None
    root = tmp_path / "cgroup"
    v1 = root / "memory" / "bench" / "job"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(f"{11 << 30}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{1 << 30}\n")
    self_v1 = tmp_path / "self_v1"
    self_v1.write_text("12:pids:/\n4:memory:/bench/job\n1:name=systemd:/\n")
    assert cgroup_memory_room(str(self_v1), str(root)) == 10 << 30
    assert page_cache_room(str(meminfo), str(self_v1), str(root)) == 10 << 30  # the cgroup is the smaller
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert cgroup_memory_room(str(self_v1), str(root)) is None
    assert page_cache_room(str(meminfo), str(self_v1), str(root)) == 20000000 * 1024
    v2 = root / "job2"
    v2.mkdir()
    (v2 / "memory.max").write_text("max\n")
    self_v2 = tmp_path / "self_v2"
    self_v2.write_text("0::/job2\n")
    assert cgroup_memory_room(str(self_v2), str(root)) is None
    (v2 / "memory.max").write_text(f"{4 << 30}\n")
    (v2 / "memory.current").write_text(f"{5 << 30}\n")  # over its limit (reclaim pending): no room
    assert cgroup_memory_room(str(self_v2), str(root)) == 0
    assert page_cache_room(str(tmp_path / "absent"), str(tmp_path / "absent"), str(root)) is None


@pytest.mark.parametrize("choice,room,direct", [
    ("on", None, True), ("off", 0, False),
    ("auto", 10 << 30, True),  # 13 GiB of experts, 10 GiB of room less 8 GiB of slots
    ("auto", 30 << 30, False),  # the page cache holds them beside the slots
    ("auto", 21 << 30, False),  # just: 13 <= 21 - 8
    ("auto", None, False),  # room unknown: buffered
])
def test_expert_direct_io_auto_when_the_experts_do_not_fit_in_the_page_cache(choice, room, direct) -> None:
    from moestream.engine.builder import use_direct_io

    assert use_direct_io(choice, 13 << 30, 8 << 30, room) is direct
