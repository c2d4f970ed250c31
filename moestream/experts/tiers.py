"""Where routed experts live off the device: the checkpoint's safetensors on disk (read in
place by byte offset, never converted) and an optional host-memory cache.

The safetensors layout (https://github.com/huggingface/safetensors): an 8-byte little-endian
header length N, a JSON header mapping tensor names to dtype, shape and data_offsets
[begin, end) relative to the end of the header, then the raw data.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import json
import mmap
import os
import struct
from collections import OrderedDict
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import torch

from moestream.experts.interface import ExpertKey, ExpertWeights, PackedExpert, PackedLayout

# safetensors dtype names -> torch. Non-float ones are parsed so that the loader can name them when it refuses them.
_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "BOOL": torch.bool,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
}

DIRECT_IO_ALIGN = 4096
"""O_DIRECT's alignment of file offsets, lengths and buffers (bytes): the logical block size
of 4Kn disks, a multiple of 512-byte sectors'."""
DIRECT_IO_BOUNCE_BYTES = 4 << 20
"""A direct-I/O reader's bounce buffer (bytes): the most one O_DIRECT read asks for."""


@dataclass(frozen=True)
class TensorLocation:
    """A tensor's bytes in a safetensors file: absolute `offset` and `nbytes` (bytes).
    `transposed`: the matrix is stored x @ W ([in, out]) and is read back as [out, in]."""

    path: str
    name: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    transposed: bool = False


