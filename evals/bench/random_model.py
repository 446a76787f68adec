"""Random Llama models of real shapes, and their round-to-nearest artifacts, for the GPU check.

Speed and memory depend on a model's shapes, not on its weights, and a lent GPU machine has no
network and too little time to bring a real 1B or 8B checkpoint along. So the check builds a
random Llama of the real shape with transformers (on the GPU, where it takes seconds), saves it
as a Hugging Face directory with a real tokenizer and chat template, and quantizes it with
`lite auto_awq --calib-samples 0` (round-to-nearest: the shortest path through the real tool).

The tokenizer is the carried SmolLM2 one (`.tok`, written by prepare-device.sh: 49152 tokens,
so the embedding and lm_head have their real size). Without it, a small byte-level BPE is
trained on Python's own documentation text, as the tests do, which suits the tiny shape only.

    python evals/bench/random_model.py 1b WORK [--tokenizer .tok] [--device cuda] [--artifact]

prints one markdown table row per model made (shape, parameters, sizes and seconds) and leaves
WORK/src-SHAPE (the HF directory) and, with --artifact, WORK/art-SHAPE (the RTN artifact).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# Llama-3.2-1B and Llama-3-8B; SmolLM2-135M for the CPU figures of a host whose real model
# cannot travel (cpu_isa.py); "tiny" is the CPU smoke run's stand-in (seconds to quantize).
SHAPES: dict[str, dict[str, int]] = {
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    ),
    "smollm2": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
    ),
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
    ),
    "8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
    ),
}
TIED = {"tiny": True, "smollm2": True, "1b": True, "8b": False}  # as the real models
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HEADER = (
    "| shape | hidden / inter / layers / heads x dim | vocab | tied | params (B) "
    "| bf16 source GiB | build s | RTN artifact MiB | RTN s |\n"
    "|---|---|---:|---|---:|---:|---:|---:|---:|"
)


@dataclass(frozen=True)
class Made:
    """What building one model cost, for the report."""

    shape: str
    params: int
    source: Path
    source_bytes: int
    build_s: float
    artifact: Path | None = None
    artifact_bytes: int = 0
    rtn_s: float = 0.0


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def load_tokenizer(tokenizer_dir: Path | None, work: Path):
    """The carried tokenizer if there is one, else a 512-token BPE trained offline (the
    tests' recipe: byte-level, ChatML specials, a chat template)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if tokenizer_dir is not None and (tokenizer_dir / "tokenizer.json").is_file():
        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        if not tok.chat_template:
            tok.chat_template = CHAT_TEMPLATE
        return tok
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from lite.data import pydoc_split

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([pydoc_split()[0]], trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(work / "tokenizer")
    return tok


def build_source(
    shape: str, out: Path, tok, device: str, layers: int | None = None, seed: int = 0
) -> Made:
    """A random bf16 Llama of `shape`, saved with `tok` as a Hugging Face directory.

    Built directly in bf16 on `device` (an 8B model in fp32 would need 32 GB and a slow cast);
    the weights follow transformers' own initialisation, so activations keep a sane scale."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    start = time.perf_counter()
    dims = {**SHAPES[shape], **({"num_hidden_layers": layers} if layers else {})}
    config = LlamaConfig(
        **dims,
        vocab_size=len(tok),
        max_position_embeddings=8192,
        tie_word_embeddings=TIED[shape],
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out)
    tok.save_pretrained(out)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return Made(shape, params, out, dir_bytes(out), time.perf_counter() - start)


def rtn_artifact(
    source: Path, artifact: Path, group_size: int = 128, device: str = "auto"
) -> float:
    """`lite auto_awq SRC --calib-samples 0` on `device` through the CLI module (the console
    script may not be installed where the check runs); returns seconds."""
    start = time.perf_counter()
    cmd = [
        sys.executable,
        "-m",
        "lite",
        "auto_awq",
        str(source),
        "--work-dir",
        str(artifact),
        "--calib-samples",
        "0",
        "--w-group-size",
        str(group_size),
        "--device",
        device,
        "--overwrite",
        "--quiet",
    ]
    print("$", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("work", type=Path, help="folder for src-SHAPE/ and art-SHAPE/")
    p.add_argument("--tokenizer", type=Path, help="a tokenizer folder (default: train one)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--artifact", action="store_true", help="also make the RTN g128 artifact")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--layers", type=int, help="override the shape's layer count (timing runs)")
    p.add_argument("--drop-source", action="store_true", help="delete src-SHAPE/ afterwards")
    a = p.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(a.tokenizer, a.work)
    made = build_source(a.shape, a.work / f"src-{a.shape}", tok, a.device, a.layers)
    print(
        f"built {made.shape}: {made.params / 1e9:.3f} B parameters, "
        f"{made.source_bytes / 2**30:.2f} GiB in {made.build_s:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    rtn_s, art_bytes = 0.0, 0
    art = a.work / f"art-{a.shape}"
    if a.artifact:
        rtn_s = rtn_artifact(made.source, art, a.group_size, a.device)
        art_bytes = dir_bytes(art)
    if a.drop_source:
        import shutil

        shutil.rmtree(made.source)
    cfg = {**SHAPES[a.shape], **({"num_hidden_layers": a.layers} if a.layers else {})}
    print(HEADER)
    print(
        f"| {a.shape} | {cfg['hidden_size']} / {cfg['intermediate_size']} / "
        f"{cfg['num_hidden_layers']} / {cfg['num_attention_heads']}:{cfg['num_key_value_heads']}"
        f" x {cfg['head_dim']} | {len(tok)} | {'yes' if TIED[a.shape] else 'no'} | "
        f"{made.params / 1e9:.3f} | {made.source_bytes / 2**30:.2f} | {made.build_s:.1f} | "
        + (f"{art_bytes / 2**20:.0f} | {rtn_s:.1f} |" if a.artifact else "- | - |"),
        flush=True,
    )


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
