"""StatePool: the per-request states of linear-attention layers.

A request's state, for every linear layer, is the tuple of tensors its mixer declares
(`RecurrentMixer.state_specs`, layers/recurrent_state.py; Gated DeltaNet: a conv state
[C, K-1] in the model's dtype and a recurrent state [Hv, Dk, Dv], float32 by default); the
pool knows them only by their specs. Unlike KV blocks it does not grow with the
sequence, so a request holds one slot for its whole life. At most `max_resident` requests
keep their slot on the device; the others wait in host memory (pinned on CUDA) and are
swapped back in, least-recently-used out first, before their next forward. A swapped state
comes back bit for bit.

With speculative decoding of k tokens, slot s also has k speculative rows (`spec_row`):
a verify forward over a request's 1 + k positions writes its state after each of the first
k positions there, and once the engine knows how many drafts were accepted the slot takes
the row of the last accepted position (`accept`): an exact rollback, with no recompute.
They hold nothing between steps, so they are never swapped. The rows after those are the
device tier of the prefix cache's state checkpoints (`StateCheckpointPool`); the model writes
a checkpoint straight into such a row while it computes a prefill (`StateMetadata.captures`).

vLLM keeps these in its Mamba cache (one slot per running request, no host tier); the
host swap here lets more requests run than device slots hold.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque

import torch

from moestream.layers.recurrent_state import StateSpec

logger = logging.getLogger(__name__)


class StatePool:
    """Device state slots for `max_resident` requests, plus a host tier for the rest.

    Tensors (`tensors[spec.name][layer]`): per linear layer and state spec, [R + R*k + D,
    *spec.shape]; rows 0..R-1 are the current states, rows R..R+R*k-1 the `num_spec_rows` = k
    speculative rows of each slot, the last D rows the `num_checkpoint_rows` device rows of
    the state checkpoints.

    Raises (constructor): ValueError if max_resident < 1, num_checkpoint_rows < 0,
    num_spec_rows < 0, or no specs / two of one name.
    """

    def __init__(
        self,
        num_layers: int,
        specs: tuple[StateSpec, ...],
        max_resident: int,
        device: torch.device,
        num_checkpoint_rows: int = 0,
        num_spec_rows: int = 0,
    ) -> None:
        if max_resident < 1:
            raise ValueError(f"max_resident_states must be at least 1, got {max_resident}")
        if num_checkpoint_rows < 0:
            raise ValueError(f"num_checkpoint_rows must be at least 0, got {num_checkpoint_rows}")
        if num_spec_rows < 0:
            raise ValueError(f"num_spec_rows must be at least 0, got {num_spec_rows}")
        if not specs or len({s.name for s in specs}) != len(specs):
            raise ValueError(f"a state needs one or more tensors of distinct names, got {specs!r}")
        self.max_resident = max_resident
        self.num_spec_rows = num_spec_rows
        self.num_checkpoint_rows = num_checkpoint_rows
        self.device = device
        self.specs = tuple(specs)
        rows = max_resident * (1 + num_spec_rows) + num_checkpoint_rows
        self.tensors = {s.name: [torch.zeros(rows, *s.shape, dtype=s.dtype, device=device) for _ in range(num_layers)]
                        for s in self.specs}
        self._all = [t for layer in range(num_layers) for t in (self.tensors[s.name][layer] for s in self.specs)]
        self._free: deque[int] = deque(range(max_resident))
        self._resident: OrderedDict[str, int] = OrderedDict()  # request id -> slot, least recent first
        self._host: dict[str, list[torch.Tensor]] = {}  # request id -> host copies of its rows (`read_row`)
        self._pin = device.type == "cuda"
        self.num_swap_outs = 0
        self.num_swap_ins = 0

    # ---- sizes ----------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.tensors[self.specs[0].name])

    @property
    def bytes_per_state(self) -> int:
        """Bytes of one state (every tensor of every linear layer): one slot or checkpoint."""
        return self.num_layers * sum(s.nbytes for s in self.specs)

    @property
    def bytes_per_request(self) -> int:
        """Device bytes per state slot: its state plus its speculative rows."""
        return (1 + self.num_spec_rows) * self.bytes_per_state

    @property
    def device_bytes(self) -> int:
        return self.max_resident * self.bytes_per_request

    def caches(self) -> list[tuple[torch.Tensor, ...]]:
        """Per linear layer, its state tensors in spec order, as the model reads them."""
        return [tuple(self.tensors[s.name][layer] for s in self.specs) for layer in range(self.num_layers)]

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def num_resident(self) -> int:
        return len(self._resident)

    def num_swapped(self) -> int:
        return len(self._host)

    def is_resident(self, request_id: str) -> bool:
        return request_id in self._resident

    def has_state(self, request_id: str) -> bool:
        return request_id in self._resident or request_id in self._host

    # ---- per step -------------------------------------------------------------------

    def prepare(self, request_ids: list[str], reset: list[bool]) -> list[int]:
        """Make the states of one forward's requests resident; returns their slots.

        A request with `reset` True (it starts from token 0) gets a zeroed state, so nothing
        of an earlier occupant of the slot leaks. Others get their state back, swapped in
        from the host if it was evicted; states of requests not in `request_ids` are evicted
        least-recently-used first to make room.

        Raises:
            ValueError: more requests than device slots, or a repeated request id.
        """
        if len(request_ids) > self.max_resident:
            raise ValueError(f"{len(request_ids)} requests in one forward but only {self.max_resident} state slots")
        if len(set(request_ids)) != len(request_ids):
            raise ValueError(f"a request appears twice in one forward: {request_ids}")
        wanted = set(request_ids)
        for rid in request_ids:
            if rid in self._resident:
                self._resident.move_to_end(rid)
        slots = []
        for rid, fresh in zip(request_ids, reset):
            slot = self._resident.get(rid)
            if slot is None:
                slot = self._take_slot(wanted)
                self._resident[rid] = slot
                host = self._host.pop(rid, None)
                if host is not None and not fresh:
                    self._swap_in(slot, host)
                else:
                    self._zero(slot)
            elif fresh:
                self._zero(slot)
            slots.append(slot)
        return slots

    def free(self, request_id: str) -> None:
        """Drop `request_id`'s state (finished, aborted or preempted); no-op if it has none."""
        slot = self._resident.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)
        self._host.pop(request_id, None)

    def spec_row(self, slot: int, j: int) -> int:
        """Tensor row of slot `slot`'s speculative row j (0 <= j < num_spec_rows): the
        state after position j + 1 of a verify forward.

        Raises:
            IndexError: j or slot out of range.
        """
        if not (0 <= j < self.num_spec_rows and 0 <= slot < self.max_resident):
            raise IndexError(f"no speculative row {j} of slot {slot} ({self.num_spec_rows} rows x "
                             f"{self.max_resident} slots)")
        return self.max_resident + slot * self.num_spec_rows + j

    def accept(self, request_id: str, num_positions: int, num_verified: int) -> None:
        """After a verify forward over `num_verified` positions whose first `num_positions`
        were accepted (1 <= num_positions <= num_verified): give the request's slot the state
        after position `num_positions` (its speculative row num_positions - 1). With every
        position accepted the slot holds it already.

        Raises:
            ValueError: num_positions outside [1, num_verified].
        """
        if not 1 <= num_positions <= num_verified:
            raise ValueError(f"accepted positions {num_positions} outside [1, {num_verified}]")
        if num_positions < num_verified:
            s = self._resident[request_id]
            self.copy_row(self.spec_row(s, num_positions - 1), s)

    def slot_of(self, request_id: str) -> int:
        """The device slot of a resident request. Raises KeyError if it is not resident."""
        return self._resident[request_id]

    # ---- rows (checkpoints) ---------------------------------------------------------

    def checkpoint_row(self, i: int) -> int:
        """Tensor row of device checkpoint row i (0 <= i < num_checkpoint_rows)."""
        return self.max_resident * (1 + self.num_spec_rows) + i

    def copy_row(self, src: int, dst: int) -> None:
        """Copy tensor row `src` to row `dst` in every state tensor of every linear layer."""
        for t in self._all:
            t[dst].copy_(t[src])

    def read_row(self, row: int) -> list[torch.Tensor]:
        """Host copies of tensor row `row`, per linear layer its tensors in spec order
        (pinned on CUDA)."""
        return [self._host_copy(t[row]) for t in self._all]

    def write_row(self, row: int, host: list[torch.Tensor]) -> None:
        """Write host copies from `read_row` into tensor row `row`."""
        for t, h in zip(self._all, host, strict=True):
            t[row].copy_(h, non_blocking=self._pin)

    def restore(self, request_id: str, row: int | None = None, host: list[torch.Tensor] | None = None) -> None:
        """Set a resident request's state to a checkpoint: device
        tensor row `row`, or host copies `host` (from `read_row`). The checkpoint is read,
        never changed."""
        s = self._resident[request_id]
        if row is not None:
            self.copy_row(row, s)
        elif host is not None:
            self.write_row(s, host)
        else:
            raise ValueError("restore needs a device row or host copies")

    # ---- internals ------------------------------------------------------------------

    def _take_slot(self, keep: set[str]) -> int:
        if self._free:
            return self._free.popleft()
        victim = next(rid for rid in self._resident if rid not in keep)  # exists: len(keep) <= max_resident
        slot = self._resident.pop(victim)
        self._host[victim] = self._swap_out(slot)
        return slot

    def _host_copy(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=self._pin)
        out.copy_(x)
        return out

    def _swap_out(self, slot: int) -> list[torch.Tensor]:
        self.num_swap_outs += 1
        return self.read_row(slot)

    def _swap_in(self, slot: int, host: list[torch.Tensor]) -> None:
        self.num_swap_ins += 1
        self.write_row(slot, host)

    def _zero(self, slot: int) -> None:
        for t in self._all:
            t[slot].zero_()
