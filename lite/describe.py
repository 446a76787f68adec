"""`lite inspect`: the facts of an artifact, for people (a table) and scripts (JSON)."""

from __future__ import annotations

from pathlib import Path

from lite.model_card import made_by
from runtime.artifact.manifest import Producer
from runtime.artifact.reader import Artifact


def fp16_bytes(artifact: Artifact) -> int:
    """What the same model would take with every weight in fp16, from the logical shapes."""
    total = 0
    for entry in artifact.manifest.tensors.values():
        if entry.kind == "qweight":
            n, k = entry.logical_shape
            total += 2 * n * k
        elif entry.kind == "dense":
            count = 1
            for d in entry.shape:
                count *= d
            total += 2 * count
    return total


def describe(path: Path, checksums: bool) -> dict:
    art = Artifact(path, checksums=checksums)
    m = art.manifest
    a, q = m.architecture, m.quantization
    template = art.chat_template
    size = art.size_on_disk()
    return {
        "path": str(path),
        "model": m.source.id,
        "family": a.family,
        "layers": a.num_layers,
        "hidden_size": a.hidden_size,
        "heads": a.num_heads,
        "kv_heads": a.num_kv_heads,
        "method": q.method,
        "bits": q.bits,
        "group_size": q.group_size,
        "symmetric": q.symmetric,
        "layout": f"{m.layout.name} v{m.layout.version}",
        "size_bytes": size,
        "fp16_bytes": fp16_bytes(art),
        "calibration": {
            "dataset": q.calib_dataset,
            "samples": q.calib_samples,
            "seqlen": q.calib_seqlen,
            "tokens_sha256": q.calib_tokens_sha256,
        },
        "fallbacks": q.fallbacks,
        "converted_from": m.source.format,  # None unless `lite convert` made it
        "launch": m.launch.model_dump(),
        "chat_template_head": template.splitlines()[:3] if template else None,
        "verified": "checksums" if checksums else "sizes",
        "producer": m.producer.model_dump(),
    }


def render(f: dict) -> str:
    c = f["calibration"]
    calib = f"{c['dataset']} {c['samples']}x{c['seqlen']}" if c["dataset"] else "none (RTN)"
    if f["converted_from"]:  # calibrated (or not) by the tool that made the checkpoint
        calib = f"by the source's tool: converted from {f['converted_from']}"
    launch = ", ".join(f"{k}={v}" for k, v in f["launch"].items() if k != "kernels")
    rows = [
        ("model", f["model"]),
        (
            "family",
            f"{f['family']}: {f['layers']} layers, hidden {f['hidden_size']}, "
            f"{f['heads']} heads / {f['kv_heads']} kv",
        ),
        (
            "quantization",
            f"{f['method']} int{f['bits']} g{f['group_size']} "
            f"{'sym' if f['symmetric'] else 'asym'}",
        ),
        ("layout", f["layout"]),
        (
            "size",
            f"{f['size_bytes'] / 2**20:.1f} MiB on disk vs {f['fp16_bytes'] / 2**20:.1f} "
            f"MiB fp16 ({f['fp16_bytes'] / f['size_bytes']:.2f}x smaller)",
        ),
        ("calibration", calib),
        ("fallbacks", ", ".join(f["fallbacks"]) or "none"),
        ("launch", launch),
        ("made", made_by(Producer.model_validate(f["producer"]))),
        ("verified", "every checksum" if f["verified"] == "checksums" else "file sizes only"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    if f["chat_template_head"]:
        lines.append("chat template:")
        lines += [f"  | {line}" for line in f["chat_template_head"]]
    return "\n".join(lines)
