"""`lite export`: an artifact back out as a Hugging Face directory that vLLM and transformers
load as they load compressed-tensors (pack-quantized) or AutoAWQ (GEMM) output.

The artifact stores (s, -z*s) per group; both formats store s and an integer z. z is recovered
as round(-(-z*s) / s) and accepted only when it reproduces the stored -z*s to within that
value's own fp16 rounding (the artifact's documented tolerance): what is written is the
artifact's quantization up to that rounding of some offsets and, in a bf16 model's loaders,
of the scales (the export warns about both, with the count); whatever a format cannot express (a
group size, odd widths) is refused with the reason before anything is written.
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from lite.hf import config_from_architecture
from runtime.artifact.formats import SYMMETRIC_ZERO, awq_pack, ct_pack_rows
from runtime.artifact.hf_config import INDEX_FILE, TOKENIZER_FILES
from runtime.artifact.layout import unpack_qparams, unpack_qweight
from runtime.artifact.manifest import CHAT_TEMPLATE_FILE, Manifest
from runtime.artifact.reader import Artifact
from runtime.artifact.writer import (
    EXPORT_MARKER,
    check_replaceable,
    publish,
    staging_dir,
    write_export_marker,
    write_json_atomic,
    write_shards,
)

FORMATS = ("compressed-tensors", "autoawq")
# |-z*s - b| within 2^-10 of |b|: b is -z*s from the fp32 scale, rounded to fp16 once.
_REL_TOL = 2.0**-10


class ExportError(ValueError):
    """The artifact cannot be written exactly in the asked format; the message says why."""


# The scales are written in fp16 as the artifact holds them; a bf16 model's loaders keep them
# in the model's dtype. Measured on SmolLM2 (bf16, g64): 87% of scales moved, 6% of weights.
BF16_SCALES = (
    "this artifact runs in bfloat16, so vLLM and transformers will hold its fp16 scales in "
    "bfloat16: each scale rounds once (at most 2^-9 of it) and the exported model's weights "
    "differ that much from the artifact's; for an exact export, quantize with --dtype float16"
)


# An asymmetric artifact's offsets are -z*s rounded once from the fp32 scale; the formats keep
# the integer z, and their loaders compute -z*s from the fp16 scale: measured on SmolLM2 AWQ
# (fp16, g16), 18.6% of groups land one fp16 step away.
MOVED_OFFSETS = (
    "{} of {} groups ({:.1f}%) have an offset -z*s that the format's integer zero point "
    "reproduces only to its fp16 rounding: their weights move by at most 2^-10 of the offset "
    "(a symmetric artifact, --w-sym, exports exactly)"
)


def recover_zero(s: torch.Tensor, b: torch.Tensor, symmetric: bool, where: str) -> torch.Tensor:
    """Integer zero points [N, G] from the artifact's fp16 (s, b = -z*s)."""
    s32, b32 = s.float(), b.float()
    safe = torch.where(s32 == 0, torch.ones_like(s32), s32)
    z = torch.round(-b32 / safe)
    z = torch.where(s32 == 0, torch.full_like(z, SYMMETRIC_ZERO if symmetric else 0), z)
    err = (-z * s32 - b32).abs()
    bad = (z < 0) | (z > 15) | (err > _REL_TOL * b32.abs() + 2.0**-24)
    if symmetric:
        bad |= z != SYMMETRIC_ZERO
    if bool(bad.any()):
        raise ExportError(
            f"{where}: the group parameters are not (s, -z*s) with an integer z in 0..15 "
            f"({int(bad.sum())} groups); exporting would change the weights"
        )
    return z.to(torch.int32)


