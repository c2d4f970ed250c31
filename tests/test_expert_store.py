"""PagedExpertStore on its own: exact slot bookkeeping, never evicting an expert in use
(property test with random routing and a tiny pool), bit-exact weights from disk, and
errors that name the file and the tensor."""

from __future__ import annotations

import os
import shutil
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from moestream.models.hf_config import model_config_from_hf
from moestream import LLM, ModelConfig
from moestream.experts.interface import ExpertWeights
from moestream.experts.policy import LRUPolicy, make_policy
from moestream.experts import store as store_module
from moestream.experts.store import PagedExpertStore, load_pin_profile
from moestream.experts import tiers as tiers_module
from moestream.experts.tiers import DiskTier
from moestream.loader import CheckpointReader, expert_locations


@pytest.fixture(scope="module")
def qwen_cfg(qwen3_moe_dir: str) -> ModelConfig:
    return model_config_from_hf(qwen3_moe_dir)


@pytest.fixture(scope="module")
def locations(qwen3_moe_dir: str, qwen_cfg: ModelConfig):
    return expert_locations(qwen_cfg, CheckpointReader(qwen3_moe_dir))


@pytest.fixture(scope="module")
def tensors(qwen3_moe_dir: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(qwen3_moe_dir, "model.safetensors"))


def make_store(cfg: ModelConfig, locations, slots: int, policy: str = "lru", **kw) -> PagedExpertStore:
    moe = [i for i, m in enumerate(cfg.moe_layers) if m]
    return PagedExpertStore(locations, cfg.num_layers, moe, cfg.num_experts, cfg.moe_intermediate_size,
                            cfg.hidden_size, kw.pop("dtype", torch.float32), torch.device("cpu"), slots, kw.pop("host", 0),
                            make_policy(policy), top_k=cfg.num_experts_per_tok, **kw)


def test_weights_equal_checkpoint_and_lru_order(qwen_cfg, locations, tensors) -> None:
    store = make_store(qwen_cfg, locations, slots=3)
    w = store.ensure(0, [1, 4])
    torch.testing.assert_close(w[0].gate_up[:32], tensors["model.layers.0.mlp.experts.1.gate_proj.weight"], rtol=0, atol=0)
    torch.testing.assert_close(w[0].gate_up[32:], tensors["model.layers.0.mlp.experts.1.up_proj.weight"], rtol=0, atol=0)
    torch.testing.assert_close(w[1].down, tensors["model.layers.0.mlp.experts.4.down_proj.weight"], rtol=0, atol=0)
    store.ensure(2, [7])  # third slot
    store.ensure(0, [4])  # hit; (0, 1) is now least recently used
    store.ensure(2, [3])  # evicts (0, 1)
    assert store.resident_experts() == {(0, 4), (2, 7), (2, 3)}
    s = store.stats()
    assert (s["hits"], s["misses"], s["evictions"]) == (1, 4, 1)
    assert s["hits_per_layer"] == [1, 0, 0] and s["misses_per_layer"] == [2, 0, 2]
    assert s["bytes_read_per_tier"] == {"disk": 4 * store.expert_bytes, "host": 0}


def test_host_cache_serves_repeat_misses(qwen_cfg, locations) -> None:
    store = make_store(qwen_cfg, locations, slots=2, host=4)
    for ids in ([0, 1], [2, 3], [0, 1]):
        store.ensure(0, ids)
    s = store.stats()
    assert s["misses"] == 6 and s["bytes_read_per_tier"] == {"disk": 4 * store.expert_bytes, "host": 2 * store.expert_bytes}


