"""Perplexity, and how far each variant's next-token distribution moves from the baseline's.

Protocol (fixed, so numbers compare across tools and runs): tokenize the text once without
special tokens, cut it into non-overlapping windows of `seqlen` tokens (the remainder is
dropped), score each window on its own (no context carried across windows). Over every
predicted token, i.e. windows * (seqlen - 1) of them:

- ppl = exp(mean next-token negative log-likelihood);
- kl = mean KL(P_baseline || P_variant) in nats, over the whole vocabulary at each position;
- top1 = the fraction of positions where the variant's argmax equals the baseline's.

Standard errors treat windows as the independent samples (tokens inside a window are not):
se = std(per-window means) / sqrt(windows), carried to ppl by the delta method (ppl * se_nll).

Variants are artifacts served by the runtime engine under a KV policy, so the KV quantization is
measured too; the baseline is the source model in transformers (or, without one, the first
variant). All models stay resident and each batch of windows is scored by every model in turn:
the baseline's full distributions never need storing.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

if TYPE_CHECKING:
    from runtime.engine.engine import Engine

Logits = Callable[[torch.Tensor], torch.Tensor]  # [B, T] token ids -> [B, T - 1, V] logits


@dataclass
class WindowStats:
    """Per-window sums of one variant; the summary is computed once at the end."""

    nll: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    top1: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    def add(self, logits: torch.Tensor, targets: torch.Tensor, base: torch.Tensor | None) -> None:
        """One batch: logits [B, T, V] predicting targets [B, T]; base likewise (or None)."""
        lp = logits.float().log_softmax(-1)
        nll = -lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [B, T]
        self.nll += nll.sum(-1).tolist()
        self.tokens += [targets.shape[1]] * targets.shape[0]
        if base is None:
            return
        blp = base.float().log_softmax(-1)
        kl = (blp.exp() * (blp - lp)).sum(-1)  # [B, T]
        self.kl += kl.sum(-1).tolist()
        self.top1 += (lp.argmax(-1) == blp.argmax(-1)).float().sum(-1).tolist()


@dataclass(frozen=True)
class Score:
    mean: float
    stderr: float | None


def _mean(sums: list[float], tokens: list[int]) -> Score:
    means = torch.tensor(sums, dtype=torch.float64) / torch.tensor(tokens, dtype=torch.float64)
    total = sum(sums) / sum(tokens)
    se = float(means.std() / math.sqrt(len(means))) if len(means) > 1 else None
    return Score(total, se)


@dataclass(frozen=True)
class PerplexityResult:
    name: str
    ppl: float
    nll: float  # mean negative log-likelihood per predicted token
    tokens: int  # predicted tokens scored
    windows: int
    ppl_stderr: float | None = None
    kl: Score | None = None  # against the baseline; None for the baseline itself
    top1: Score | None = None

    @classmethod
    def of(cls, name: str, stats: WindowStats) -> PerplexityResult:
        nll = _mean(stats.nll, stats.tokens)
        ppl = math.exp(nll.mean)
        return cls(
            name=name,
            ppl=ppl,
            nll=nll.mean,
            tokens=sum(stats.tokens),
            windows=len(stats.tokens),
            ppl_stderr=None if nll.stderr is None else ppl * nll.stderr,
            kl=_mean(stats.kl, stats.tokens) if stats.kl else None,
            top1=_mean(stats.top1, stats.tokens) if stats.top1 else None,
        )


def windows(tokens: torch.Tensor, seqlen: int, limit: int | None = None) -> torch.Tensor:
    if seqlen < 2:
        raise ValueError(f"--seqlen must be at least 2, got {seqlen}")
    n = len(tokens) // seqlen
    if limit is not None:
        n = min(n, limit)
    if n == 0:
        raise ValueError(
            f"the text has {len(tokens)} tokens, fewer than one window of {seqlen}; use a "
            f"longer text or a smaller --seqlen"
        )
    return tokens[: n * seqlen].view(n, seqlen)


@torch.inference_mode()
def compare(
    names: list[str],
    scorers: list[Logits],
    batches: torch.Tensor,
    batch_size: int = 4,
    progress: bool = False,
) -> list[PerplexityResult]:
    """Score every window with every model; the first is the baseline of KL and top-1."""
    stats = [WindowStats() for _ in scorers]
    starts = range(0, len(batches), batch_size)
    for i in tqdm(
        starts, desc=f"{len(batches)} windows x {len(scorers)} models", disable=not progress
    ):
        ids = batches[i : i + batch_size]
        base = None
        for j, score in enumerate(scorers):
            logits = score(ids)
            stats[j].add(logits, ids[:, 1:], base)
            if j == 0:
                base = logits
    return [PerplexityResult.of(n, s) for n, s in zip(names, stats, strict=True)]


def perplexity(
    name: str, logits_fn: Logits, batches: torch.Tensor, batch_size: int = 4
) -> PerplexityResult:
    return compare([name], [logits_fn], batches, batch_size)[0]


def hf_logits(model: torch.nn.Module) -> Logits:
    return lambda ids: model(input_ids=ids, use_cache=False).logits[:, :-1]


def engine_logits(engine: Engine) -> Logits:
    return lambda ids: torch.stack(engine.score(ids.tolist()))


def eval_dtype(dtype: str) -> torch.dtype:
    """`auto` is fp32 on a CPU (evaluation wants accuracy; the CPU engine's bf16 default is a
    speed choice) and bf16 on a GPU, as served."""
    if dtype == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:  # a ValueError, whose own text names no file
        raise ValueError(
            f"--text-file {path} is not valid UTF-8 (byte {e.start}: {e.reason}); re-save it "
            "as UTF-8"
        ) from e


def run_ppl(
    model: str | None,
    artifacts: tuple[Path, ...],
    text_file: Path | None,
    seqlen: int = 512,
    limit: int | None = None,
    kv_quants: tuple[str, ...] = ("none",),
    dtype: str = "auto",
    batch_size: int = 4,
    progress: bool = False,
) -> list[PerplexityResult]:
    """Score the source (if given) and each artifact under each KV policy on identical
    windows; KL and top-1 are against the source, or the first variant without one."""
    from transformers import AutoTokenizer

    from lite.data import heldout_text
    from lite.hf import load_source_model
    from lite.sources import resolve
    from runtime.artifact.reader import Artifact
    from runtime.config import EngineConfig
    from runtime.engine.engine import Engine

    source = resolve(model) if model else None
    opened = [Artifact(a) for a in artifacts]
    tokenizer = AutoTokenizer.from_pretrained(source.path if source else opened[0].path)
    text = _read_text(text_file) if text_file else heldout_text()
    ids = torch.tensor(tokenizer(text, add_special_tokens=False, verbose=False).input_ids)
    batches = windows(ids, seqlen, limit)
    torch_dtype = eval_dtype(dtype)
    names, scorers = [], []
    if source:
        names.append(model)
        scorers.append(hf_logits(load_source_model(source.path).to(torch_dtype)))
    block = 64
    config = EngineConfig(
        session_len=seqlen,  # score() runs no token after a window
        num_blocks=batch_size * -(-seqlen // block),
        cache_block_seq_len=block,
        max_batch_size=batch_size,
        max_prefill_token_num=max(2048, seqlen),
        dtype=str(torch_dtype).removeprefix("torch."),
        int8_activations=False,  # the weights' quantization is measured, not the CPU's speed path
    )
    for art in opened:
        for kv in kv_quants:
            names.append(variant_name(art.path, kv))
            scorers.append(engine_logits(Engine(art.path, replace(config, kv_quant=kv))))
    return compare(names, scorers, batches, batch_size, progress)


def artifact_label(artifact: Path) -> str:
    """An artifact's name in a report: its directory's as given (a symbolic link's own name),
    for `.` too (whose Path.name is empty)."""
    return Path(os.path.abspath(artifact)).name


def variant_name(artifact: Path, kv_quant: str) -> str:
    return f"{artifact_label(artifact)} kv={kv_quant}"
