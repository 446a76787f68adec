"""The C decode kernels (runtime/kernels/cpu_decode.c): attention against the torch reference,
the KV quantizer bit for bit against quantize_kv, and how the library is built and refused."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import pytest
import torch

from runtime.kernels import cpu, native, reference
from runtime.kernels.ops import select_backend
from runtime.kv.cache import KVCache
from runtime.kv.format import KVSpec

HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 64, 16


def _filled_cache(
    kv_quant: str, dtype: torch.dtype, lens: list[int], g: torch.Generator
) -> tuple[KVCache, list[torch.Tensor]]:
    """Sequences of `lens` tokens on shuffled, non-contiguous blocks."""
    spec = KVSpec(1, KV_HEADS, DIM, BLOCK, kv_quant, dtype)
    total = sum(-(-n // BLOCK) for n in lens)
    cache = KVCache(spec, num_blocks=total + 7)
    perm = torch.randperm(total + 7, generator=g)
    tables, used = [], 0
    for n in lens:
        blocks = -(-n // BLOCK)
        tables.append(perm[used : used + blocks])
        used += blocks
        kv = torch.randn(2, n, KV_HEADS, DIM, generator=g) * 2
        cache.layer(0).write(kv[0], kv[1], cache.layer(0).slots_for(tables[-1], n))
    return cache, tables


@pytest.mark.parametrize(
    ("kv_quant", "kv_dtype"),
    [
        ("none", torch.float32),
        ("none", torch.bfloat16),
        ("none", torch.float16),
        ("int8", torch.float32),  # quantized: dtype is only the reference's K/V
        ("int4", torch.float32),
    ],
)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [[37], [5, 300, 129, 64, 700, 1]])  # serial, then threaded
def test_decode_attention_matches_reference(kv_quant, kv_dtype, q_dtype, lens) -> None:
    """q is a strided view (as the model's q beside k is). Tolerance: 1e-5 with fp32 queries
    (same math, different summation order); bf16 output rounds at 2^-8 (1e-2 relative)."""
    g = torch.Generator().manual_seed(len(lens) + 7 * len(kv_quant))
    cache, tables = _filled_cache(kv_quant, kv_dtype, lens, g)
    n = len(lens)
    qk = torch.randn(n, HEADS + KV_HEADS, DIM, generator=g).to(q_dtype)
    q = qk[:, :HEADS]
    attn = cpu.CpuAttention(tables, lens, [1] * n, cpu.decode_batch(tables, lens, [1] * n, BLOCK))
    got = cpu.paged_attention(q, cache.layer(0), attn, DIM**-0.5, None, lib=native.library())
    got = got.float()
    want = reference.paged_attention(
        q.float(), cache.layer(0), tables, lens, [1] * n, DIM**-0.5, None
    ).float()
    assert got.dtype == want.dtype and got.shape == want.shape
    if q_dtype == torch.float32:
        assert torch.allclose(got, want, atol=1e-5), float((got - want).abs().max())
    else:
        rel = float((got - want).norm() / want.norm())
        assert rel < 1e-2, rel


@pytest.mark.parametrize("kv_quant", ["none", "int8", "int4"])
def test_decode_attention_gives_a_sequence_the_same_bits_alone_and_in_a_batch(kv_quant) -> None:
    """Alone (serial below the parallel threshold) and among others (parallel tasks finishing
    in any order), a sequence's attention output is bit-identical, so its tokens do not
    depend on the batch it shares."""
    g = torch.Generator().manual_seed(3)
    lens = [300, 64, 129, 5]
    cache, tables = _filled_cache(kv_quant, torch.float32, lens, g)
    q = torch.randn(len(lens), HEADS, DIM, generator=g)

    def attend(rows: list[int]) -> torch.Tensor:
        ts, ls = [tables[i] for i in rows], [lens[i] for i in rows]
        ones = [1] * len(rows)
        attn = cpu.CpuAttention(ts, ls, ones, cpu.decode_batch(ts, ls, ones, BLOCK))
        return cpu.paged_attention(
            q[rows].contiguous(), cache.layer(0), attn, DIM**-0.5, None, lib=native.library()
        )

    together = attend([0, 1, 2, 3])
    for i in range(len(lens)):
        assert torch.equal(attend([i])[0], together[i])


def _hard_rows(g: torch.Generator, tokens: int) -> torch.Tensor:
    """[tokens, KV_HEADS, DIM]: random scales plus the quantizer's edge cases."""
    x = torch.randn(tokens, KV_HEADS, DIM, generator=g)
    x = x * torch.logspace(-6, 3, tokens)[:, None, None]
    x[0, 0] = 0.37  # constant row
    x[1, 1] = -1e6  # beyond fp16: saturates
    x[2, 0, ::2] = 7e4
    x[3, 1] = 1e-9 * torch.randn(DIM, generator=g)  # below fp16's subnormals
    return x


@pytest.mark.parametrize("kv_quant", ["int8", "int4"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_write_is_bit_identical_to_quantize_kv(kv_quant: str, x_dtype: torch.dtype) -> None:
    """K and V as strided views of one qkv row (as the model passes them), with padding
    slots; every code, scale and zero must equal the torch quantizer's."""
    g = torch.Generator().manual_seed(3)
    tokens = 40
    qkv = torch.empty(tokens, (HEADS + 2 * KV_HEADS) * DIM + 16)
    qkv[:, : HEADS * DIM] = torch.randn(tokens, HEADS * DIM, generator=g)
    qkv[:, HEADS * DIM : (HEADS + KV_HEADS) * DIM] = _hard_rows(g, tokens).flatten(1)
    qkv[:, (HEADS + KV_HEADS) * DIM : -16] = _hard_rows(g, tokens).flip(0).flatten(1)
    qkv = qkv.to(x_dtype)
    k = qkv[:, HEADS * DIM : (HEADS + KV_HEADS) * DIM].view(tokens, KV_HEADS, DIM)
    v = qkv[:, (HEADS + KV_HEADS) * DIM : -16].view(tokens, KV_HEADS, DIM)
    slots = torch.randperm(64, generator=g)[:tokens]
    slots[5] = slots[17] = -1
    spec = KVSpec(2, KV_HEADS, DIM, BLOCK, kv_quant, torch.float32)
    torch_side, c_side = KVCache(spec, num_blocks=4), KVCache(spec, num_blocks=4)
    torch_side.layer(1).write(k, v, slots)
    cpu.kv_write(c_side.layer(1), k, v, slots, lib=native.library())
    for name in ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero"):
        a, b = getattr(torch_side.layer(1), name), getattr(c_side.layer(1), name)
        assert torch.equal(a, b), f"{name}: {int((a != b).sum())} elements differ"
    assert bool(c_side.layer(1).k_scale.flatten()[: BLOCK * 4].ne(0).any())  # it wrote


@pytest.mark.build
def test_library_is_built_once_and_cached(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LITESERVE_CACHE", str(tmp_path))
    first = native.build()
    assert first.parent == tmp_path / "native" and first.stat().st_size > 0
    inode = first.stat().st_ino  # a rebuild renames a new file over it (the use stamps mtime)
    assert native.build() == first and first.stat().st_ino == inode
    left = [p.name for p in first.parent.iterdir() if p.suffix != ".lock"]
    assert left == [first.name]  # no temporary left (the lock file stays, empty)


@pytest.mark.build
def test_missing_compiler_is_named(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LITESERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-cc")
    with pytest.raises(native.BuildUnavailable, match="no C compiler.*no-such-cc"):
        native.build()


@pytest.mark.build
def test_cc_with_arguments_builds(tmp_path, monkeypatch) -> None:
    """$CC is a command and its arguments, as make reads it (`ccache gcc`): the whole string
    was looked up as one program, "not on PATH", and the kernels fell back to torch's ops."""
    monkeypatch.setenv("LITESERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "cc -DLITESERVE_CC_ARG=1")
    lib = ctypes.CDLL(str(native.build()))
    assert lib.decode_attention
    monkeypatch.setenv("CC", "false")  # a compiler that fails without a word is still named
    silent = "(?s)false failed to build.*exit status 1, no message"
    with pytest.raises(native.BuildUnavailable, match=silent):
        native.build()


@pytest.mark.build
def test_broken_build_names_the_compiler_error(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LITESERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "FLAGS", [*native.FLAGS, "-fno-such-flag"])
    with pytest.raises(native.BuildUnavailable, match="(?s)failed to build.*no-such-flag"):
        native.build()
    left = [p for p in (tmp_path / "native").iterdir() if p.suffix != ".lock"]
    assert not left  # nothing half-written


def test_backend_says_which_decode_kernels_it_runs(monkeypatch) -> None:
    assert "C kernels, " in select_backend("cpu", {}).detail
    monkeypatch.setenv("LITESERVE_NATIVE", "0")
    native.library.cache_clear()
    try:
        backend = select_backend("cpu", {})
        assert "torch decode attention (disabled by LITESERVE_NATIVE=0)" in backend.detail
        assert backend.lib is None
    finally:
        native.library.cache_clear()


@pytest.mark.build
def test_compiler_without_openmp_still_builds(tmp_path, monkeypatch) -> None:
    """Apple's clang has no -fopenmp: the kernels are built single-threaded instead."""
    fake = tmp_path / "cc-no-openmp"
    fake.write_text(
        '#!/bin/sh\ncase "$*" in *-fopenmp*) echo "unsupported option -fopenmp" >&2; exit 1;; '
        'esac\nexec cc "$@"\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("LITESERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(fake))
    path = native.build()
    lib = ctypes.CDLL(str(path))
    assert lib.decode_attention and lib.kv_write_quantized


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 33])
def test_rms_norm_matches_torch(dtype: torch.dtype, rows: int) -> None:
    """Strided rows (a slice of a wider tensor). bf16/fp16: the same single rounding as torch's
    fused op, so equal but where the fp32 mean of squares, summed in another order (the SIMD
    width differs by ISA), lands an element on the other side of a rounding boundary: then one
    step of the output's precision, on under 1% of the elements; fp32: within summation order
    (1e-6 relative)."""
    g = torch.Generator().manual_seed(rows)
    wide = (torch.randn(rows, 700, generator=g) * 3).to(dtype)
    x, w = wide[:, 50:626], torch.randn(576, generator=g).to(dtype)
    got = cpu.rms_norm(x, w, 1e-5, lib=native.library())
    want = torch.nn.functional.rms_norm(x, (576,), w, 1e-5)
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    else:
        step = torch.finfo(dtype).eps * want.float().abs().clamp_min(torch.finfo(dtype).tiny)
        off = got != want
        assert int(off.sum()) <= 0.01 * want.numel(), int(off.sum())
        assert bool(((got.float() - want.float()).abs() <= step * 1.01).all())
    # 3-D rows (q/k norms over heads) go through torch's op
    assert torch.equal(cpu.rms_norm(x.unsqueeze(0), w, 1e-5, lib=native.library())[0], want)


@pytest.mark.parametrize("path", cpu.LOGITS_PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 4, 6, 9])  # the C tiles: 4 rows, then what is left
def test_logits_match_fp32_reference(path: str, dtype: torch.dtype, rows: int) -> None:
    """Hidden states and lm_head in `dtype`, K not a multiple of 16 or 32. Tolerance: the C GEMV
    keeps fp32 sums (1e-5 of the largest logit); torch's bf16/fp16 matmul rounds its output
    (1e-2); the int8 path rounds weights and activations to 1/254 of each 32's largest
    magnitude (about 0.5% of a logit's scale on Gaussian data: 2e-2 of the largest)."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(1000, 200, generator=g).to(dtype)
    x = torch.randn(rows, 230, generator=g).to(dtype)[:, 10:210]  # strided rows
    head = cpu.prepare_head(w, {path})
    assert (head.codes is not None) == (path == "int8")
    got = cpu.logits(x, head, path, lib=native.library())
    want = x.float() @ w.float().T
    assert got.dtype == torch.float32 and got.shape == (rows, 1000)
    err = float((got - want).abs().max() / want.abs().max())
    bound = {"int8": 2e-2, "c": 1e-5, "torch": 1e-5 if dtype == torch.float32 else 1e-2}[path]
    assert err < bound, err


@pytest.mark.build
def test_an_unwritable_cache_builds_for_this_process(tmp_path, monkeypatch, caplog) -> None:
    """A read-only home fell back to torch's ops (slower, other numbers): the kernels are
    built for this process alone instead, with a warning naming LITESERVE_CACHE."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("LITESERVE_CACHE", str(blocker))
    with caplog.at_level(logging.WARNING):
        lib = native.load_native(native.SOURCES, native._SIGNATURES)  # every entry point typed
    path = Path(lib._name)
    assert not path.is_relative_to(blocker) and path.is_file()
    assert "cannot write the kernel cache" in caplog.text and "LITESERVE_CACHE" in caplog.text
    private = native.isa_path(lib)
    monkeypatch.undo()
    assert private == native.isa_path(native.library())  # the cached library's own build
