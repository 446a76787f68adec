"""Perplexity, KL divergence and top-1 agreement: fixed logits against hand computation, and
the engine-served variants against transformers on the same weights."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from lite.perplexity import compare, hf_logits, perplexity, run_ppl, windows

FLOAT_ACTIVATIONS = True  # exact math against the reference (conftest.py)

# Two windows of 3 tokens over a vocabulary of 3: positions 0 and 1 predict tokens 1 and 2.
IDS = torch.tensor([[0, 1, 2], [2, 2, 0]])
BASE = torch.tensor(
    [
        [[0.0, 0.0, 0.0], [math.log(2), 0.0, 0.0]],
        [[0.0, math.log(3), 0.0], [0.0, 0.0, math.log(4)]],
    ]
)
VARIANT = torch.tensor(
    [
        [[0.0, math.log(2), 0.0], [0.0, 0.0, 0.0]],
        [[0.0, 0.0, math.log(5)], [math.log(6), 0.0, 0.0]],
    ]
)


def _softmax(row: list[float]) -> list[float]:
    e = [math.exp(x) for x in row]
    return [x / sum(e) for x in e]


def _hand() -> dict[str, list[float]]:
    """Per-window sums of nll (variant), KL(base || variant) and top-1 agreement."""
    out: dict[str, list[float]] = {"nll": [], "kl": [], "top1": [], "base_nll": []}
    for w in range(2):
        nll = kl = top1 = base_nll = 0.0
        for t in range(2):
            p, q = _softmax(BASE[w, t].tolist()), _softmax(VARIANT[w, t].tolist())
            target = int(IDS[w, t + 1])
            nll += -math.log(q[target])
            base_nll += -math.log(p[target])
            kl += sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True))
            top1 += float(p.index(max(p)) == q.index(max(q)))
        for key, value in zip(out, (nll, kl, top1, base_nll), strict=True):
            out[key].append(value)
    return out


def test_metrics_against_hand_computation() -> None:
    base, variant = compare(["base", "q"], [lambda ids: BASE, lambda ids: VARIANT], IDS)
    hand = _hand()
    assert base.ppl == pytest.approx(math.exp(sum(hand["base_nll"]) / 4), rel=1e-6)
    assert base.kl is None and base.top1 is None
    assert variant.tokens == 4 and variant.windows == 2
    assert variant.nll == pytest.approx(sum(hand["nll"]) / 4, rel=1e-6)
    assert variant.ppl == pytest.approx(math.exp(sum(hand["nll"]) / 4), rel=1e-6)
    assert variant.kl.mean == pytest.approx(sum(hand["kl"]) / 4, rel=1e-6)
    assert variant.top1.mean == pytest.approx(sum(hand["top1"]) / 4)
    # windows are the samples: se = std(per-window means) / sqrt(2)
    per_window = [x / 2 for x in hand["kl"]]
    se = abs(per_window[0] - per_window[1]) / math.sqrt(2) / math.sqrt(2)
    assert variant.kl.stderr == pytest.approx(se, rel=1e-6)
    nll_w = [x / 2 for x in hand["nll"]]
    se_nll = abs(nll_w[0] - nll_w[1]) / 2
    assert variant.ppl_stderr == pytest.approx(variant.ppl * se_nll, rel=1e-6)


def test_identical_models_have_zero_kl_and_full_agreement() -> None:
    logits = torch.randn(3, 7, 11)
    ids = torch.randint(0, 11, (3, 8))
    _, same = compare(["a", "b"], [lambda i: logits, lambda i: logits.clone()], ids)
    assert same.kl.mean == pytest.approx(0.0, abs=1e-6)
    assert same.top1.mean == 1.0


def test_windows_protocol() -> None:
    tokens = torch.arange(23)
    w = windows(tokens, 5)
    assert w.shape == (4, 5) and torch.equal(w.flatten(), tokens[:20])
    assert windows(tokens, 5, limit=2).shape == (2, 5)
    with pytest.raises(ValueError, match="fewer than one window"):
        windows(tokens, 30)
    with pytest.raises(ValueError, match="at least 2"):
        windows(tokens, 1)


def test_engine_variants_against_transformers(
    tiny_models: dict[str, Path], rtn_artifact: Path, tmp_path: Path
) -> None:
    """The kv=none variant served by the engine scores like transformers on the dequantized
    weights (fp32, 1e-4 relative); the int8 KV variant moves the distribution a little."""
    from transformers import AutoTokenizer

    from lite.data import pydoc_split
    from lite.hf import load_dequantized
    from runtime.artifact.reader import Artifact

    text = tmp_path / "text.txt"
    text.write_text(pydoc_split()[1][:20000])
    source, none, int8 = run_ppl(
        str(tiny_models["llama"]),
        (rtn_artifact,),
        text,
        seqlen=48,
        limit=5,
        kv_quants=("none", "int8"),
    )
    assert [r.name for r in (none, int8)] == ["art kv=none", "art kv=int8"]
    assert source.kl is None and none.tokens == int8.tokens == 5 * 47
    tok = AutoTokenizer.from_pretrained(tiny_models["llama"])
    ids = torch.tensor(tok(text.read_text(), add_special_tokens=False).input_ids)
    ref = perplexity(
        "ref", hf_logits(load_dequantized(Artifact(rtn_artifact))), windows(ids, 48, 5)
    )
    assert none.ppl == pytest.approx(ref.ppl, rel=1e-4)
    assert 0 < none.kl.mean < 0.5 and 0.5 < none.top1.mean <= 1  # RTN moved it, not far
    assert int8.kl.mean != none.kl.mean and abs(int8.ppl / none.ppl - 1) < 0.02
