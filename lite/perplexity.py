"""Token-level perplexity with a fixed, documented protocol so numbers compare across tools.

Protocol: tokenize the text once without special tokens, cut it into non-overlapping windows
of `seqlen` tokens (the remainder is dropped), score each window on its own (no context carried
across windows), and report exp(mean next-token negative log-likelihood) over every predicted
token, i.e. windows * (seqlen - 1) tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

Logits = Callable[[torch.Tensor], torch.Tensor]  # [B, T] token ids -> [B, T, V] logits


@dataclass(frozen=True)
class PerplexityResult:
    name: str
    ppl: float
    nll: float  # mean negative log-likelihood per predicted token
    tokens: int  # predicted tokens scored
    windows: int


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
def perplexity(
    name: str, logits_fn: Logits, batches: torch.Tensor, batch_size: int = 4
) -> PerplexityResult:
    total = 0.0
    count = 0
    for i in range(0, len(batches), batch_size):
        ids = batches[i : i + batch_size]
        logits = logits_fn(ids)[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
        )
        total += float(nll)
        count += ids[:, 1:].numel()
    mean = total / count
    return PerplexityResult(name, math.exp(mean), mean, count, len(batches))


def hf_logits(model: torch.nn.Module) -> Logits:
    return lambda ids: model(input_ids=ids, use_cache=False).logits


def run_ppl(
    model: str | None,
    artifacts: tuple[Path, ...],
    text_file: Path | None,
    seqlen: int = 512,
    limit: int | None = None,
) -> list[PerplexityResult]:
    """Score the source (if given) and each artifact on identical token windows."""
    from transformers import AutoTokenizer

    from lite.data import heldout_text
    from lite.hf import load_dequantized, load_source_model
    from lite.sources import resolve
    from runtime.artifact.reader import Artifact

    source = resolve(model) if model else None
    opened = [Artifact(a) for a in artifacts]
    tokenizer = AutoTokenizer.from_pretrained(source.path if source else opened[0].path)
    text = text_file.read_text(encoding="utf-8") if text_file else heldout_text()
    ids = torch.tensor(tokenizer(text, add_special_tokens=False, verbose=False).input_ids)
    batches = windows(ids, seqlen, limit)
    results = []
    if source:
        results.append(perplexity(model, hf_logits(load_source_model(source.path)), batches))
    for art in opened:
        results.append(perplexity(str(art.path), hf_logits(load_dequantized(art)), batches))
    return results
