"""What batch invariance relies on, checked on the model's device and dtype before it is relied on.

Batch invariance (`PackedForward(invariant=True)`, `kvblocks serve --batch-invariant`): a row of a
packed forward rounds the same whatever else is in the batch. CPU BLAS computes a row of a matrix
product the same way for any number of rows from `MIN_ROWS` up, but takes another kernel (GEMV and
friends) below it, so the forward adds a segment of padding rows (token 0, K/V written to scratch
slots) whenever fewer than `MIN_ROWS` rows would reach the output head, and so every matrix product
sees at least `MIN_ROWS` rows (`probe_row_invariance`). Attention rounds differently for different
key lengths, so the batched engine also cuts every prompt at the same positions however the budget
falls (`scheduler.chunk_ends`), and the cascade is cut at fixed positions (`fixed_cuts`, whose
assumptions `probe_blocks_invariance` checks). Together a request's logits are bit-identical
whether it runs alone or among others.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvblocks.engine.attention.fused import fused, lse_dtype

MIN_ROWS = 4  # fewest rows a linear layer runs on in batch-invariant forwards


def probe_row_invariance(device: torch.device | str, dtype: torch.dtype, width: int = 576) -> bool:
    """Whether a row of a matrix product on `device` in `dtype` comes out the same for every row
    count from `MIN_ROWS` up and whatever the other rows hold (what batch invariance relies on)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    w = torch.randn(3 * width, width, generator=g).to(device, dtype)
    x = torch.randn(300, width, generator=g).to(device, dtype)
    with torch.inference_mode():
        ref = F.linear(x[:MIN_ROWS], w)
        for rows in (MIN_ROWS + 1, 2 * MIN_ROWS + 3, 64, 300):
            if not torch.equal(F.linear(x[:rows], w)[:MIN_ROWS], ref):
                return False
        other = x[:64].clone()
        other[1:] = torch.randn(63, width, generator=g).to(device, dtype)
        return torch.equal(F.linear(other, w)[0], ref[0])


def probe_blocks_invariance(device: torch.device | str, dtype: torch.dtype, dim: int = 64) -> bool:
    """Whether what the fixed cuts (`fixed_cuts.FixedCuts`) rely on holds on `device` in `dtype`: a
    row of the fused attention call comes out the same for every row count that is a multiple of
    `MIN_ROWS`, wherever it lies among the rows and in any batch, and exp / log give an element the
    same bits wherever it lies in a tensor."""
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, dim, generator=g).to(device, dtype) for n in (800, 300, 300))
    with torch.inference_mode():
        ref = fused(q[:1, :, :MIN_ROWS], k[:1], v[:1], 0.125)
        for rows in (2 * MIN_ROWS, 36, 48, 68, 200, 260, 772):  # the 4 rows first, and in the last tile
            for first in (0, rows - MIN_ROWS):
                head = q[:, :, :rows].clone()
                head[:, :, first : first + MIN_ROWS] = q[:, :, :MIN_ROWS]
                o, lse = fused(head, k, v, 0.125)
                window = slice(first, first + MIN_ROWS)
                if not (torch.equal(o[:1, :, window], ref[0]) and torch.equal(lse[:1, :, window], ref[1])):
                    return False
        x = -torch.rand(4099, generator=g).to(device, lse_dtype(dtype)) * 30
        for fn in (torch.exp, lambda t: torch.log(-t)):
            whole = fn(x)
            if not all(
                torch.equal(fn(x[a : a + n]), whole[a : a + n])
                for a, n in ((0, 1), (3, 7), (5, 33), (64, 97))
            ):
                return False
    return True
