"""The W4A16 Triton GEMM against the pure-torch layout reference.

Weights are random codes, scales and zeros packed with ``pack_qweight`` / ``pack_qparams`` exactly
as the artifact writer does, and the kernel reads those tensors as they are, on the test device:
compiled on a GPU, interpreted (``TRITON_INTERPRET=1``, set by conftest) on the CPU, so shapes
stay small. On a GPU each case compiles once, so there they take turns over the configs
(``spread``), and ``test_gpu_real_sizes`` runs the tune space's corner configs at real sizes.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from runtime.artifact.layout import dequantize, pack_qparams, pack_qweight
from runtime.kernels.counters import arrival_counters
from runtime.kernels.triton.gemm import (
    DEQUANT_FROM_BUCKET,
    GEMV_TUNED_BUCKETS,
    M_BUCKETS,
    DequantConfig,
    DequantTile,
    GemmConfig,
    GemvConfig,
    _activation_pairs,
    choose_config,
    config_from_dict,
    config_space,
    gemv_config,
    gemv_space,
    heuristic_config,
    m_bucket,
    tune_space,
    w4a16_dequantize,
    w4a16_gemm,
    w4a16_gemv,
    w4a16_linear,
)
from tests.conftest import spread

F16, BF16 = torch.float16, torch.bfloat16
# Norm-relative error bound against the fp64 product with the reference W_hat: 2 * eps(dtype).
# The kernel rounds each dequantized weight to x's dtype and the output once more. Each rounding
# is below eps relative (half of it with round-to-nearest on a GPU; the interpreter truncates
# fp32 -> bf16, a full eps), the weight roundings are independent across the K terms, and fp32
# accumulation adds ~K * 2^-24. Seen: at most 3.3e-4 for fp16 (bound 1.95e-3), 6.3e-3 for bf16
# (bound 1.56e-2; fewest outputs at M = 1, N = 40).
TOL = {dt: 2 * torch.finfo(dt).eps for dt in (F16, BF16)}


def make_weight(
    n: int, k: int, group_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes, zeros and scales of a realistic magnitude, packed as the writer packs them."""
    groups = -(-k // group_size)
    q = torch.randint(0, 16, (n, k), dtype=torch.int32)
    scale = torch.rand(n, groups) * 0.02 + 0.002
    zero = torch.randint(0, 16, (n, groups), dtype=torch.int32)
    qweight = pack_qweight(q, group_size)
    qparams = pack_qparams(scale, zero, group_size, k)
    return qweight.to(device), qparams.to(device)


def rel_error(
    y: torch.Tensor, x: torch.Tensor, qweight: torch.Tensor, qparams: torch.Tensor, gs: int
) -> float:
    """Norm-relative error against the fp64 product, on the kernel's device."""
    n, k = y.shape[1], x.shape[1]
    ref = x.double() @ dequantize(qweight, qparams, n, k, gs).double().T
    return ((y.double() - ref).norm() / ref.norm()).item()


# (M, N, K, group_size, dtype): M edges 1, 3, 17; N 40 and 72 (not multiples of 64); K 80, 130,
# 200 not multiples of their group size, so qweight / qparams carry padded rows.
CASES = [
    (1, 72, 80, 32, F16),
    (3, 40, 200, 64, BF16),
    (17, 72, 130, 128, F16),
    (17, 40, 80, 32, BF16),
    (1, 40, 130, 128, BF16),
    (3, 72, 200, 64, F16),
]
# None: heuristic_config. block_k 32 divides every group size; split_k 3 leaves a short last slice.
CONFIGS = {
    "heuristic": None,
    "split1": GemmConfig(block_m=16, block_n=32, block_k=32, split_k=1, num_warps=4, num_stages=2),
    "split3": GemmConfig(block_m=16, block_n=64, block_k=32, split_k=3, num_warps=4, num_stages=2),
    "bm32": GemmConfig(block_m=32, block_n=64, block_k=32, split_k=2, num_warps=4, num_stages=3),
}


def case_id(value: object) -> str | None:
    if isinstance(value, tuple):
        m, n, k, gs, dtype = value
        return f"m{m}-n{n}-k{k}-g{gs}-{str(dtype)[6:]}"
    return None


@pytest.mark.parametrize(("case", "config_name"), spread(CASES, list(CONFIGS)), ids=case_id)
def test_matches_reference(
    case: tuple[int, int, int, int, torch.dtype], config_name: str, device: torch.device
) -> None:
    m, n, k, gs, dtype = case
    torch.manual_seed(1000 * m + 10 * n + k)
    qweight, qparams = make_weight(n, k, gs, device)
    x = torch.randn(m, k, dtype=dtype, device=device)
    y = w4a16_gemm(x, qweight, qparams, n, k, gs, CONFIGS[config_name])
    assert y.shape == (m, n) and y.dtype == dtype
    assert rel_error(y, x, qweight, qparams, gs) < TOL[dtype]


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_space_configs_agree(dtype: torch.dtype, device: torch.device) -> None:
    """Different tiles and split-K only reorder the fp32 sums: outputs differ by <= 1 ulp."""
    torch.manual_seed(7)
    m, n, k, gs = 3, 72, 200, 64
    qweight, qparams = make_weight(n, k, gs, device)
    x = torch.randn(m, k, dtype=dtype, device=device)
    space = config_space(m, n, k, gs)
    first, last = space[0], space[-1]
    assert first.block_n != last.block_n and first.split_k != last.split_k
    y1 = w4a16_gemm(x, qweight, qparams, n, k, gs, first).float()
    y2 = w4a16_gemm(x, qweight, qparams, n, k, gs, last).float()
    assert (y1 - y2).abs().max() <= torch.finfo(dtype).eps * y1.abs().max()
    assert rel_error(y2, x, qweight, qparams, gs) < TOL[dtype]


def test_split_k_is_deterministic(device: torch.device) -> None:
    """The last slice of a tile to finish sums the partials in split order in the same launch
    and sets the tile's counter back to 0: a second launch finds its counters at 0 (else its
    last slice would never see itself last, leaving y unwritten) and gives the same bits."""
    torch.manual_seed(8)
    n, k, gs = 40, 200, 64
    qweight, qparams = make_weight(n, k, gs, device)
    x = torch.randn(2, k, dtype=BF16, device=device)
    cfg = CONFIGS["split3"]
    y1 = w4a16_gemm(x, qweight, qparams, n, k, gs, cfg)
    assert not arrival_counters(device).any()
    y2 = w4a16_gemm(x, qweight, qparams, n, k, gs, cfg)
    assert torch.equal(y1, y2)


def test_strided_views(device: torch.device) -> None:
    """A column slice of x and an N-shard of the packed tensors (docs section 8) are views."""
    torch.manual_seed(9)
    n, k, gs = 136, 80, 32
    qweight, qparams = make_weight(n, k, gs, device)
    wide = torch.randn(3, k + 24, dtype=F16, device=device)
    x = wide[:, 5 : 5 + k]
    shard_w, shard_p = qweight[:, 128:], qparams[:, 64:]  # columns 64..135: N = 72
    assert not shard_w.is_contiguous() and not x.is_contiguous()
    y = w4a16_gemm(x, shard_w, shard_p, 72, k, gs, CONFIGS["split3"])
    ref = x.double() @ dequantize(qweight, qparams, n, k, gs)[64:].double().T
    assert ((y.double() - ref).norm() / ref.norm()).item() < TOL[F16]


def test_empty_batch(device: torch.device) -> None:
    qweight, qparams = make_weight(40, 80, 32, device)
    x = torch.empty(0, 80, dtype=F16, device=device)
    y = w4a16_gemm(x, qweight, qparams, 40, 80, 32)
    assert y.shape == (0, 40) and y.dtype == F16 and y.device == device


@pytest.mark.parametrize("gs", [32, 64, 128])
def test_config_space_is_valid(gs: int) -> None:
    for m in M_BUCKETS + (3, 300, 5000):
        for n, k in [(40, 80), (72, 200), (4096, 4096)]:
            space = config_space(m, n, k, gs)
            assert space and len(set(space)) == len(space)
            for cfg in space:
                cfg.check_group_size(gs)
                assert GemmConfig.from_dict(cfg.to_dict()) == cfg
                assert cfg.split_k <= -(-k // cfg.block_k)
            assert heuristic_config(m, n, k, gs) in space


@pytest.mark.parametrize(("m", "gs"), spread([1, 33, 130], [32, 64, 128]))
def test_space_configs_run(m: int, gs: int, device: torch.device) -> None:
    """About 4 configs spread over a bucket's space (the corners run in the GPU test)."""
    torch.manual_seed(m + gs)
    n, k = 72, 200
    qweight, qparams = make_weight(n, k, gs, device)
    x = torch.randn(m, k, dtype=F16, device=device)
    space = config_space(m, n, k, gs)
    for cfg in space[:: max(1, len(space) // 4)]:
        y = w4a16_gemm(x, qweight, qparams, n, k, gs, cfg)
        assert rel_error(y, x, qweight, qparams, gs) < TOL[F16], cfg


def test_config_round_trip() -> None:
    cfg = GemmConfig(block_m=32, block_n=128, block_k=64, split_k=4, num_warps=8, num_stages=3)
    d = cfg.to_dict()
    assert d == {
        "block_m": 32,
        "block_n": 128,
        "block_k": 64,
        "split_k": 4,
        "num_warps": 8,
        "num_stages": 3,
    }
    assert GemmConfig.from_dict(d) == cfg


GOOD = CONFIGS["split3"].to_dict()


@pytest.mark.parametrize(
    ("d", "key"),
    [
        ({k: v for k, v in GOOD.items() if k != "split_k"}, "split_k"),
        (GOOD | {"block_q": 16}, "block_q"),
        (GOOD | {"block_n": "64"}, "block_n"),
        (GOOD | {"num_stages": True}, "num_stages"),
        (GOOD | {"block_k": 48}, "block_k"),
        (GOOD | {"block_m": 8}, "block_m"),
        (GOOD | {"block_k": 256}, "block_k"),
        (GOOD | {"split_k": 0}, "split_k"),
        (GOOD | {"num_warps": 3}, "num_warps"),
        (GOOD | {"num_stages": 0}, "num_stages"),
    ],
)
def test_config_from_dict_errors(d: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        GemmConfig.from_dict(d)


@pytest.mark.parametrize(
    ("m", "bucket"),
    [(1, 1), (2, 2), (3, 4), (5, 8), (16, 16), (17, 32), (256, 256), (257, 512), (512, 512)]
    + [(513, 512), (100_000, 512)],
)
def test_m_bucket(m: int, bucket: int) -> None:
    assert m_bucket(m) == bucket


# The one-row kernel: the default (split where K allows), a split of 3 that leaves a short last
# slice, the smallest tiles, and wide ones on 4 warps.
GEMV_CONFIGS = {
    "default": None,
    "split3": GemvConfig(block_n=64, block_k=32, split_k=3, num_warps=2),
    "small": GemvConfig(block_n=16, block_k=16, split_k=1, num_warps=1),
    "wide": GemvConfig(block_n=128, block_k=32, split_k=2, num_warps=4),
}


@pytest.mark.parametrize(("case", "config_name"), spread(CASES, list(GEMV_CONFIGS)), ids=case_id)
def test_gemv_matches_reference(case: tuple, config_name: str, device: torch.device) -> None:
    """The one-row kernel applies each group's (s, b) to its sums of x_k q_kn instead of to
    every weight, so it rounds less than the tile kernel: the same bound holds (seen: 2.2e-4
    fp16, 3.4e-3 bf16). Rows past the first (M = 3, 17) run as programs of their own."""
    m, n, k, gs, dtype = case
    torch.manual_seed(1000 * m + 10 * n + k + 1)
    qweight, qparams = make_weight(n, k, gs, device)
    x = torch.randn(m, k, dtype=dtype, device=device)
    cfg = GEMV_CONFIGS[config_name] or gemv_config(n, k, gs)  # block_k 16 or 32: any group
    y = w4a16_gemv(x, qweight, qparams, n, k, gs, cfg)
    assert y.shape == (m, n) and y.dtype == dtype
    assert rel_error(y, x, qweight, qparams, gs) < TOL[dtype]
    assert torch.equal(y, w4a16_linear(x, qweight, qparams, n, k, gs, cfg))  # the same launch


def test_gemv_split_is_deterministic_and_strided(device: torch.device) -> None:
    """Partials summed in split order in the launch: the same bits twice, the counters back
    at 0 (test_split_k_is_deterministic). A column slice of x at an odd
    offset (copied: its pairs are not 4-byte words) and an N-shard of the packed tensors (read
    as they are) give the reference's product."""
    torch.manual_seed(10)
    n, k, gs = 136, 200, 64
    qweight, qparams = make_weight(n, k, gs, device)
    wide = torch.randn(1, k + 24, dtype=BF16, device=device)
    x = wide[:, 5 : 5 + k]
    shard_w, shard_p = qweight[:, 128:], qparams[:, 64:]  # columns 64..135: N = 72
    cfg = GEMV_CONFIGS["split3"]
    y1 = w4a16_gemv(x, shard_w, shard_p, 72, k, gs, cfg)
    assert not arrival_counters(device).any()
    assert torch.equal(y1, w4a16_gemv(x, shard_w, shard_p, 72, k, gs, cfg))
    ref = x.double() @ dequantize(qweight, qparams, n, k, gs)[64:].double().T
    assert ((y1.double() - ref).norm() / ref.norm()).item() < TOL[BF16]


@pytest.mark.parametrize("layout", ["odd-width", "transposed", "view"])
def test_gemv_reads_activations_of_any_layout(layout: str, device: torch.device) -> None:
    """The one-row kernel reads x as int32 pairs of adjacent activations: a row of odd length
    is padded with a zero and a transposed x copied, while a view whose pairs are 4-byte words
    (the engine's activations) is read in place, with no copy."""
    torch.manual_seed(12)
    k = 81 if layout == "odd-width" else 96
    qweight, qparams = make_weight(40, k, 32, device)
    if layout == "transposed":
        x = torch.randn(k, 2, dtype=F16, device=device).T
    elif layout == "view":
        x = torch.randn(2, k + 6, dtype=F16, device=device)[:, 4 : 4 + k]
        assert _activation_pairs(x).data_ptr() == x.data_ptr()
    else:
        x = torch.randn(2, k, dtype=F16, device=device)
    y = w4a16_gemv(x, qweight, qparams, 40, k, 32, gemv_config(40, k, 32))
    assert rel_error(y, x, qweight, qparams, 32) < TOL[F16]


@pytest.mark.parametrize(
    ("dtype", "exponent"), [(BF16, -60), (BF16, 0), (BF16, 40), (F16, -12), (F16, 12)]
)
def test_gemv_keeps_activations_of_every_magnitude(
    dtype: torch.dtype, exponent: int, device: torch.device
) -> None:
    """The one-row kernel multiplies codes read as fp32 subnormals by x scaled by up to 2^85
    and carries its sums scaled by 2^-64 (``_subnormal_code``): exact from |x| = 2^-62 to 2^42.
    Rows at both ends of that range for bf16, and at fp16's, keep the reference's bound."""
    torch.manual_seed(13 + exponent)
    n, k, gs = 72, 256, 128
    qweight, qparams = make_weight(n, k, gs, device)
    x = (torch.randn(1, k, dtype=torch.float64, device=device) * 2.0**exponent).to(dtype)
    y = w4a16_gemv(x, qweight, qparams, n, k, gs, GEMV_CONFIGS["split3"])
    assert y.isfinite().all()
    assert rel_error(y, x, qweight, qparams, gs) < TOL[dtype]


def test_one_row_runs_the_gemv(device: torch.device) -> None:
    """Without a pin a single row takes the one-row kernel; two rows the tile kernel."""
    assert isinstance(choose_config(1, 4096, 4096, 128), GemvConfig)
    assert isinstance(choose_config(2, 4096, 4096, 128), GemmConfig)
    torch.manual_seed(11)
    qweight, qparams = make_weight(72, 130, 128, device)
    x = torch.randn(1, 130, dtype=F16, device=device)
    y = w4a16_linear(x, qweight, qparams, 72, 130, 128, choose_config(1, 72, 130, 128))
    assert rel_error(y, x, qweight, qparams, 128) < TOL[F16]
    empty = w4a16_gemv(x[:0], qweight, qparams, 72, 130, 128, gemv_config(72, 130, 128))
    assert empty.shape == (0, 72)


@pytest.mark.parametrize("gs", [32, 64, 128])
def test_gemv_space_is_valid(gs: int) -> None:
    for n, k in [(40, 80), (72, 200), (4096, 14336)]:
        space = gemv_space(n, k, gs)
        assert space[0] == gemv_config(n, k, gs) and len(set(space)) == len(space)
        for cfg in space:
            cfg.check_group_size(gs)
            assert config_from_dict(cfg.to_dict()) == cfg
            assert cfg.split_k <= -(-k // gs)  # every slice has a group
        for m in GEMV_TUNED_BUCKETS:
            assert space[0] in tune_space(m, n, k, gs, None)
    past = max(GEMV_TUNED_BUCKETS) + 1
    assert not any(isinstance(c, GemvConfig) for c in tune_space(past, 72, 200, 64, None))


def test_gemv_space_configs_run(device: torch.device) -> None:
    """Every fourth config of the one-row space, interpreted (all of them compile offline)."""
    torch.manual_seed(12)
    n, k, gs = 72, 200, 64
    qweight, qparams = make_weight(n, k, gs, device)
    x = torch.randn(1, k, dtype=F16, device=device)
    for cfg in gemv_space(n, k, gs)[::4]:
        y = w4a16_gemv(x, qweight, qparams, n, k, gs, cfg)
        assert rel_error(y, x, qweight, qparams, gs) < TOL[F16], cfg


@pytest.mark.parametrize(
    ("d", "key"),
    [
        ({"gemv": 1, "block_n": 64, "block_k": 64, "split_k": 2}, "num_warps"),
        ({"gemv": 2, "block_n": 64, "block_k": 64, "split_k": 2, "num_warps": 2}, "gemv"),
        ({"gemv": 1, "block_n": 48, "block_k": 64, "split_k": 2, "num_warps": 2}, "block_n"),
        ({"gemv": 1, "block_n": 64, "block_k": 64, "split_k": 0, "num_warps": 2}, "split_k"),
        ({"gemv": 1, "block_n": 64, "block_k": 64, "split_k": 1, "num_warps": 3}, "num_warps"),
    ],
)
def test_gemv_config_from_dict_errors(d: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        config_from_dict(d)


def test_m_bucket_rejects_zero() -> None:
    with pytest.raises(ValueError, match="row count"):
        m_bucket(0)


Args = dict[str, object]
BAD_INPUTS: dict[str, tuple[Callable[[Args], Args], str]] = {
    "fp32 x": (lambda a: a | {"x": a["x"].float()}, "float16 or bfloat16"),
    "wrong K": (lambda a: a | {"x": a["x"].new_ones(2, 81)}, r"K=80"),
    "1-D x": (lambda a: a | {"x": a["x"][0]}, r"\[M, K=80\]"),
    "qweight of another N": (lambda a: a | {"n": 200}, "qweight"),
    "qweight of another group": (lambda a: a | {"group_size": 128}, "qweight"),
    "fp32 qparams": (lambda a: a | {"qparams": a["qparams"].float()}, "qparams"),
    "group size 48": (lambda a: a | {"group_size": 48}, "group_size"),
    "block_k over the group": (
        lambda a: a | {"config": GemmConfig(16, 64, 64, 1, 4, 2)},
        "block_k=64 does not divide group_size=32",
    ),
    # meta: a device other than the test device on any host
    "x on another device": (lambda a: a | {"x": a["x"].to("meta")}, "must share a device"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs(case: str, device: torch.device) -> None:
    qweight, qparams = make_weight(40, 80, 32, device)
    args: Args = {
        "x": torch.randn(2, 80, dtype=F16, device=device),
        "qweight": qweight,
        "qparams": qparams,
        "n": 40,
        "k": 80,
        "group_size": 32,
        "config": None,
    }
    mutate, message = BAD_INPUTS[case]
    with pytest.raises(ValueError, match=message):
        w4a16_gemm(**mutate(args))


@pytest.mark.parametrize(("n", "k", "gs"), [(72, 80, 32), (40, 200, 64), (72, 130, 128)])
def test_dequantize_gives_the_gemms_weights(n: int, k: int, gs: int, device: torch.device) -> None:
    """The dequantized path multiplies the very weights the GEMM does: the GEMM of the identity
    (one exact product per output) is W_hat^T, and w4a16_dequantize must give the same bits.
    N and K not multiples of 64 and of the group. In fp16 both are also the reference
    dequantization rounded once (the interpreter truncates to bf16, so bf16 is compared there
    with the GEMM only)."""
    torch.manual_seed(n + k)
    qweight, qparams = make_weight(n, k, gs, device)
    for dtype in (F16, BF16):
        w = w4a16_dequantize(qweight, qparams, n, k, gs, dtype)
        assert w.shape == (n, k) and w.dtype == dtype
        eye = torch.eye(k, dtype=dtype, device=device)
        wt = w4a16_gemm(eye, qweight, qparams, n, k, gs, CONFIGS["split1"])
        assert torch.equal(wt.T.contiguous().view(torch.int16), w.view(torch.int16)), dtype
        if dtype == F16 or device.type == "cuda":
            ref = dequantize(qweight, qparams, n, k, gs).to(dtype)
            assert torch.equal(ref.view(torch.int16), w.view(torch.int16)), dtype


def test_every_dequantization_tile_gives_the_same_bits(device: torch.device) -> None:
    """The tiles a benchmark may try (triton_bench.py's sweep) write the default tile's bits,
    over N and K that leave every tile partial; a tile the kernel cannot lay out is refused."""
    n, k, gs = 88, 200, 64
    torch.manual_seed(5)
    qweight, qparams = make_weight(n, k, gs, device)
    want = w4a16_dequantize(qweight, qparams, n, k, gs, F16)
    for tile in (DequantTile(16, 16, 1), DequantTile(64, 128, 8), DequantTile(32, 32, 2)):
        got = w4a16_dequantize(qweight, qparams, n, k, gs, F16, tile)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), tile
    for bad in (DequantTile(128, 64), DequantTile(8, 64), DequantTile(32, 48)):
        with pytest.raises(ValueError, match="block_k must divide the group size 64"):
            w4a16_dequantize(qweight, qparams, n, k, gs, F16, bad)


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_prefill_rows_run_dequantized(dtype: torch.dtype, device: torch.device) -> None:
    """From DEQUANT_FROM_BUCKET rows the backend's choice is the dequantized weights and torch's
    matmul, within the GEMM's tolerance; below it the heuristic tile config. A pin may choose
    either (``{"dequant": 1}`` round-trips), and `lite tune` times the dequantized path past
    the decode rows."""
    n, k, gs = 72, 130, 64
    torch.manual_seed(3)
    qweight, qparams = make_weight(n, k, gs, device)
    m = DEQUANT_FROM_BUCKET // 2 + 1  # the first row count of the bucket
    assert m_bucket(m) == DEQUANT_FROM_BUCKET
    assert choose_config(m, n, k, gs) == DequantConfig()
    assert choose_config(m - 1, n, k, gs) == heuristic_config(m - 1, n, k, gs)
    x = torch.randn(m, k, dtype=dtype, device=device)
    y = w4a16_linear(x, qweight, qparams, n, k, gs, DequantConfig())
    assert y.shape == (m, n) and y.dtype == dtype
    assert rel_error(y, x, qweight, qparams, gs) < TOL[dtype]
    assert config_from_dict({"dequant": 1}) == DequantConfig()
    cfg = heuristic_config(1, n, k, gs)
    assert config_from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="missing"):
        config_from_dict({"dequant": 0})
    assert DequantConfig() not in tune_space(16, n, k, gs, 2)
    assert tune_space(17, n, k, gs, 2) == [*config_space(17, n, k, gs)[:2], DequantConfig()]
    with pytest.raises(ValueError, match="x must be"):
        w4a16_linear(x.float(), qweight, qparams, n, k, gs, DequantConfig())
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        w4a16_dequantize(qweight, qparams, n, k, gs, torch.float32)


def corner_configs(m: int, n: int, k: int, gs: int) -> list[GemmConfig | None]:
    """The heuristic and the tune space's corners: its first config (smallest tiles, fewest
    stages), its last (largest tiles, deepest split), and the one holding the most shared
    memory; the full space is what `lite tune` times, one compile per config."""
    space = config_space(m, n, k, gs)
    most_smem = max(space, key=lambda c: (c.block_m + c.block_n) * c.block_k * c.num_stages)
    return [None, *dict.fromkeys([space[0], space[-1], most_smem])]


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("n", "k", "gs", "dtype"),
    [(4136, 4096, 128, BF16), (1000, 2000, 64, F16), (576, 1536, 32, BF16)],
)
def test_gpu_real_sizes(n: int, k: int, gs: int, dtype: torch.dtype, device: torch.device) -> None:
    """Compiled kernels at real sizes, every row bucket family (decode, mid, large) with odd M:
    the heuristic and the corner configs of the tune space; for one row also the one-row
    kernel's default and its space's first and last configs."""
    torch.manual_seed(n + k)
    qweight, qparams = make_weight(n, k, gs, device)
    for m in (1, 7, 40, 300):
        x = torch.randn(m, k, dtype=dtype, device=device)
        for cfg in corner_configs(m, n, k, gs):
            y = w4a16_gemm(x, qweight, qparams, n, k, gs, cfg)
            assert rel_error(y, x, qweight, qparams, gs) < TOL[dtype], (m, cfg)
    x = torch.randn(1, k, dtype=dtype, device=device)
    space = gemv_space(n, k, gs)
    for cfg in dict.fromkeys([space[0], space[1], space[-1]]):
        y = w4a16_gemv(x, qweight, qparams, n, k, gs, cfg)
        assert rel_error(y, x, qweight, qparams, gs) < TOL[dtype], cfg


@pytest.mark.gpu
def test_gpu_split_k_sums_replay_in_a_cuda_graph(device: torch.device) -> None:
    """Split-K summed in the launch, captured in a CUDA graph as the engine's decode steps
    are: replayed on new activations, the one-row kernel and a split tile config give an eager
    launch's bits, and the device's counters are 0 after every replay."""
    torch.manual_seed(22)
    n, k, gs = 1000, 2048, 128
    qweight, qparams = make_weight(n, k, gs, device)
    x1, x2 = (torch.randn(m, k, dtype=BF16, device=device) for m in (1, 7))
    gemv = gemv_config(n, k, gs)
    tile = GemmConfig(block_m=16, block_n=64, block_k=128, split_k=4, num_warps=4, num_stages=2)
    assert gemv.split_k > 1
    runs = (
        lambda: w4a16_gemv(x1, qweight, qparams, n, k, gs, gemv),
        lambda: w4a16_gemm(x2, qweight, qparams, n, k, gs, tile),
    )
    for run in runs:
        run()  # compiled outside the capture
    stream = torch.cuda.Stream(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        outs = [run() for run in runs]
    counters = arrival_counters(device)
    for step in range(3):
        x1.copy_(torch.randn_like(x1))
        x2.copy_(torch.randn_like(x2))
        graph.replay()
        torch.cuda.synchronize(device)
        for out, run in zip(outs, runs, strict=True):
            assert torch.equal(out, run()), step
        assert not counters.any(), step


@pytest.mark.gpu
def test_gpu_counters_are_made_outside_captures(device: torch.device) -> None:
    """One zeroed buffer a device, whatever stream captures or replays: the engine captures a
    decode graph per batch bucket, largest first, and replays the smaller ones first; a buffer
    first made inside one capture would be zeroed only by that graph's replays (2026-12-05's
    review found exactly that). Inside a capture, a buffer too small is refused, not made."""
    counters = arrival_counters(device)
    stream = torch.cuda.Stream(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        assert arrival_counters(device) is counters
        assert arrival_counters(torch.device("cuda")) is counters  # the current device
        with pytest.raises(RuntimeError, match="outside the capture first"):
            arrival_counters(device, counters.numel() + 1)
        done = counters[:1] + 1  # something to capture
    graph.replay()
    torch.cuda.synchronize(device)
    assert done.item() == 1 and not counters.any()