def test_host_cache_miss_computed_in_place(qwen_cfg, locations, tensors) -> None:
    """compute_in_place: a miss found in the host cache returns the host buffers (no slot, no
    copy). Regression: a disk miss in the same call must not refill that buffer: with a
    one-expert host cache holding (0, 0), loading (0, 3) would overwrite (0, 0)'s weights."""
    store = make_store(qwen_cfg, locations, slots=2, host=1, compute_in_place=True)
    store.ensure(0, [0])  # disk -> host buffer -> slot
    store.prefetch_one((0, 1))  # slot prefetches bypass the host cache
    store.ensure(0, [1])
    store.prefetch_one((0, 2))  # evicts (0, 0) from the slots; the host cache still holds it
    assert store.resident_experts() == {(0, 1), (0, 2)}
    w = store.ensure(0, [0, 3])
    s = store.stats()
    assert s["host_computed"] == 1 and s["bytes_read_per_tier"]["host"] == 0
    assert store.resident_experts() == {(0, 3), (0, 2)}
    name = "model.layers.0.mlp.experts.{}.{}_proj.weight"
    for i, e in enumerate((0, 3)):
        torch.testing.assert_close(w[i].gate_up[32:], tensors[name.format(e, "up")], rtol=0, atol=0)
        torch.testing.assert_close(w[i].down, tensors[name.format(e, "down")], rtol=0, atol=0)
    assert w[0].down.data_ptr() not in {v.down.data_ptr() for v in store._views.values()}


def test_release_and_add_slots(qwen_cfg, locations) -> None:
    """Elastic memory's side of the store: free slots go first, then the policy's victim (the
    last call's experts included: it runs between forwards), never below top_k + pinned."""
    store = make_store(qwen_cfg, locations, slots=5, pinned=[(0, 7)])
    store.ensure(0, [1])
    store.ensure(0, [2])
    store.ensure(0, [1])  # LRU order: (0, 2), (0, 1); slots 3 and 4 are free
    assert store.min_slots == qwen_cfg.num_experts_per_tok + 1 == 3
    assert {store.release_slot(), store.release_slot()} == {3, 4} and store.resident_experts() == {(0, 1), (0, 2), (0, 7)}
    assert store.num_slots == 3 and store.release_slot() is None
    store.add_slot(4, ExpertWeights(torch.empty(64, 64), torch.empty(64, 32)))
    assert store.release_slot() == 4
    store.add_slot(3, ExpertWeights(torch.empty(64, 64), torch.empty(64, 32)))
    store.ensure(0, [5])  # takes free slot 3
    victim = store._slot_of[(0, 2)]
    assert store.release_slot() == victim and store.resident_experts() == {(0, 1), (0, 5), (0, 7)}
    with pytest.raises(ValueError, match="already belongs"):
        store.add_slot(3, ExpertWeights(torch.empty(64, 64), torch.empty(64, 32)))


def test_pinned_experts_never_evicted(qwen_cfg, locations) -> None:
    store = make_store(qwen_cfg, locations, slots=4, pinned=[(0, 5), (2, 6)])
    assert store.max_experts_per_call() == 2
    for e in range(8):
        store.ensure(0, [e])
    assert {(0, 5), (2, 6)} <= store.resident_experts()
    with pytest.raises(ValueError, match="at most 2 fit"):
        store.ensure(0, [0, 1, 2])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0, 2]), st.sets(st.integers(0, 7), min_size=1, max_size=3)), min_size=1, max_size=30),
       st.sampled_from(["lru", "lfu", "activation", "next_use"]), st.integers(3, 5))
