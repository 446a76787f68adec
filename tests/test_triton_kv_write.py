"""The Triton KV write against ``KVCache.write``: every pool tensor must come out bit for bit
the same (codes, fp16 scales and zeros compared as raw bits), padding slots untouched.

Inputs cover what the quantizer's rounding steps are sensitive to: random rows, a large
range (beyond fp16, saturating), constant vectors, negative values just below zero (zero
rounds to -2**-24), a tiny range (subnormal scale), and exact round-half-even ties next to
values one ulp below a tie. The kernel writes a pool on the test device (compiled on a GPU,
interpreted under ``TRITON_INTERPRET=1`` on the CPU); the reference writes a CPU pool, the
contract's own formulation. On a GPU, where each case compiles, the cases take turns over the
slot dtypes (``spread``).
"""

from __future__ import annotations

import pytest
import torch

from runtime.kernels.triton.kv_write import kv_write
from runtime.kv.cache import KVCache
from runtime.kv.format import KVSpec
from tests.conftest import spread

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
POOL = ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero")


def special_rows(head_dim: int, qmax: int, gen: torch.Generator) -> torch.Tensor:
    """[6, head_dim] fp32 rows that stress the rounding (see the module docstring)."""
    ramp = torch.arange(head_dim, dtype=F32)
    ties = torch.full((head_dim,), 0.5)
    ties[0], ties[1] = 0.0, float(qmax)  # zero 0 and scale exactly 1: codes are round(x)
    half = torch.arange(head_dim - 2) % qmax + 0.5  # k + 0.5: exact ties, both parities
    ties[2:] = torch.where(torch.arange(head_dim - 2) % 3 == 0, half.nextafter(-half), half)
    return torch.stack(
        [
            torch.randn(head_dim, generator=gen) * 3e4 + ramp * 1e3,  # beyond fp16: saturates
            torch.full((head_dim,), 1.2345),  # constant: fp16-representable only approximately
            -torch.rand(head_dim, generator=gen) * 1e-9,  # min rounds to -0: zero is -2**-24
            1 + torch.rand(head_dim, generator=gen) * 1e-6,  # range below one fp16 ulp
            ties,
            torch.randn(head_dim, generator=gen) - 7.5,
        ]
    )


