"""`lite convert` on a Llama-3-8B-shaped random AutoAWQ (GEMM) checkpoint: seconds and peak RSS
against the time to read and write the checkpoint's bytes once.

The checkpoint has AutoAWQ's tensor names, shapes and dtypes (qweight int32 [K, N/8], qzeros
int32 [K/128, N/8], scales fp16 [K/128, N]) filled with random bits: conversion does the same
work whatever the codes are. Run:

    python evals/bench/convert.py --root /tmp/convert-bench [--layers 32] [--repeat 3]

The copy and the conversion alternate `--repeat` times and the medians are compared: on a
shared VM disk one write of 5 GB varies by 2x from run to run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

# run as a script, this folder is first on sys.path
from quantize import run_child
from safetensors.torch import save_file
from tokenizers import Tokenizer, models

LLAMA3_8B = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
GROUP = 128
LAYERS_PER_SHARD = 4


def _linears(c: dict) -> dict[str, tuple[int, int]]:
    """Linear name -> (N, K)."""
    h, i, kv = c["hidden_size"], c["intermediate_size"], c["num_key_value_heads"] * c["head_dim"]
    return {
        "self_attn.q_proj": (h, h),
        "self_attn.k_proj": (kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, h),
        "mlp.gate_proj": (i, h),
        "mlp.up_proj": (i, h),
        "mlp.down_proj": (h, i),
    }


def _awq_linear(n: int, k: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    bits = torch.iinfo(torch.int32)
    return {
        "qweight": torch.randint(bits.min, bits.max, (k, n // 8), dtype=torch.int32, generator=g),
        "qzeros": torch.randint(
            bits.min, bits.max, (k // GROUP, n // 8), dtype=torch.int32, generator=g
        ),
        "scales": (torch.rand(k // GROUP, n, generator=g) * 0.01 + 1e-3).half(),
    }


def make_checkpoint(out: Path, layers: int) -> None:
    """Write the random checkpoint (sharded with an index, as the hub's are)."""
    config = {**LLAMA3_8B, "num_hidden_layers": layers}
    config["quantization_config"] = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": GROUP,
        "zero_point": True,
        "version": "gemm",
    }
    out.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    h, v = config["hidden_size"], config["vocab_size"]
    weight_map: dict[str, str] = {}

    def shard(tensors: dict[str, torch.Tensor]) -> None:
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(tensors, str(out / name))
        weight_map.update(dict.fromkeys(tensors, name))

    shard({"model.embed_tokens.weight": torch.randn(v, h, generator=g).half()})
    for first in range(0, layers, LAYERS_PER_SHARD):
        tensors = {}
        for i in range(first, min(first + LAYERS_PER_SHARD, layers)):
            p = f"model.layers.{i}."
            for lin, (n, k) in _linears(config).items():
                tensors.update({f"{p}{lin}.{s}": t for s, t in _awq_linear(n, k, g).items()})
            tensors[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.float16)
            tensors[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.float16)
        shard(tensors)
    shard(
        {
            "model.norm.weight": torch.ones(h, dtype=torch.float16),
            "lm_head.weight": torch.randn(v, h, generator=g).half(),
        }
    )
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / "config.json").write_text(json.dumps(config))
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2}
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))


def copy_once(src: Path, dst: Path) -> float:
    """Seconds to read every byte of the checkpoint and write it once (then fsync)."""
    dst.mkdir()
    started = time.perf_counter()
    for f in sorted(src.iterdir()):
        shutil.copyfile(f, dst / f.name)
    os.sync()
    seconds = time.perf_counter() - started
    shutil.rmtree(dst)
    return seconds


def convert_once(src: Path, art: Path) -> tuple[float, float]:
    """Seconds of `lite convert` as a user runs it (a new process, imports included), then
    fsync of what it wrote; and its peak RSS in GiB."""
    shutil.rmtree(art, ignore_errors=True)
    lite = Path(sys.executable).with_name("lite")
    started = time.perf_counter()
    # its own peak (VmHWM): RUSAGE_CHILDREN's counts the parent's memory at the fork, ~3 GiB
    # here after building the checkpoint (3.28 GiB reported where the child held 0.40)
    _, peak = run_child([str(lite), "convert", str(src), "--work-dir", str(art)])
    os.sync()
    return time.perf_counter() - started, peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    src, art = args.root / "awq-src", args.root / "art"
    if not src.exists():
        make_checkpoint(src, args.layers)
    layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    if layers != args.layers:  # a source from another run: its figures would be another's
        raise SystemExit(
            f"{src} holds a {layers}-layer checkpoint, not --layers {args.layers}: delete it "
            f"(rm -r {src}) or give another --root"
        )
    size = sum(f.stat().st_size for f in src.iterdir())
    copies, converts, peaks = [], [], []
    for _ in range(args.repeat):
        copies.append(copy_once(src, args.root / "copy"))
        seconds, peak = convert_once(src, art)
        converts.append(seconds)
        peaks.append(peak)
    copy_s, convert_s = statistics.median(copies), statistics.median(converts)
    rss = max(peaks)
    print(
        json.dumps(
            {
                "layers": layers,
                "source_gib": round(size / 1024**3, 2),
                "read_write_once_s": [round(s, 1) for s in copies],
                "convert_s": [round(s, 1) for s in converts],
                "ratio_of_medians": round(convert_s / copy_s, 2),
                "convert_peak_rss_gib": round(rss, 2),
                "load_average": os.getloadavg(),
                "cpus": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