def test_never_evicts_an_expert_in_use(qwen_cfg, locations, tensors, calls, policy, slots) -> None:
    store = make_store(qwen_cfg, locations, slots=slots, policy=policy)
    for layer, ids in calls:
        ids = sorted(ids)
        weights = store.ensure(layer, ids)
        resident = store.resident_experts()
        assert {(layer, e) for e in ids} <= resident and len(resident) <= slots
        for e, w in zip(ids, weights):  # each returned view holds exactly that expert
            ref = tensors[f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight"]
            assert torch.equal(w.down, ref)


def test_prefetch_loads_ahead_and_counts(qwen_cfg, locations) -> None:
    store = make_store(qwen_cfg, locations, slots=4, prefetch="gate")
    store.ensure(0, [0])
    store.prefetch(2, [1, 2])
    _wait_resident(store, {(2, 1), (2, 2)})
    store.ensure(2, [1])
    s = store.stats()
    assert s["prefetch_loads"] == 2 and s["prefetch_hits"] == 1 and s["misses"] == 1
    store.ensure(0, [3])
    store.ensure(0, [4])  # 4 slots: (0,0), (2,1), (2,2), (0,3) -> evicts LRU (0,0)
    store.ensure(0, [5])  # evicts (2,2): prefetched, never used
    assert s["wasted_prefetch_bytes"] == 0 and store.stats()["wasted_prefetch_bytes"] == store.expert_bytes


def test_page_cache_prefetch_advises_the_expert_bytes_and_takes_no_slot(qwen_cfg, locations, tensors,
                                                                       monkeypatch) -> None:
    """The CPU prefetch target: the worker asks the kernel to read the predicted experts'
    exact byte ranges ahead (POSIX_FADV_WILLNEED) and claims no slot; the demand access is
    still a miss that reads the right weights."""
    advised: list[tuple[int, int, int]] = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, adv: (advised.append((off, n, adv)), real(fd, off, n, adv)))
    store = make_store(qwen_cfg, locations, slots=4, prefetch="gate", prefetch_target="page_cache")
    store.ensure(0, [0])
    store.prefetch(2, [1, 2])
    end = time.monotonic() + 10
    while store.stats()["prefetch_loads"] < 2:
        assert time.monotonic() < end, "prefetch did not finish"
        time.sleep(0.01)
    want = sorted((loc.offset, loc.nbytes, os.POSIX_FADV_WILLNEED) for e in (1, 2) for loc in locations[(2, e)])
    assert sorted(a for a in advised if a[2] == os.POSIX_FADV_WILLNEED) == want
    assert (0, 0, os.POSIX_FADV_RANDOM) in advised  # the demand readers turn read-ahead off
    s = store.stats()
    assert store.resident_experts() == {(0, 0)}
    assert s["prefetch_bytes"] == sum(n for _, n, _ in want) and s["bytes_read_per_tier"]["disk"] == store.expert_bytes
    w = store.ensure(2, [1])
    assert store.stats()["misses"] == 2
    torch.testing.assert_close(w[0].down, tensors["model.layers.2.mlp.experts.1.down_proj.weight"], rtol=0, atol=0)
    with pytest.raises(ValueError, match="prefetch target 'gpu'"):
        make_store(qwen_cfg, locations, slots=4, prefetch_target="gpu")


