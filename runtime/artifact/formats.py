"""Other tools' int4 checkpoint formats: what their configs promise, and their bit orders.

Every format here stores the same thing the artifact does, integer codes q (0..15), a scale s
and an integer zero point z per (output row, group of input channels), with w = (q - z) * s;
they differ in how the nibbles sit in int32 words and where z is kept. Reading a format gives
`QuantizedLinear` (codes, scales, zeros in natural [N, K] / [N, G] order); `lite export`
writes back with the packers here. The mapping is documented in docs/interop.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch

from runtime.artifact.layout import GROUP_SIZES
from runtime.artifact.layout import nibbles_to_words as words
from runtime.artifact.layout import words_to_nibbles as nibbles

BITS = 4
# AutoAWQ GEMM: nibble p of a word holds column 8c + AWQ_ORDER[p].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_NIBBLE = tuple(AWQ_ORDER.index(c) for c in range(8))  # column 8c + j sits in nibble [j]
SYMMETRIC_ZERO = 1 << (BITS - 1)  # 8: a symmetric int4 code q - 8 is the signed value

Getter = Callable[[str], torch.Tensor]


class FormatError(ValueError):
    """A checkpoint cannot be converted (or an artifact exported); the message says why."""


@dataclass(frozen=True)
class CodeLayout:
    """Where a format keeps code (k, n) of an [N, K] linear in its int32 words, said twice:
    `unpack` (torch, all codes at once: the reference and fallback) and `locate` (code ->
    word index and bit shift, which runtime/kernels/repack.py turns into one gather)."""

    unpack: Callable[[torch.Tensor, int, int], torch.Tensor]  # (words, N, K) -> uint8 [N, K]
    locate: Callable[[torch.Tensor, torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class QuantizedLinear:
    """One linear: w[n, k] = (q[n, k] - zero[n, g]) * scale[n, g], g = k // group_size
    (group_size None: one group per row, i.e. per channel). The codes stay in the source's
    words until `q` is asked for: unpacking them all is the slow way to convert."""

    words: torch.Tensor  # int32, as the checkpoint stores them
    codes: CodeLayout
    shape: tuple[int, int]  # (N, K)
    scale: torch.Tensor  # float [N, G]
    zero: torch.Tensor  # int32 [N, G]
    group_size: int | None

    @cached_property
    def q(self) -> torch.Tensor:
        """uint8 [N, K], values 0..15."""
        return self.codes.unpack(self.words, *self.shape)


@dataclass(frozen=True)
class SourceFormat:
    """A checkpoint's quantization, as its config.json declares it."""

    name: str  # autoawq-gemm, gptq, compressed-tensors
    method: str  # the manifest's quantization.method
    group_size: int | None  # None: per output channel
    symmetric: bool
    config: dict  # quantization_config verbatim
    weight_suffix: str  # the tensor that marks a quantized linear
    zero_offset: int = 0  # GPTQ v1 stores z - 1

    def read(self, get: Getter, prefix: str) -> QuantizedLinear:
        return _READERS[self.name](get, prefix, self)

    def artifact_group_size(self) -> int:
        """The largest artifact group size that divides the source's: a source group (or a
        whole row, per channel) is then whole artifact groups sharing the same (s, z)."""
        if self.group_size is None:
            return max(GROUP_SIZES)
        return max(g for g in GROUP_SIZES if self.group_size % g == 0)


def _awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """[R, C/8] in AWQ's nibble order -> uint8 [R, C]. Nibble p = 4a + b holds column
    2b + a of its 8, so the order is undone by swapping those two index digits."""
    r, c8 = packed.shape
    return nibbles(packed).reshape(r, c8, 2, 4).transpose(-1, -2).reshape(r, c8 * 8)


