"""Another tool's int4 words straight into the artifact's qweight, with repack.c.

`lite convert` and `runtime serve` of an AutoAWQ/GPTQ/compressed-tensors checkpoint spend
most of their time here: an 8B model holds 7 billion codes. The torch formulation (unpack
every code to a byte, permute, pack) is the reference and the fallback; this path reads the
source words once, guided by a table of where each code of one 16 x 16 tile sits.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import torch

from runtime.artifact.layout import TILE, padded_shape, tile_order
from runtime.kernels import native
from runtime.kernels.build_cache import BuildUnavailable

SOURCE = Path(__file__).with_name("repack.c")
_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {"repack_tiles": [_P, _P, *[_I64] * 5, _P, _P]}

# (k, n, N, K) -> (index into the source's flattened words, bit shift) of code (k, n)
Locator = Callable[[torch.Tensor, torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor]]


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled repacker, or None (no compiler, LITESERVE_NATIVE=0): the caller packs in
    torch then, which gives the same bytes more slowly."""
    try:
        return native.load_native(SOURCE, _SIGNATURES)
    except BuildUnavailable:
        return None


def repack_codes(
    words: torch.Tensor, locate: Locator, n: int, k: int, group_size: int
) -> torch.Tensor | None:
    """The int32 qweight [Kp / 16, 2 * Np] of the codes in `words`, or None when the C path
    cannot do it (no library, or a shape with partial 16 x 16 tiles, which real models do
    not have): the caller then unpacks and packs in torch."""
    lib = library()
    if lib is None or n % TILE or k % TILE or words.dtype != torch.int32:
        return None
    words = words.contiguous()
    tk, tn = tile_order()
    offset, shift = locate(tk.flatten(), tn.flatten(), n, k)  # tile (0, 0) starts at word 0
    corners = locate(torch.tensor([TILE, 0]), torch.tensor([0, TILE]), n, k)[0].tolist()
    offset = offset.to(torch.int64).contiguous()
    shift = shift.to(torch.int32).contiguous()
    np_, kp = padded_shape(n, k, group_size)
    qweight = torch.empty((kp // TILE, 2 * np_), dtype=torch.int32)
    qweight[k // TILE :] = 0  # the padding; the kernel writes every other word
    qweight[:, 2 * n :] = 0
    lib.repack_tiles(
        words.data_ptr(),
        qweight.data_ptr(),
        k // TILE,
        n // TILE,
        *corners,  # the first words of tiles (1, 0) and (0, 1): the tile strides
        qweight.shape[1],
        offset.data_ptr(),
        shift.data_ptr(),
    )
    return qweight