def _check(m: Manifest, fmt: str) -> None:
    """Both formats (and vLLM's kernels for them) need whole groups along K; AutoAWQ also
    packs 8 output columns per word."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    gs = m.quantization.group_size
    for name, entry in m.tensors.items():
        if entry.kind != "qweight":
            continue
        n, k = entry.logical_shape
        if k % gs or (fmt == "autoawq" and n % 8):
            raise ExportError(
                f"{name}: {fmt} needs in_features % group_size == 0"
                + (" and out_features % 8 == 0" if fmt == "autoawq" else "")
                + f", and this linear is [{n}, {k}] with group size {gs}; requantize with a "
                f"group size that divides {k} (`lite auto_awq --w-group-size`)"
            )


def _linear(art: Artifact, prefix: str, fmt: str, moved: list[int]) -> dict[str, torch.Tensor]:
    """`moved` tallies [groups whose offset -z*s the loaders recompute to another fp16 value,
    groups]."""
    m = art.manifest
    entry = m.tensors[prefix + ".qweight"]
    n, k = entry.logical_shape
    q = unpack_qweight(art.tensor(prefix + ".qweight"), n, k)
    s, b = unpack_qparams(art.tensor(prefix + ".qparams"), n)
    z = recover_zero(s, b, m.quantization.symmetric, prefix)
    moved[0] += int(((-z * s.float()).to(b.dtype) != b).sum())
    moved[1] += b.numel()
    if fmt == "autoawq":
        return {
            prefix + ".qweight": awq_pack(q.t().contiguous()),
            prefix + ".qzeros": awq_pack(z.t().to(torch.uint8).contiguous()),
            prefix + ".scales": s.t().contiguous(),
        }
    out = {
        prefix + ".weight_packed": ct_pack_rows(q),
        prefix + ".weight_scale": s,
        prefix + ".weight_shape": torch.tensor([n, k], dtype=torch.int64),
    }
    if not m.quantization.symmetric:
        packed = ct_pack_rows(z.t().to(torch.uint8).contiguous())
        out[prefix + ".weight_zero_point"] = packed.t().contiguous()
    return out


def _groups(art: Artifact, fmt: str, moved: list[int]) -> Iterator[dict[str, torch.Tensor]]:
    """Dense tensors outside the layers, then one group per layer: one layer in memory."""
    m = art.manifest
    tensors = m.tensors
    yield {n: art.tensor(n) for n in tensors if not n.startswith("model.layers.")}
    for i in range(m.architecture.num_layers):
        layer = f"model.layers.{i}."
        group: dict[str, torch.Tensor] = {}
        for name, entry in tensors.items():
            if not name.startswith(layer):
                continue
            if entry.kind == "qweight":
                group.update(_linear(art, name.removesuffix(".qweight"), fmt, moved))
            elif entry.kind == "dense":
                group[name] = art.tensor(name)
        yield group


def quantization_config(m: Manifest, fmt: str) -> dict:
    """The config block each format's own loaders read."""
    q = m.quantization
    if fmt == "autoawq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": q.group_size,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": None,
        }
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": q.symmetric,
        "strategy": "group",
        "group_size": q.group_size,
        "dynamic": False,
        "actorder": None,
        "observer": "minmax",
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


def _hf_config(m: Manifest, fmt: str) -> dict:
    config = config_from_architecture(m.architecture).to_dict()
    family = m.architecture.family
    config["architectures"] = [f"{family[0].upper()}{family[1:]}ForCausalLM"]
    config["dtype"] = m.dtype
    # and the keys transformers 4 reads (what many vLLM builds pin): it ignores rope_parameters
    # and would serve plain RoPE at theta 10000; transformers 5 takes either
    config["torch_dtype"] = m.dtype
    config["rope_theta"] = m.architecture.rope_theta
    config["rope_scaling"] = m.architecture.rope_scaling
    config["quantization_config"] = quantization_config(m, fmt)
    config.pop("_attn_implementation_autoset", None)
    return config


def _generation_config(m: Manifest) -> dict:
    g = m.generation
    return {
        "bos_token_id": m.architecture.bos_token_id,
        "eos_token_id": g.stop_token_ids or m.architecture.eos_token_ids,
        "do_sample": g.temperature > 0,
        "temperature": g.temperature,
        "top_p": g.top_p,
        "top_k": g.top_k,
        "repetition_penalty": g.repetition_penalty,
    }


def _write(art: Artifact, fmt: str, out: Path) -> None:
    m = art.manifest
    moved = [0, 0]
    where = write_shards(out, _groups(art, fmt, moved))
    if moved[0]:
        warnings.warn(
            MOVED_OFFSETS.format(moved[0], moved[1], 100 * moved[0] / moved[1]), stacklevel=3
        )
    total = sum((out / f).stat().st_size for f in set(where.values()))
    write_json_atomic({"metadata": {"total_size": total}, "weight_map": where}, out / INDEX_FILE)
    write_json_atomic(_hf_config(m, fmt), out / "config.json")
    write_json_atomic(_generation_config(m), out / "generation_config.json")
    for name in (*TOKENIZER_FILES, CHAT_TEMPLATE_FILE):
        if (art.path / name).is_file():
            shutil.copyfile(art.path / name, out / name)
    write_export_marker(out)


def export(artifact: Path, fmt: str, output: Path, overwrite: bool = False) -> Path:
    """Write `output` (staged beside it, published by one rename; nothing left on error)."""
    art = Artifact(artifact)
    _check(art.manifest, fmt)
    if art.manifest.dtype == "bfloat16":
        warnings.warn(BF16_SCALES, stacklevel=2)
    check_replaceable(output, overwrite, EXPORT_MARKER)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_dir(output, "export")
    try:
        _write(art, fmt, staging)
        publish(staging, output, overwrite, EXPORT_MARKER)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return output