def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """uint8 [R, C] (C a multiple of 8) -> int32 [R, C/8] in AWQ's nibble order."""
    r, c = values.shape
    return words(values.reshape(r, c // 8, 8)[..., list(AWQ_ORDER)])


def ct_pack_rows(values: torch.Tensor) -> torch.Tensor:
    """uint8 [R, C] -> int32 [R, ceil(C/8)], little-endian along C, zero-padded (as
    compressed-tensors' pack_to_int32 after its +8 offset)."""
    r, c = values.shape
    padded = torch.zeros((r, -(-c // 8) * 8), dtype=torch.uint8, device=values.device)
    padded[:, :c] = values
    return words(padded.reshape(r, -1, 8))


def _ct_unpack_rows(packed: torch.Tensor, cols: int) -> torch.Tensor:
    return nibbles(packed).reshape(packed.shape[0], -1)[:, :cols]


def _ct_locate(k: torch.Tensor, n: torch.Tensor, n_dim: int, k_dim: int):
    """weight_packed [N, ceil(K/8)]: code (k, n) is nibble k % 8 of word (n, k // 8)."""
    return n * -(-k_dim // 8) + k // 8, 4 * (k % 8)


CT_CODES = CodeLayout(lambda words, n, k: _ct_unpack_rows(words, k).contiguous(), _ct_locate)


def _check_shape(t: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
    if tuple(t.shape) != shape:
        raise FormatError(f"{name} has shape {tuple(t.shape)}, expected {shape}")


def _awq_locate(k: torch.Tensor, n: torch.Tensor, n_dim: int, k_dim: int):
    """qweight [K, N/8]: code (k, n) is nibble AWQ_NIBBLE[n % 8] of word (k, n // 8)."""
    return k * (n_dim // 8) + n // 8, 4 * torch.tensor(AWQ_NIBBLE)[n % 8]


# q^T is a view: the layout packs B = q^T, which is contiguous here
AWQ_CODES = CodeLayout(lambda words, n, k: _awq_unpack(words).t(), _awq_locate)


def _read_awq(get: Getter, prefix: str, fmt: SourceFormat) -> QuantizedLinear:
    qweight, qzeros, scales = (get(prefix + s) for s in (".qweight", ".qzeros", ".scales"))
    k, n = qweight.shape[0], qweight.shape[1] * 8
    groups = -(-k // fmt.group_size)
    _check_shape(qzeros, (groups, n // 8), prefix + ".qzeros")
    _check_shape(scales, (groups, n), prefix + ".scales")
    return QuantizedLinear(
        words=qweight,
        codes=AWQ_CODES,
        shape=(n, k),
        scale=scales.t().contiguous(),
        zero=_awq_unpack(qzeros).t().to(torch.int32).contiguous(),
        group_size=fmt.group_size,
    )


def _gptq_unpack(words: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """qweight [K/8, N]: nibble j of row r is k = 8r + j. q^T is a view, as for AWQ."""
    return nibbles(words).permute(0, 2, 1).reshape(k, n).t()


def _gptq_locate(k: torch.Tensor, n: torch.Tensor, n_dim: int, k_dim: int):
    return (k // 8) * n_dim + n, 4 * (k % 8)


GPTQ_CODES = CodeLayout(_gptq_unpack, _gptq_locate)


def _read_gptq(get: Getter, prefix: str, fmt: SourceFormat) -> QuantizedLinear:
    qweight, qzeros, scales = (get(prefix + s) for s in (".qweight", ".qzeros", ".scales"))
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    groups = 1 if fmt.group_size is None else -(-k // fmt.group_size)
    _check_shape(qzeros, (groups, n // 8), prefix + ".qzeros")
    _check_shape(scales, (groups, n), prefix + ".scales")
    try:
        g_idx = get(prefix + ".g_idx")
    except KeyError:
        g_idx = None
    if g_idx is None and fmt.config.get("desc_act"):
        raise FormatError(
            f"{prefix}.g_idx is missing from a desc_act (act-order) checkpoint, so which group "
            f"each input channel is in is not known"
        )
    if g_idx is not None and fmt.group_size is not None:
        contiguous = torch.arange(k, dtype=g_idx.dtype) // fmt.group_size
        if not torch.equal(g_idx, contiguous):
            raise FormatError(
                f"{prefix}.g_idx is not k // group_size: the checkpoint reorders input channels "
                f"(act-order), which the artifact's contiguous groups cannot express"
            )
    zero = nibbles(qzeros).reshape(groups, n).to(torch.int32) + fmt.zero_offset
    if int(zero.max()) > 15:
        raise FormatError(
            f"{prefix}.qzeros holds a zero point of 16 (GPTQ v1 stores z - 1, so 0 wrapped); "
            f"it cannot be represented in 4 bits"
        )
    return QuantizedLinear(
        words=qweight,
        codes=GPTQ_CODES,
        shape=(n, k),
        scale=scales.t().contiguous(),
        zero=zero.t().contiguous(),
        group_size=fmt.group_size,
    )


def _read_ct(get: Getter, prefix: str, fmt: SourceFormat) -> QuantizedLinear:
    packed, scale = get(prefix + ".weight_packed"), get(prefix + ".weight_scale")
    n, k = (int(v) for v in get(prefix + ".weight_shape").tolist())
    _check_shape(packed, (n, -(-k // 8)), prefix + ".weight_packed")
    groups = 1 if fmt.group_size is None else -(-k // fmt.group_size)
    _check_shape(scale, (n, groups), prefix + ".weight_scale")
    if fmt.symmetric:
        zero = torch.full((n, groups), SYMMETRIC_ZERO, dtype=torch.int32)
    else:
        packed_zero = get(prefix + ".weight_zero_point")
        _check_shape(packed_zero, (-(-n // 8), groups), prefix + ".weight_zero_point")
        zero = _ct_unpack_rows(packed_zero.t().contiguous(), n).t().to(torch.int32)
    return QuantizedLinear(
        words=packed,
        codes=CT_CODES,
        shape=(n, k),
        scale=scale,
        zero=zero.contiguous(),
        group_size=fmt.group_size,
    )


_READERS = {"autoawq-gemm": _read_awq, "gptq": _read_gptq, "compressed-tensors": _read_ct}


def _group_size(value: object, where: str, channel_ok: bool) -> int | None:
    """A source group size the artifact can express: a multiple of 32, or -1 / None for one
    group per output channel."""
    if channel_ok and value in (-1, None):
        return None
    if not isinstance(value, int) or value <= 0 or value % min(GROUP_SIZES) != 0:
        raise FormatError(
            f"{where}: group_size {value!r} is not supported; the artifact's groups are "
            f"{GROUP_SIZES}, so the source's must be a multiple of {min(GROUP_SIZES)}"
            + (" or per channel" if channel_ok else "")
        )
    return value


def _check_bits(bits: object, where: str) -> None:
    if bits != BITS:
        raise FormatError(f"{where}: {bits}-bit weights; only {BITS}-bit checkpoints convert")


def _awq(qc: dict, where: str) -> SourceFormat:
    _check_bits(qc.get("bits", qc.get("w_bit")), where)
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise FormatError(
            f"{where}: AutoAWQ version {version!r}; only the GEMM packing converts (GEMV, "
            f"Marlin and ExLlama checkpoints pack their nibbles differently)"
        )
    if not qc.get("zero_point", True):
        raise FormatError(f"{where}: AutoAWQ without zero points is not a GEMM checkpoint")
    gs = _group_size(qc.get("group_size", qc.get("q_group_size")), where, channel_ok=False)
    return SourceFormat("autoawq-gemm", "autoawq", gs, False, qc, ".qweight")


def _gptq(qc: dict, where: str) -> SourceFormat:
    _check_bits(qc.get("bits"), where)
    # desc_act (act-order) is decided per linear from g_idx (_read_gptq): with one group per
    # channel, or static groups, the groups are still contiguous runs and convert exactly
    fmt = str(qc.get("checkpoint_format", "gptq"))
    if fmt not in ("gptq", "gptq_v2"):
        raise FormatError(f"{where}: GPTQ checkpoint_format {fmt!r} (e.g. Marlin) not supported")
    gs = _group_size(qc.get("group_size"), where, channel_ok=True)
    offset = 1 if fmt == "gptq" else 0  # v1 stores z - 1
    return SourceFormat("gptq", "gptq", gs, bool(qc.get("sym", True)), qc, ".qweight", offset)


def _ct_weights(qc: dict, where: str) -> dict:
    """The one weight scheme of a W4A16 compressed-tensors config."""
    fmt = qc.get("format")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise FormatError(f"{where}: compressed-tensors config has no config_groups")
    schemes = []
    for name, group in groups.items():
        group_fmt = group.get("format") or fmt  # null: the top-level format, as compressed-
        if group_fmt != "pack-quantized":  # tensors itself reads it
            raise FormatError(
                f"{where}: compressed-tensors format {group_fmt!r} in {name}; "
                f"only pack-quantized int4 converts"
            )
        if group.get("input_activations"):
            raise FormatError(f"{where}: {name} quantizes activations; only W4A16 converts")
        schemes.append(group.get("weights") or {})
    if any(s != schemes[0] for s in schemes):
        raise FormatError(f"{where}: config groups with different weight schemes")
    return schemes[0]


def _ct(qc: dict, where: str) -> SourceFormat:
    w = _ct_weights(qc, where)
    _check_bits(w.get("num_bits"), where)
    if w.get("type", "int") != "int" or w.get("dynamic"):
        raise FormatError(f"{where}: weights of type {w.get('type')!r}; only static int converts")
    if w.get("actorder") == "group":
        raise FormatError(f"{where}: actorder 'group' reorders input channels (g_idx); refused")
    strategy = w.get("strategy")
    if strategy not in ("group", "channel"):
        raise FormatError(f"{where}: strategy {strategy!r}; only group and channel convert")
    gs = _group_size(w.get("group_size") if strategy == "group" else None, where, True)
    symmetric = bool(w.get("symmetric", True))
    return SourceFormat(
        "compressed-tensors", "compressed-tensors", gs, symmetric, qc, ".weight_packed"
    )


def detect_format(config: dict, where: str) -> SourceFormat:
    """The checkpoint's format from config.json, refused with the reason before anything is
    written when the artifact cannot hold it exactly."""
    qc = config.get("quantization_config")
    if not qc:
        raise FormatError(
            f"{where} is a dense (unquantized) checkpoint: there is nothing to convert; "
            f"quantize it with `lite auto_awq`"
        )
    method = qc.get("quant_method")
    if method == "awq":
        return _awq(qc, where)
    if method == "gptq":
        return _gptq(qc, where)
    if method == "compressed-tensors":
        return _ct(qc, where)
    raise FormatError(
        f"{where}: quant_method {method!r} is not supported (awq, gptq, compressed-tensors)"
    )


def expand_groups(t: torch.Tensor, source_gs: int | None, artifact_gs: int, k: int) -> torch.Tensor:
    """[N, G_src] -> [N, ceil(K / artifact_gs)]: each artifact group takes its source group's
    value (artifact_gs divides the source's group, or the source is per channel)."""
    groups = -(-k // artifact_gs)
    if source_gs is None:
        return t[:, :1].expand(-1, groups)
    index = torch.arange(groups) * artifact_gs // source_gs
    return t[:, index]
