"""The Mamba-2 mixer's chunked SSD scan against its own recurrent step run token by token
(the recurrence as the Mamba-2 paper writes it): outputs and final state, across chunk
boundaries, from a nonzero state, with grouped B/C and strong decay."""

from __future__ import annotations

import pytest
import torch

from moestream.config import Mamba2Config
from moestream.layers.mamba2 import Mamba2Mixer


@pytest.mark.parametrize(("n", "chunk"), [(2, 16), (16, 16), (37, 16), (37, 5), (9, 256)])
def test_chunked_scan_equals_the_recurrence(n: int, chunk: int) -> None:
    torch.manual_seed(n * 7 + chunk)
    cfg = Mamba2Config(num_heads=4, head_dim=8, state_size=6, num_groups=2, conv_kernel=4, conv_bias=True,
                       proj_bias=False, chunk_size=chunk)
    mixer = Mamba2Mixer(32, cfg, 1e-5)
    with torch.no_grad():
        mixer.D.copy_(torch.randn(4))
    xbc = torch.randn(n, cfg.conv_dim)
    dt = torch.rand(n, 4) * 2  # up to exp(-2 * 6) per step: strong decay in some heads
    A = -torch.tensor([0.1, 1.0, 3.0, 6.0])
    h0 = torch.randn(4, 8, 6)

    y, h = mixer._scan(xbc, dt, A, h0)

    want, state = [], h0[None]
    for t in range(n):
        out, state = mixer._step(state, xbc[t:t + 1], dt[t:t + 1], A)
        want.append(out[0])
    torch.testing.assert_close(y, torch.stack(want), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h, state[0], rtol=1e-5, atol=1e-5)
