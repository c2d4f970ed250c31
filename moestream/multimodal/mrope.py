"""M-RoPE positions of a multimodal prompt (Qwen2-VL, arXiv 2409.12191), as transformers'
`Qwen3_5MoeModel.get_rope_index` computes them.

Text tokens take the next position on all three axes. A vision item of (t, h, w) patches
covers t * (h/m) * (w/m) tokens (m = spatial merge size); starting from the current
position s, token (i, j, k) sits at (s + i, s + j, s + k), and the next token after the
item at s + max(h, w) / m (images have t = 1).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def mrope_positions(num_tokens: int, spans: Sequence[tuple[int, tuple[int, int, int]]],
                    spatial_merge_size: int) -> tuple[torch.Tensor, int]:
    """Positions [3, num_tokens] int64 and the rope delta (max position + 1 - num_tokens).

    Args:
        num_tokens: prompt length (tokens).
        spans: (offset of the item's first placeholder token, (t, h, w) grid) per item, in
            order, not overlapping; the item covers t * h * w / m**2 tokens.
        spatial_merge_size: m.

    Raises:
        ValueError: spans out of order, overlapping, or past the prompt's end.
    """
    m = spatial_merge_size
    pos = torch.empty(3, num_tokens, dtype=torch.int64)
    cur, done = 0, 0  # next position, tokens placed
    for offset, (t, h, w) in spans:
        gh, gw = h // m, w // m
        n = t * gh * gw
        if offset < done or offset + n > num_tokens:
            raise ValueError(f"vision tokens at [{offset}, {offset + n}) overlap or pass the prompt's {num_tokens} tokens")
        text = offset - done
        pos[:, done:offset] = torch.arange(cur, cur + text)
        cur += text
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
        pos[0, offset:offset + n] = tt.reshape(-1) + cur
        pos[1, offset:offset + n] = hh.reshape(-1) + cur
        pos[2, offset:offset + n] = ww.reshape(-1) + cur
        cur += max(gh, gw)
        done = offset + n
    pos[:, done:] = torch.arange(cur, cur + num_tokens - done)
    delta = int(pos.max()) + 1 - num_tokens if num_tokens else 0
    return pos, delta