def read_safetensors_header(path: str) -> dict[str, TensorLocation]:
    """Parse one file's header into TensorLocations, checking that every tensor's bytes lie
    inside the file.

    Raises:
        ValueError: unreadable file, corrupt header, a dtype torch has no type for, or a
            tensor whose bytes run past the end of the file (names the file and the tensor).
            Integer dtypes are parsed, not refused: `CheckpointReader.locate` refuses them.
    """
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError(f"header length {n} exceeds the file size {size}")
            header = json.loads(f.read(n))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"cannot read the safetensors header of '{path}' (corrupt or truncated?): {e}") from e
    base = 8 + n
    out: dict[str, TensorLocation] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = info["data_offsets"]
            st_dtype, shape = info["dtype"], tuple(info["shape"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"corrupt safetensors header entry for tensor '{name}' in '{path}': {info!r}") from e
        if base + end > size:
            raise ValueError(f"tensor '{name}' in '{path}' ends at byte {base + end}, past the end of the file ({size} bytes)")
        dtype = _ST_DTYPES.get(st_dtype)
        if dtype is None:
            raise ValueError(
                f"tensor '{name}' in '{path}' has dtype {st_dtype}, which moestream cannot read; moestream loads only "
                "floating-point weights (float32, bfloat16, float16, float64) and the quantized formats of docs/quantization.md"
            )
        out[name] = TensorLocation(path, name, base + begin, end - begin, dtype, shape)
    return out


class DiskTier:
    """Reads experts' gate, up and down weights from the checkpoint files by offset.

    Dense checkpoints: `locations[key]` = (gate, up, down) TensorLocations with shapes
    [I, H], [I, H], [H, I] (gate None for ungated experts, Nemotron-H), or (gate_up, down) with shapes [H, 2I], [I, H] (gpt-oss). Reads use `os.preadv` into a reusable staging buffer, then one
    dtype-converting copy into the destination (the same conversion the resident loader
    does, so bit-exact). Quantized checkpoints: `locations[key]` = the expert's stored
    tensors in its `PackedLayout`'s order, read as bytes into a `PackedExpert` (straight
    into it when it is in CPU memory), so a miss reads the compact bytes only.
    Not thread-safe: give each reading thread its own DiskTier. `random_access`: the files are
    opened with `POSIX_FADV_RANDOM` (no kernel read-ahead past the bytes asked for), for
    readers that split experts into ranges. `direct_io`: `read_range` reads with `O_DIRECT`,
    past the page cache (the disk DMAs into an aligned bounce buffer, copied once into the
    target), for checkpoints the page cache cannot hold anyway: a buffered read costs the CPU
    a copy out of the cache plus the cache's own bookkeeping, and fills memory that the cache
    then has to evict. A file (or filesystem) that refuses `O_DIRECT` (EINVAL) is read buffered.
    """

    def __init__(self, locations: dict[ExpertKey, tuple[TensorLocation, ...]], random_access: bool = False,
                 direct_io: bool = False) -> None:
        self.locations = locations
        self.random_access = random_access
        self.direct_io = direct_io and hasattr(os, "O_DIRECT")
        self._fds: dict[str, int] = {}
        self._direct_fds: dict[str, int | None] = {}  # path -> O_DIRECT fd, None once refused
        self._bounce: mmap.mmap | None = None  # page-aligned, made on the first direct read
        self._bounce_addr = 0
        self._staging = bytearray()

    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
            if self.random_access and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return fd

    def _read(self, loc: TensorLocation) -> torch.Tensor:
        if len(self._staging) < loc.nbytes:
            self._staging = bytearray(loc.nbytes)
        view = memoryview(self._staging)[: loc.nbytes]
        got = os.preadv(self._fd(loc.path), [view], loc.offset)
        if got != loc.nbytes:
            raise ValueError(f"short read of tensor '{loc.name}' in '{loc.path}': {got} of {loc.nbytes} bytes")
        return torch.frombuffer(view, dtype=loc.dtype).view(loc.shape)

    def read(self, key: ExpertKey, dst: ExpertWeights | PackedExpert) -> int:
        """Read expert `key` into `dst` (`read_packed` or `read_into`). Returns bytes read."""
        if isinstance(dst, PackedExpert):
            return self.read_packed(key, dst)
        return self.read_into(key, dst.gate_up, dst.down)

    def read_packed(self, key: ExpertKey, dst: PackedExpert) -> int:
        """Read expert `key`'s stored tensors into dst.data at its layout's offsets. Returns bytes read."""
        total = 0
        for loc, part in zip(self.locations[key], dst.layout.parts, strict=True):
            target = dst.data[part.offset : part.offset + part.nbytes]
            if target.device.type == "cpu":
                got = os.preadv(self._fd(loc.path), [memoryview(target.numpy())], loc.offset)
                if got != loc.nbytes:
                    raise ValueError(f"short read of tensor '{loc.name}' in '{loc.path}': {got} of {loc.nbytes} bytes")
            else:
                target.copy_(self._read(dataclasses.replace(loc, dtype=torch.uint8, shape=(loc.nbytes,))))
            total += loc.nbytes
        return total

    def read_into(self, key: ExpertKey, gate_up: torch.Tensor, down: torch.Tensor) -> int:
        """Copy expert `key` into gate_up [2I, H] and down [H, I] (any dtype/device). Returns
        bytes read. Two locations (gate_up [H, 2I], down [I, H]: gpt-oss's x @ W layout) are
        transposed as they are copied, and so is each of three marked `transposed` (loop-moe's
        `experts_w1/w3/w2`)."""
        if len(self.locations[key]) == 2:
            gu, dn = self.locations[key]
            gate_up.copy_(self._read(gu).T)
            down.copy_(self._read(dn).T)
            return gu.nbytes + dn.nbytes
        gate, up, dn = self.locations[key]
        if gate is None:  # ungated (Nemotron-H): gate_up is the up projection [I, H]
            gate_up.copy_(self._read_matrix(up))
            down.copy_(self._read_matrix(dn))
            return up.nbytes + dn.nbytes
        inter = gate_up.shape[0] // 2
        for loc, target in ((gate, gate_up[:inter]), (up, gate_up[inter:]), (dn, down)):
            if not self._read_direct(loc, target):
                target.copy_(self._read_matrix(loc))
        return gate.nbytes + up.nbytes + dn.nbytes

    @staticmethod
    def _direct_view(loc: TensorLocation, target: torch.Tensor) -> memoryview | None:
        """`target`'s bytes when `loc` can be read straight into them (a contiguous CPU tensor
        of its dtype and shape, not transposed: no conversion); None otherwise."""
        if (loc.transposed or target.device.type != "cpu" or target.dtype != loc.dtype
                or tuple(target.shape) != tuple(loc.shape) or not target.is_contiguous()):
            return None
        return memoryview(target.reshape(-1).view(torch.uint8).numpy())

    def _read_direct(self, loc: TensorLocation, target: torch.Tensor) -> bool:
        """Read `loc` straight into `target` when the bytes need no conversion: no staging
        copy. False otherwise."""
        view = self._direct_view(loc, target)
        if view is not None:
            self.read_range(loc.path, loc.offset, view)
        return view is not None

    def direct_ranges(self, key: ExpertKey, dst: ExpertWeights | PackedExpert) -> list[tuple[str, int, memoryview]] | None:
        """Expert `key`'s bytes as (path, file offset, CPU target bytes) ranges, when every
        tensor can be read straight into `dst` with no conversion (packed, or three dense
        tensors of `dst`'s dtype, not transposed, `dst` on the CPU); None otherwise. Reading
        the ranges (`read_range`) in any order, split anywhere, equals `read(key, dst)`."""
        if isinstance(dst, PackedExpert):
            if dst.data.device.type != "cpu":
                return None
            return [(loc.path, loc.offset, memoryview(dst.data[part.offset : part.offset + part.nbytes].numpy()))
                    for loc, part in zip(self.locations[key], dst.layout.parts, strict=True)]
        locs = self.locations[key]
        if len(locs) != 3 or locs[0] is None:
            return None
        inter = dst.gate_up.shape[0] // 2
        views = [self._direct_view(loc, target) for loc, target in zip(locs, (dst.gate_up[:inter], dst.gate_up[inter:], dst.down))]
        if any(v is None for v in views):
            return None
        return [(loc.path, loc.offset, view) for loc, view in zip(locs, views)]

    def read_range(self, path: str, offset: int, target: memoryview) -> int:
        """Read len(target) bytes of `path` at `offset` into `target` (with `direct_io`, past the
        page cache). Returns bytes read.

        Raises:
            ValueError: the file ends before the range does."""
        if self.direct_io:
            fd = self._direct_fd(path)
            if fd is not None:
                try:
                    return self._read_range_direct(fd, path, offset, target)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    self._refuse_direct(path)  # alignment this file's filesystem does not take
        got = os.preadv(self._fd(path), [target], offset)
        if got != len(target):
            raise ValueError(f"short read of '{path}' at offset {offset}: {got} of {len(target)} bytes")
        return got

    def _direct_fd(self, path: str) -> int | None:
        """`path` opened with O_DIRECT, or None where its filesystem refuses it."""
        if path not in self._direct_fds:
            try:
                self._direct_fds[path] = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._direct_fds[path] = None
        return self._direct_fds[path]

    def _refuse_direct(self, path: str) -> None:
        fd = self._direct_fds.get(path)
        if fd is not None:
            os.close(fd)
        self._direct_fds[path] = None

    def _read_range_direct(self, fd: int, path: str, offset: int, target: memoryview) -> int:
        """`read_range` through O_DIRECT: aligned reads of `DIRECT_IO_ALIGN`-byte blocks covering
        the range, at most `DIRECT_IO_BOUNCE_BYTES` at a time, into a page-aligned bounce buffer,
        each copied into `target` (ctypes.memmove: the GIL is released while it copies)."""
        if self._bounce is None:
            self._bounce = mmap.mmap(-1, DIRECT_IO_BOUNCE_BYTES)
            self._bounce_addr = ctypes.addressof(ctypes.c_char.from_buffer(self._bounce))
        bounce = memoryview(self._bounce)
        n = len(target)
        dst = (ctypes.c_char * n).from_buffer(target) if n else None
        done = 0
        while done < n:
            start = offset + done
            lead = start % DIRECT_IO_ALIGN
            want = min(n - done, DIRECT_IO_BOUNCE_BYTES - lead)
            span = -(-(lead + want) // DIRECT_IO_ALIGN) * DIRECT_IO_ALIGN
            got = os.preadv(fd, [bounce[:span]], start - lead)
            if got - lead < want:
                raise ValueError(f"short read of '{path}' at offset {start}: the file ends before byte {start + want}")
            ctypes.memmove(ctypes.addressof(dst) + done, self._bounce_addr + lead, want)
            done += want
        return n

    def _read_matrix(self, loc: TensorLocation) -> torch.Tensor:
        """`loc` as an [out, in] matrix (transposed as it is read when stored x @ W)."""
        return self._read(loc).T if loc.transposed else self._read(loc)

    def advise(self, key: ExpertKey) -> int:
        """Ask the kernel to read expert `key`'s bytes into the page cache in the background
        (`posix_fadvise(POSIX_FADV_WILLNEED)`): no copy and no CPU work here, so a later
        `read_into` is a page-cache copy instead of a disk read. Returns the bytes advised
        (0 where the OS has no posix_fadvise, e.g. macOS).

        Raises:
            OSError: the file cannot be opened.
        """
        if not hasattr(os, "posix_fadvise"):
            return 0
        total = 0
        for loc in filter(None, self.locations[key]):
            os.posix_fadvise(self._fd(loc.path), loc.offset, loc.nbytes, os.POSIX_FADV_WILLNEED)
            total += loc.nbytes
        return total

    def close(self) -> None:
        for fd in [*self._fds.values(), *self._direct_fds.values()]:
            if fd is not None:
                os.close(fd)
        self._fds.clear()
        self._direct_fds.clear()

    def __del__(self) -> None:
        self.close()


def empty_expert(inter: int, hidden: int, dtype: torch.dtype, device: torch.device | str, pin: bool = False,
                 layout: PackedLayout | None = None, gated: bool = True) -> ExpertWeights | PackedExpert:
    """An uninitialised buffer for one expert: dense gate_up [2I, H] ([I, H] when not `gated`)
    and down [H, I] in `dtype`, or, with a `layout`, a PackedExpert of uint8 [layout.nbytes]."""
    if layout is not None:
        return PackedExpert(torch.empty(layout.nbytes, dtype=torch.uint8, device=device, pin_memory=pin), layout)
    return ExpertWeights(torch.empty((2 if gated else 1) * inter, hidden, dtype=dtype, device=device, pin_memory=pin),
                         torch.empty(hidden, inter, dtype=dtype, device=device, pin_memory=pin))


def copy_expert(dst: ExpertWeights | PackedExpert, src: ExpertWeights | PackedExpert) -> None:
    """Copy one expert's buffers (both dense or both packed)."""
    if isinstance(dst, PackedExpert):
        dst.data.copy_(src.data)
    else:
        dst.gate_up.copy_(src.gate_up)
        dst.down.copy_(src.down)


class HostCache:
    """LRU cache of experts in host memory (pinned when the device is CUDA), in the compute
    dtype, or packed (`layout`: the checkpoint's quantized bytes), holding at most
    `capacity` experts (`gated` False: ungated experts, gate_up [I, H]). Thread-safety is the
    caller's (the store's lock)."""

    def __init__(self, capacity: int, inter: int, hidden: int, dtype: torch.dtype, pin: bool,
                 layout: PackedLayout | None = None, gated: bool = True) -> None:
        self.capacity = capacity
        self._gated = gated
        self._shape = (inter, hidden)
        self._dtype = dtype
        self._pin = pin
        self._layout = layout
        self._entries: OrderedDict[ExpertKey, ExpertWeights | PackedExpert] = OrderedDict()

    def get(self, key: ExpertKey) -> ExpertWeights | PackedExpert | None:
        w = self._entries.get(key)
        if w is not None:
            self._entries.move_to_end(key)
        return w

    def keys(self) -> list[ExpertKey]:
        """The cached experts' keys, least recently used first."""
        return list(self._entries)

    def __contains__(self, key: object) -> bool:
        """Whether `key` is cached (no LRU update)."""
        return key in self._entries

    def slot_for(self, key: ExpertKey, keep: AbstractSet[ExpertKey] = frozenset()) -> ExpertWeights | PackedExpert | None:
        """A buffer to fill with `key`'s weights, evicting the least recently used entry not in
        `keep`; None if the capacity is 0 or every entry is in `keep`."""
        if self.capacity == 0:
            return None
        if len(self._entries) >= self.capacity:
            victim = next((k for k in self._entries if k not in keep), None)
            if victim is None:
                return None
            w = self._entries.pop(victim)
        else:
            w = empty_expert(*self._shape, self._dtype, "cpu", self._pin, self._layout, self._gated)
        self._entries[key] = w
        return w

    def __len__(self) -> int:
        return len(self._entries)
