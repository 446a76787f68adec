"""repack.c against the torch formulation it replaces: the artifact's qweight from AutoAWQ,
GPTQ and compressed-tensors words, bit for bit, with random codes (every nibble value) and
shapes whose padding (N to 64, K to the group size) the kernel does not write."""

from __future__ import annotations

import pytest
import torch

from runtime.artifact import layout
from runtime.artifact.formats import AWQ_CODES, CT_CODES, GPTQ_CODES
from runtime.kernels import repack

WORDS = {  # the source's int32 words for an [N, K] linear
    "awq": (AWQ_CODES, lambda n, k: (k, n // 8)),
    "gptq": (GPTQ_CODES, lambda n, k: (k // 8, n)),
    "ct": (CT_CODES, lambda n, k: (n, -(-k // 8))),
}
SHAPES = [  # (N, K, group size)
    (64, 128, 128),
    (1024, 512, 128),
    (576, 1536, 64),
    (48, 96, 32),  # N padded to 64
    (80, 80, 32),  # N padded to 128, K to 96
    (16, 16, 32),
]


def _words(shape: tuple[int, int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    bits = torch.iinfo(torch.int32)
    return torch.randint(bits.min, bits.max, shape, dtype=torch.int32, generator=g)


@pytest.fixture(autouse=True)
def _library() -> None:
    if repack.library() is None:
        pytest.fail("repack.c did not build: the test machine needs a C compiler (cc)")


@pytest.mark.parametrize("fmt", sorted(WORDS))
@pytest.mark.parametrize(("n", "k", "gs"), SHAPES)
def test_repack_matches_torch(fmt: str, n: int, k: int, gs: int) -> None:
    codes, shape = WORDS[fmt]
    words = _words(shape(n, k), seed=n * 7 + k)
    got = repack.repack_codes(words, codes.locate, n, k, gs)
    want = layout.pack_qweight(codes.unpack(words, n, k), gs)
    assert got is not None and got.dtype == torch.int32
    assert torch.equal(got, want)


def test_partial_tiles_are_left_to_torch() -> None:
    """N = 24 or K = 40 leaves part of a 16 x 16 tile outside the matrix: the kernel reads
    whole tiles, so it declines and the caller packs in torch."""
    assert repack.repack_codes(_words((24, 40 // 8), 0), CT_CODES.locate, 24, 40, 32) is None
    assert repack.repack_codes(_words((40, 24 // 8), 0), AWQ_CODES.locate, 24, 40, 32) is None


def test_disabled_native_code_falls_back(monkeypatch) -> None:
    monkeypatch.setenv("LITESERVE_NATIVE", "0")
    repack.library.cache_clear()
    try:
        assert repack.repack_codes(_words((128, 8), 0), AWQ_CODES.locate, 64, 128, 128) is None
    finally:
        monkeypatch.delenv("LITESERVE_NATIVE")
        repack.library.cache_clear()