def test_corrupt_expert_tensor_names_file_and_tensor(qwen3_moe_dir: str, tmp_path) -> None:
    d = str(tmp_path / "m")
    shutil.copytree(qwen3_moe_dir, d)
    path = os.path.join(d, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    with pytest.raises(ValueError, match=r"tensor '.*' in '.*model.safetensors' ends at byte \d+, past the end of the file"):
        LLM(d, dtype="float32", expert_budget=0.5)


def test_policy_base_is_lru_for_store(qwen_cfg, locations) -> None:
    assert isinstance(make_store(qwen_cfg, locations, slots=2).policy, LRUPolicy)


def _wait_resident(store: PagedExpertStore, keys: set, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not keys <= store.resident_experts():
        assert time.monotonic() < end, "prefetch did not finish"
        time.sleep(0.01)


def test_wasted_prefetch_bytes_in_disk_units(qwen3_moe_dir: str, qwen_cfg, tmp_path) -> None:
    """Regression: with a bf16 checkpoint and float32 compute, wasted prefetch bytes were
    counted in compute-dtype bytes (twice the bytes read), exceeding prefetch bytes."""
    from safetensors.torch import save_file

    d = str(tmp_path / "bf16")
    shutil.copytree(qwen3_moe_dir, d)
    path = os.path.join(d, "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(path).items()}, path)
    store = make_store(qwen_cfg, expert_locations(qwen_cfg, CheckpointReader(d)), slots=4, prefetch="gate")
    store.ensure(0, [0])
    store.prefetch(2, [1, 2])
    _wait_resident(store, {(2, 1), (2, 2)})
    for e in (3, 4, 5, 6):  # evicts (0,0), then the two unused prefetched experts
        store.ensure(0, [e])
    s = store.stats()
    disk_expert_bytes = store.expert_bytes // 2  # bf16 on disk, float32 in the slots
    assert s["prefetch_bytes"] == 2 * disk_expert_bytes
    assert s["wasted_prefetch_bytes"] == 2 * disk_expert_bytes


def _profile(tmp_path, raw) -> str:
    import json

    p = tmp_path / "pins.json"
    p.write_text(json.dumps(raw) if not isinstance(raw, str) else raw)
    return str(p)


def test_pin_profile_validation(qwen3_moe_dir: str, tmp_path) -> None:
    """Regressions: duplicate ids were counted twice against the budget; strings, floats and
    bools were accepted as expert ids; a full budget was refused when pins were given."""
    import numpy as np

    eb = 3 * 32 * 64 * 4
    llm = LLM(qwen3_moe_dir, dtype="float32", expert_budget=3 * eb, expert_pin_profile=_profile(tmp_path, {"0": [1, 1, 1]}))
    assert llm.expert_stats()["num_slots"] == 3 and (0, 1) in llm.llm_engine.expert_store.pinned
    cfg = model_config_from_hf(qwen3_moe_dir)
    for bad in ({"0": "12"}, {"0": [1.7]}, {"0": [True]}, [1, 2], {"x": [1]}):  # checked as the engine does
        with pytest.raises(ValueError, match="pin profile"):
            load_pin_profile(_profile(tmp_path, bad), cfg)
    with pytest.raises(ValueError, match="not an MoE layer"):  # and refused by the engine
        LLM(qwen3_moe_dir, dtype="float32", expert_budget=0.5, expert_pin_profile=_profile(tmp_path, {"1": [0]}))
    many = _profile(tmp_path, {"0": list(range(8)), "2": list(range(7))})
    assert LLM(qwen3_moe_dir, dtype="float32", expert_budget=1.0, expert_pin_profile=many).expert_stats()["resident"]
    assert LLM(qwen3_moe_dir, dtype="float32", expert_budget=np.int64(4 * eb)).expert_stats()["num_slots"] == 4


class _FailingDisk:
    """A disk tier whose reads raise, standing in for an I/O error in the prefetch thread."""

    def __init__(self) -> None:
        self.calls = 0

    def read(self, key, dst) -> int:
        self.calls += 1
        raise OSError(f"injected read error for {key}")

    def read_range(self, path, offset, target) -> int:
        self.calls += 1
        raise OSError(f"injected read error at {path}:{offset}")


def test_failed_prefetch_frees_its_slot_and_demand_load_still_works(qwen_cfg, locations, tensors) -> None:
    """Regression: a prefetch read that raised left the key 'loading' and its slot claimed, so
    the next ensure() of that expert waited forever and the slot leaked."""
    store = make_store(qwen_cfg, locations, slots=3, prefetch="gate")
    failing = _FailingDisk()
    store._prefetch_disk = failing
    store.prefetch(2, [5])
    deadline = time.monotonic() + 10
    while store.stats()["prefetch_errors"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert failing.calls == 1 and store.stats()["prefetch_errors"] == 1
    assert store.resident_experts() == set() and len(store._free) == 3 and not store._loading
    done: list = []
    worker = threading.Thread(target=lambda: done.append(store.ensure(2, [5])), daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert done, "ensure() hung on an expert whose prefetch failed"
    w = done[0][0]
    assert torch.equal(w.down, tensors["model.layers.2.mlp.experts.5.down_proj.weight"])
    # the worker survived the error: a later prefetch (now from the real disk tier) lands
    store._prefetch_disk = store._disk
    store.prefetch(2, [6])
    _wait_resident(store, {(2, 6)})
    assert store.stats()["prefetch_loads"] == 1 and store.resident_experts() == {(2, 5), (2, 6)}


@pytest.mark.parametrize("chunk,dtype,direct", [(1 << 20, torch.float32, False), (1000, torch.float32, False),
                                                (1000, torch.float32, True), (1 << 20, torch.bfloat16, True)])
def test_concurrent_miss_reads_match_one_reader(qwen_cfg, locations, tensors, monkeypatch, chunk, dtype,
                                                direct) -> None:
    """A call's disk misses are read by several workers at once, in byte ranges (1000 bytes:
    ranges that cut tensors and elements), buffered or with O_DIRECT, or whole experts when the
    engine's dtype differs from the checkpoint's (bf16 from float32): the same victims, counts
    and bytes as one reader, and every returned view holds its own expert, byte for byte."""
    monkeypatch.setattr(store_module, "READ_CHUNK_BYTES", chunk)
    calls = [(0, [0, 1, 2]), (2, [3, 4, 5]), (0, [1, 6, 7]), (2, [0, 4, 7]), (0, [2, 3, 5])]
    stores = [make_store(qwen_cfg, locations, slots=5, policy="next_use", read_workers=n, dtype=dtype,
                         direct_io=direct) for n in (1, 4)]
    assert stores[1].stats()["direct_io"] is direct
    assert stores[0]._read_pool is None and stores[1]._read_pool is not None
    ranges = stores[1]._disk.direct_ranges((0, 0), stores[1]._views[0])
    assert (len(ranges) == 3) if dtype == torch.float32 else ranges is None  # in ranges, or whole
    for layer, ids in calls:
        views = [s.ensure(layer, ids) for s in stores]
        for e, w1, w4 in zip(ids, *views):
            ref = tensors[f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight"].to(dtype)
            assert torch.equal(w1.down, ref) and torch.equal(w4.down, ref)
            assert torch.equal(w1.gate_up, w4.gate_up)
        assert stores[0].resident_experts() == stores[1].resident_experts()
    keys = ("hits", "misses", "evictions", "bytes_read_per_tier")
    assert [stores[0].stats()[k] for k in keys] == [stores[1].stats()[k] for k in keys]
    s = stores[1].stats()
    stored = stores[1].expert_bytes * torch.float32.itemsize // dtype.itemsize  # the checkpoint is float32
    assert s["hits"] + s["misses"] == 15 and s["bytes_read_per_tier"]["disk"] == s["misses"] * stored


def test_failed_concurrent_read_gives_back_every_slot(qwen_cfg, locations, tensors) -> None:
    """A read error in one worker: the call raises it, none of its misses stays resident (their
    slots hold partial bytes), no slot leaks, and the next call reads them again."""
    store = make_store(qwen_cfg, locations, slots=4, read_workers=2)
    store.ensure(0, [0])
    failing = _FailingDisk()
    store._read_disks[1] = failing
    with pytest.raises(OSError, match="injected read error"):
        store.ensure(2, [1, 2, 3])
    assert failing.calls == 1
    s = store.stats()
    assert store.resident_experts() == {(0, 0)} and s["free_slots"] + s["resident_experts"] == 4
    store._read_disks[1] = store._disk
    w = store.ensure(2, [1, 2, 3])
    for e, view in zip([1, 2, 3], w):
        assert torch.equal(view.down, tensors[f"model.layers.2.mlp.experts.{e}.down_proj.weight"])
    assert store.resident_experts() == {(0, 0), (2, 1), (2, 2), (2, 3)}


def _o_direct_works(path: str) -> bool:
    """Whether `path`'s filesystem takes O_DIRECT (tmpfs before Linux 6.6 does not)."""
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False


def test_direct_io_reads_equal_the_file_bytes(tmp_path, monkeypatch) -> None:
    """O_DIRECT reads of ranges that start and end anywhere (inside a block, across blocks and
    bounce buffers, up to the file's last byte) give the file's bytes; a range past the end is
    refused by name; a read the filesystem refuses (EINVAL: here offsets that are not
    block-aligned, with a 1-byte alignment) falls back to buffered reads of that file."""
    monkeypatch.setattr(tiers_module, "DIRECT_IO_BOUNCE_BYTES", 3 * tiers_module.DIRECT_IO_ALIGN)
    data = os.urandom(5 * tiers_module.DIRECT_IO_ALIGN + 123)
    path = str(tmp_path / "bytes.bin")
    with open(path, "wb") as f:
        f.write(data)
    ranges = [(0, 10), (4095, 2), (1234, 15000), (len(data) - 7, 7), (len(data) - 5000, 5000), (8192, 4096), (5, 0)]
    disk = DiskTier({}, random_access=True, direct_io=True)
    for off, n in ranges:
        out = bytearray(n)
        assert disk.read_range(path, off, memoryview(out)) == n and bytes(out) == data[off:off + n]
    assert (disk._direct_fds[path] is not None) == _o_direct_works(path)  # read past the page cache where it can be
    with pytest.raises(ValueError, match="bytes.bin"):
        disk.read_range(path, len(data) - 10, memoryview(bytearray(20)))
    disk.close()
    monkeypatch.setattr(tiers_module, "DIRECT_IO_ALIGN", 1)
    refused = DiskTier({}, random_access=True, direct_io=True)
    out = bytearray(3000)
    assert refused.read_range(path, 1234, memoryview(out)) == 3000 and bytes(out) == data[1234:4234]
    assert refused._direct_fds[path] is None  # EINVAL once, buffered from then on
    refused.read_range(path, 17, memoryview(out))
    assert bytes(out) == data[17:3017]
    refused.close()


class _GatedDisk:
    """A read worker's disk tier whose reads wait until `open` is set (a slow disk)."""

    def __init__(self, inner: DiskTier, gate: threading.Event) -> None:
        self.inner, self.gate = inner, gate
        self.direct_io = inner.direct_io

    def read_range(self, path, offset, target) -> int:
        assert self.gate.wait(10), "the read was never let through"
        return self.inner.read_range(path, offset, target)

    def read(self, key, dst) -> int:
        assert self.gate.wait(10), "the read was never let through"
        return self.inner.read(key, dst)


def test_started_reads_run_while_the_caller_computes(qwen_cfg, locations, tensors) -> None:
    """`start` returns while its misses are still being read (the disk is held shut until after
    it returns), and the matching `ensure` waits for them: the same weights, victims, counts and
    bytes as `ensure` alone. A started call that is never ensured is finished by the next call;
    a started call whose read fails gives its slots back when ensured."""
    calls = [(0, [0, 1, 2]), (2, [3, 4, 5]), (0, [1, 6, 7]), (2, [0, 4, 7])]
    plain, started = (make_store(qwen_cfg, locations, slots=5, policy="next_use", read_workers=2) for _ in range(2))
    gate = threading.Event()
    started._read_disks = [_GatedDisk(d, gate) for d in started._read_disks]
    for i, (layer, ids) in enumerate(calls):
        want = plain.ensure(layer, ids)
        started.start(layer, ids)
        if i == 0:
            assert started._loading == {(0, 0), (0, 1), (0, 2)}  # in flight when start returned
            gate.set()
        got = started.ensure(layer, ids)
        assert not started._loading
        for e, w, g in zip(ids, want, got):
            assert torch.equal(g.down, tensors[f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight"])
            assert torch.equal(g.gate_up, w.gate_up)
    keys = ("hits", "misses", "evictions", "bytes_read_per_tier")
    assert [plain.stats()[k] for k in keys] == [started.stats()[k] for k in keys]
    assert started.resident_experts() == plain.resident_experts()
    started.start(0, [4, 5])  # never ensured
    started.ensure(2, [1])
    assert {(0, 4), (0, 5)} <= started.resident_experts() and not started._loading
    failing = _FailingDisk()
    started._read_disks = [failing, failing]
    started.start(2, [2, 5, 6])
    with pytest.raises(OSError, match="injected read error"):
        started.ensure(2, [2, 5, 6])
    s = started.stats()
    assert s["free_slots"] + s["resident_experts"] == 5 and not started._loading
    assert not {(2, 2), (2, 6)} & started.resident_experts()