def make_inputs(num_tokens: int, kv_heads: int, head_dim: int, qmax: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(num_tokens, kv_heads, head_dim, generator=gen) * 2 + 0.5
    v = torch.randn(num_tokens, kv_heads, head_dim, generator=gen)
    rows = special_rows(head_dim, qmax, gen)
    k[: len(rows), 0] = rows
    v[-len(rows) :, -1] = rows.flip(0)
    return k, v, gen


def assert_same_pool(a: KVCache, b: KVCache) -> None:
    """Every tensor of every layer bit for bit (``a`` on any device, ``b`` on the CPU)."""
    for name in POOL:
        for layer, (ka, kb) in enumerate(zip(a.layers, b.layers, strict=True)):
            x, y = getattr(ka, name), getattr(kb, name)
            if x is None:
                assert y is None
                continue
            x = x.cpu()
            bits = torch.int16 if x.element_size() == 2 else x.dtype
            bits = torch.int32 if x.dtype == F32 else bits
            assert torch.equal(x.view(bits), y.view(bits)), f"{name}[{layer}] differs"


CASES = [  # kv_quant, cache dtype, input dtype, block_size, kv heads, head_dim
    ("int8", F16, F32, 16, 2, 32),
    ("int8", BF16, F16, 32, 1, 16),
    ("int8", F16, BF16, 16, 3, 64),
    ("int8", F32, F32, 16, 2, 24),  # head_dim 24: a masked 32-wide tile
    ("int4", F16, F32, 16, 2, 32),
    ("int4", BF16, BF16, 32, 2, 16),
    ("int4", F16, F16, 16, 1, 64),
    ("int4", F16, F32, 16, 2, 20),
    ("none", F16, F16, 16, 2, 32),
    ("none", BF16, BF16, 32, 2, 16),
    ("none", F32, F32, 16, 1, 24),
    ("none", BF16, F32, 16, 2, 32),  # cast to the cache dtype on the way in
    ("none", F16, BF16, 16, 2, 16),
]


def case_id(value) -> str:
    if isinstance(value, tuple):
        return f"{value[0]}-{str(value[1])[6:]}-from-{str(value[2])[6:]}-d{value[5]}"
    return {torch.int64: "i64", torch.int32: "i32"}[value]


@pytest.mark.parametrize(
    ("case", "slot_dtype"), spread(CASES, [torch.int64, torch.int32]), ids=case_id
)
def test_kv_write_matches_cache_write(case, slot_dtype, device):
    kv_quant, cache_dtype, in_dtype, block_size, kv_heads, head_dim = case
    spec = KVSpec(2, kv_heads, head_dim, block_size, kv_quant, cache_dtype)
    qmax = {"int8": 255, "int4": 15, "none": 15}[kv_quant]
    num_tokens = 20
    k, v, gen = make_inputs(num_tokens, kv_heads, head_dim, qmax, seed=head_dim + block_size)
    k, v = k.to(in_dtype), v.to(in_dtype)
    num_blocks = 3
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[6 + torch.randperm(num_tokens - 12, generator=gen)[:4]] = -1  # padding, not special
    ours, theirs = KVCache(spec, num_blocks, device), KVCache(spec, num_blocks)
    kv_write(ours.layer(1), k.to(device), v.to(device), slots.to(device, slot_dtype))
    theirs.layer(1).write(k, v, slots)
    assert_same_pool(ours, theirs)


def test_kv_write_strided_inputs_and_overwrite(device):
    """k/v as views of a fused qkv projection; a second write overwrites some slots."""
    spec = KVSpec(1, 2, 32, 16, "int4", F16)
    gen = torch.Generator().manual_seed(5)
    ours, theirs = KVCache(spec, 2, device), KVCache(spec, 2)
    for _ in range(2):
        qkv = torch.randn(6, 4 + 2 + 2, 32, generator=gen).to(BF16)
        slots = torch.randperm(32, generator=gen)[:6]
        on_device = qkv.to(device)
        k, v = on_device[:, 4:6], on_device[:, 6:]
        assert not k.is_contiguous()
        kv_write(ours.layer(0), k, v, slots.to(device))
        theirs.layer(0).write(qkv[:, 4:6], qkv[:, 6:], slots)
    assert_same_pool(ours, theirs)


def test_kv_write_no_tokens_is_a_no_op(device):
    spec = KVSpec(1, 2, 16, 16, "int8", F16)
    cache = KVCache(spec, 1, device)
    empty = torch.empty(0, 2, 16, dtype=F16, device=device)
    kv_write(cache.layer(0), empty, empty, torch.empty(0, dtype=torch.long, device=device))
    assert not cache.layer(0).k.any() and not cache.layer(0).k_scale.any()


@pytest.mark.parametrize(
    ("change", "match", "where"),
    [
        ({"k": lambda d: torch.ones(3, 2, 8, device=d)}, "expects k, v \\[3, 2, 16\\]", "device"),
        ({"v": lambda d: torch.ones(4, 2, 16, device=d)}, "expects k, v \\[3, 2, 16\\]", "device"),
        (
            {"k": lambda d: torch.ones(3, 2, 16, dtype=torch.float64, device=d)},
            "k must be float16",
            "device",
        ),
        (
            {"slots": lambda d: torch.tensor([0.0, 1.0, 2.0], device=d)},
            "slot_mapping must be int32 or int64",
            "device",
        ),
        (
            {"slots": lambda d: torch.tensor([[0, 1, 2]], device=d)},
            "slot_mapping must be int32 or int64 \\[T\\]",
            "device",
        ),
        (
            {"slots": lambda d: torch.tensor([0, 1, 2], device="meta")},
            "slot_mapping is on meta, the KV cache on",
            "device",
        ),
        # slot values are checked only on CPU slots (on a GPU the check would sync per layer)
        (
            {"slots": lambda d: torch.tensor([0, 32, -1], device=d)},
            "slot 32 out of range for 32 slots",
            "cpu",
        ),
    ],
)
def test_kv_write_rejects_bad_inputs(change, match, where, device):
    dev = torch.device("cpu") if where == "cpu" else device
    cache = KVCache(KVSpec(2, 2, 16, 16, "int8", F16), 2, dev)
    args = {
        "k": torch.ones(3, 2, 16, device=dev),
        "v": torch.ones(3, 2, 16, device=dev),
        "slots": torch.tensor([0, 1, 2], device=dev),
    }
    args.update({key: make(dev) for key, make in change.items()})
    with pytest.raises(ValueError, match=match):
        kv_write(cache.layer(0), args["k"], args["v"], args["slots"])
