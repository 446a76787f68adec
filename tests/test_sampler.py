"""Sampler: greedy, temperature/top-k/top-p/min-p, repetition penalty, seeds, logprobs, stops."""

from __future__ import annotations

import math

import pytest
import torch

from runtime.engine.sampler import (
    Sampler,
    SamplingParams,
    TokenLogprobs,
    check_stop,
    prompt_logprobs,
)

V = 64


def _run(logits, params, generators=None, seen=None):
    B = logits.shape[0]
    generators = generators if generators is not None else [None] * B
    seen = seen if seen is not None else [None] * B
    return Sampler()(logits, params, generators, seen)


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def test_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(8, V)
    tokens, lps = _run(logits, [SamplingParams(temperature=0.0)] * 8)
    assert tokens.dtype == torch.long and tokens.shape == (8,)
    assert torch.equal(tokens, logits.argmax(-1))
    assert lps == [None] * 8


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0, 100.0])
def test_top_k_1_is_greedy(temperature):
    torch.manual_seed(1)
    logits = torch.randn(16, V)
    for _ in range(5):
        tokens, _ = _run(logits, [SamplingParams(temperature=temperature, top_k=1)] * 16)
        assert torch.equal(tokens, logits.argmax(-1))


@pytest.mark.parametrize("top_p", [1e-6, 1e-50, 5e-324])  # the last two are 0 in float32
def test_tiny_top_p_is_greedy(top_p: float):
    torch.manual_seed(2)
    logits = torch.randn(16, V)
    for _ in range(5):
        tokens, _ = _run(logits, [SamplingParams(temperature=2.0, top_p=top_p)] * 16)
        assert torch.equal(tokens, logits.argmax(-1))


def test_top_k_and_top_p_restrict_support():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]])).repeat(4, 1)
    params = [
        SamplingParams(top_k=2),
        SamplingParams(top_p=0.65),  # 0.4 < 0.65 <= 0.7: keeps {0, 1}
        SamplingParams(top_p=0.7),  # mass before token 2 is 0.7 >= 0.7: keeps {0, 1}
        SamplingParams(top_p=0.71),  # keeps {0, 1, 2}
    ]
    torch.manual_seed(3)
    seen_tokens = [set() for _ in params]
    tokens, _ = _run(logits.repeat(400, 1), params * 400)
    for i, t in enumerate(tokens.tolist()):
        seen_tokens[i % 4].add(t)
    assert seen_tokens[0] == {0, 1}
    assert seen_tokens[1] == {0, 1}
    assert seen_tokens[2] == {0, 1}
    assert seen_tokens[3] == {0, 1, 2}


def test_min_p_masks():
    # probs 0.5, 0.3, 0.15, 0.05: min_p 0.25 keeps p >= 0.125 -> {0, 1, 2}; 0.5 keeps {0, 1}
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(3, 1)
    params = [SamplingParams(min_p=0.25), SamplingParams(min_p=0.5), SamplingParams(min_p=1.0)]
    torch.manual_seed(4)
    got = [set() for _ in params]
    tokens, _ = _run(logits.repeat(400, 1), params * 400)
    for i, t in enumerate(tokens.tolist()):
        got[i % 3].add(t)
    assert got == [{0, 1, 2}, {0, 1}, {0}]


def test_repetition_penalty_changes_argmax():
    # Positive: token 0 (seen) 2.0 -> 2.0 / 2 = 1.0 < 1.5 (token 1).
    # Negative: token 2 (seen) -0.5 -> -1.0 < -0.8 (token 3), all others lower.
    logits = torch.tensor(
        [
            [2.0, 1.5, -5.0, -5.0],
            [-5.0, -5.0, -0.5, -0.8],
            [2.0, 1.5, -5.0, -5.0],
        ]
    )
    seen = [torch.tensor([0, 0, 2]), torch.tensor([2]), None]
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0)] * 2 + [
        SamplingParams(temperature=0.0)
    ]
    tokens, _ = _run(logits, params, seen=seen)
    assert tokens.tolist() == [1, 3, 0]
    # penalty < 1 favours seen tokens
    tokens, _ = _run(
        torch.tensor([[1.0, 1.5]]),
        [SamplingParams(temperature=0.0, repetition_penalty=0.5)],
        seen=[torch.tensor([0])],
    )
    assert tokens.tolist() == [0]
    # penalty does not touch the caller's logits
    before = logits.clone()
    _run(logits, params, seen=seen)
    assert torch.equal(logits, before)


def _decode_loop(row_logits_fn, seed, others, position, steps=20):
    """Run `steps` steps of a seeded request placed at `position` among `others` rows."""
    g = _gen(seed)
    p = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=seed)
    out = []
    noise = torch.Generator().manual_seed(1000 + others)
    for step in range(steps):
        mine = row_logits_fn(step)
        rows = [torch.randn(V, generator=noise) * 3 for _ in range(others)]
        rows.insert(position, mine)
        params = [SamplingParams(temperature=1.3, top_k=5 * (j + 1)) for j in range(others)]
        gens: list[torch.Generator | None] = [None] * others
        if others >= 2:  # a differently seeded neighbour too
            params[1] = SamplingParams(temperature=0.7, seed=seed + 1)
            gens[1] = _gen(seed + 1)
        params.insert(position, p)
        gens.insert(position, g)
        tokens, _ = _run(torch.stack(rows), params, generators=gens)
        out.append(int(tokens[position]))
    return out


def test_seeded_reproducible_across_batches():
    base = torch.randn(20, V, generator=torch.Generator().manual_seed(5))

    def row(step):
        return base[step] * 0.5  # flat enough that the draw matters

    torch.manual_seed(6)
    a = _decode_loop(row, seed=1234, others=0, position=0)
    torch.manual_seed(7)
    b = _decode_loop(row, seed=1234, others=3, position=2)
    c = _decode_loop(row, seed=1234, others=5, position=0)
    d = _decode_loop(row, seed=1234, others=2, position=2)
    assert a == b == c == d
    e = _decode_loop(row, seed=4321, others=3, position=1)
    assert e != a


def _sorted_reference(x: torch.Tensor, p: SamplingParams, u: float) -> int:
    """The filters on a full stable descending sort of the row in vLLM's order (min-p, then
    top-k, then top-p over what those kept), and the inverse-CDF draw at u in that order:
    what the sampler's candidate search must reproduce token for token."""
    vals, order = (x / p.temperature).sort(descending=True, stable=True)
    pos = torch.arange(len(vals))
    remove = pos >= (p.top_k or len(vals))
    if p.min_p:
        remove |= vals < vals[0] + math.log(p.min_p)
    probs = vals.masked_fill(remove, -math.inf).softmax(-1)
    if p.top_p < 1:
        remove |= probs.cumsum(-1) - probs >= p.top_p
    w = (vals.masked_fill(remove, -math.inf) - vals[0]).exp().double()
    cdf = w.cumsum(-1)
    at = min(u * float(cdf[-1]), math.nextafter(float(cdf[-1]), 0))
    return int(order[torch.searchsorted(cdf, torch.tensor([at], dtype=torch.float64), right=True)])


def test_top_p_is_taken_over_what_min_p_keeps() -> None:
    """vLLM's order: min-p 0.1 removes token 3 (0.05 < 0.1 x 0.30) and the tail, and top-p 0.9
    over the rest (0.30, 0.25, 0.20, renormalised) keeps all three. Top-p taken first over the
    whole row let token 3 into the nucleus and it was drawn 6% of the time."""
    probs = torch.tensor([0.30, 0.25, 0.20, 0.05] + [0.20 / 296] * 296)
    row = probs.log().unsqueeze(0)
    params = SamplingParams(temperature=1.0, top_p=0.9, min_p=0.1)
    drawn = torch.stack([_run(row, [params], generators=[_gen(s)])[0] for s in range(2000)])
    counts = torch.bincount(drawn.flatten(), minlength=300)
    assert counts[3:].sum() == 0 and (counts[:3] > 400).all(), counts[:5]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.5, top_p=0.99),  # nucleus past the first candidates
        SamplingParams(temperature=1.0, top_k=40),
        SamplingParams(temperature=0.8, top_k=300, top_p=0.953, min_p=0.01),
        SamplingParams(temperature=1.2, top_p=0.5, min_p=0.2),
    ],
    ids=["top_p", "wide_top_p", "top_k", "all_three", "top_p_min_p"],
)
def test_candidate_search_draws_what_a_full_sort_draws(params: SamplingParams) -> None:
    """Rows of a 5000-token vocabulary, peaked (an LM's shape) and flat (the nucleus spills
    past 256 candidates, so the search widens), and rows of coarse values (ties at the
    candidates' edge): each seeded draw equals the full-sort reference at the same uniform."""
    gen = torch.Generator().manual_seed(11)
    rows = [torch.randn(5000, generator=gen) * s for s in (8.0, 3.0, 0.5)]
    rows.append(torch.randint(0, 4, (5000,), generator=gen).float())
    for seed in range(20):
        for row in rows:
            tokens, _ = _run(row.unsqueeze(0), [params], generators=[_gen(seed)])
            u = float(torch.rand(1, generator=_gen(seed), dtype=torch.float64))
            assert int(tokens[0]) == _sorted_reference(row, params, u), (seed, params)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.5, top_p=0.99, top_k=300)])
def test_a_gpu_sorts_the_whole_row_and_draws_the_same(
    params: SamplingParams, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU (widens() False) a top-k/top-p row is drawn from one sort of the whole row,
    with no read-back to the host: the same draws as the candidate search, one call each."""
    from runtime.engine import sampler

    gen = torch.Generator().manual_seed(12)
    rows = torch.stack([torch.randn(5000, generator=gen) * s for s in (8.0, 3.0, 0.5)])
    searched = [_run(rows, [params] * 3, generators=[_gen(s)] * 3)[0] for s in range(10)]
    calls = []
    real = sampler._from_candidates
    monkeypatch.setattr(sampler, "widens", lambda device: False)
    monkeypatch.setattr(sampler, "_from_candidates", lambda *a: calls.append(a[1]) or real(*a))
    whole = [_run(rows, [params] * 3, generators=[_gen(s)] * 3)[0] for s in range(10)]
    assert [t.tolist() for t in whole] == [t.tolist() for t in searched]
    assert calls == [5000] * 10


def test_grammar_masked_rows_stay_on_the_candidates():
    """A constrained row (all but 5 tokens at -inf) with top-p: the -inf tokens tie at the
    candidates' edge but are never kept, so the first 256 candidates suffice (no widening to
    the whole vocabulary) and the draw is among the 5."""
    from runtime.engine import sampler

    logits = torch.full((1, 5000), -math.inf)
    logits[0, [7, 70, 700, 1234, 4999]] = torch.tensor([1.0, 0.5, 0.2, 0.0, -0.3])
    calls = []
    real = sampler._from_candidates
    sampler_calls = lambda *a: calls.append(a[1]) or real(*a)  # noqa: E731
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sampler, "_from_candidates", sampler_calls)
        tokens, _ = _run(logits.repeat(200, 1), [SamplingParams(top_p=0.95)] * 200)
    assert calls == [256]
    assert set(tokens.tolist()) <= {7, 70, 700, 1234, 4999} and len(set(tokens.tolist())) > 2


def test_top_k_ties_keep_the_lowest_ids():
    """Five tokens tied at the top, top_k 3: the stable order keeps ids 0, 1, 2 (as argmax
    would pick 0), however the candidate search's topk orders ties."""
    logits = torch.tensor([[1.0] * 5 + [0.0] * 995]).repeat(300, 1)
    tokens, _ = _run(logits, [SamplingParams(top_k=3)] * 300)
    assert set(tokens.tolist()) == {0, 1, 2}


def test_long_rows_draw_the_softmax():
    """A 3000-token row (drawn in two levels: block sums, then one block) with its mass on
    tokens at block edges and in the padded last block: frequencies match the softmax."""
    heavy = [0, 255, 256, 1023, 1024, 2047, 2816, 2999]
    logits = torch.full((3000,), -4.0)
    logits[heavy] = torch.tensor([1.0, 0.5, 0.0, 1.5, -0.5, 0.8, 0.2, 1.2])
    expected = logits.softmax(-1)
    n, B = 40000, 2000
    counts = torch.zeros(3000)
    torch.manual_seed(12)
    for _ in range(n // B):
        tokens, _ = _run(logits.expand(B, -1).contiguous(), [SamplingParams()] * B)
        counts += torch.bincount(tokens, minlength=3000)
    assert (counts[heavy] / n - expected[heavy]).abs().max() < 0.01
    rest = [i for i in range(3000) if i not in heavy]
    assert abs(counts[rest].sum() / n - expected[rest].sum()) < 0.01


def test_temperature_distribution_matches_softmax():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0])
    temperature = 0.8
    n = 20000
    B = 1000
    counts = torch.zeros(5)
    torch.manual_seed(8)
    params = [SamplingParams(temperature=temperature)] * B
    for _ in range(n // B):
        tokens, _ = _run(logits.expand(B, 5).contiguous(), params)
        counts += torch.bincount(tokens, minlength=5)
    expected = torch.softmax(logits / temperature, -1)
    assert (counts / n - expected).abs().max() < 0.015
    # seeded rows (own generators) follow the same distribution
    g = _gen(9)
    seeded = torch.zeros(5)
    for _ in range(2000):
        tokens, _ = _run(logits.unsqueeze(0), [SamplingParams(temperature=temperature)], [g])
        seeded[tokens[0]] += 1
    assert (seeded / 2000 - expected).abs().max() < 0.04


def test_logprobs_are_raw_log_softmax():
    torch.manual_seed(10)
    logits = torch.randn(4, V) * 2
    params = [
        SamplingParams(temperature=0.0, logprobs=5, repetition_penalty=1.5),
        SamplingParams(temperature=0.5, logprobs=0),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=2.0, logprobs=20),
    ]
    seen = [torch.tensor([1, 2, 3]), None, None, None]
    tokens, lps = _run(logits, params, seen=seen)
    ref = torch.log_softmax(logits, -1)
    assert lps[2] is None
    for i, k in [(0, 5), (1, 0), (3, 20)]:
        lp = lps[i]
        assert isinstance(lp, TokenLogprobs)
        assert lp.token_id == int(tokens[i])
        assert math.isclose(lp.logprob, float(ref[i, tokens[i]]), abs_tol=1e-5)
        assert len(lp.top) == k
        vals = [v for _, v in lp.top]
        assert vals == sorted(vals, reverse=True)
        top_ref = ref[i].topk(k) if k else None
        if k:
            assert [t for t, _ in lp.top] == top_ref.indices.tolist()
            assert torch.allclose(torch.tensor(vals), top_ref.values, atol=1e-5)


def test_prompt_logprobs_against_direct():
    torch.manual_seed(11)
    T = 9
    logits = torch.randn(T, V)
    ids = torch.randint(0, V, (T,))
    out = prompt_logprobs(logits, ids, 3)
    assert len(out) == T - 1
    for t in range(1, T):
        lp = torch.log_softmax(logits[t - 1].double(), -1)
        e = out[t - 1]
        assert e.token_id == int(ids[t])
        assert math.isclose(e.logprob, float(lp[ids[t]]), abs_tol=1e-5)
        assert [i for i, _ in e.top] == lp.topk(3).indices.tolist()
        assert all(
            math.isclose(a, float(b), abs_tol=1e-5)
            for (_, a), b in zip(e.top, lp.topk(3)[0], strict=True)
        )
    assert prompt_logprobs(logits[:1], ids[:1], 3) == []
    assert all(e.top == [] for e in prompt_logprobs(logits, ids, 0))
    with pytest.raises(ValueError):
        prompt_logprobs(logits[:-1], ids, 1)


def test_check_stop_string_across_tokens():
    p = SamplingParams(stop=("STOP", "\n\n"), max_new_tokens=100)
    text = ""
    pieces = ["Hello ", "wor", "ld S", "TO", "P and more"]
    result = (None, None)
    for n, piece in enumerate(pieces, 1):
        start = len(text)
        text += piece
        result = check_stop(text, start, 7, p, (0,), n)
        if result[0] is not None:
            break
    assert result == ("stop", len("Hello world "))
    assert text[: result[1]] == "Hello world "
    assert n == 5  # "STOP" completes with the fifth piece
    # earliest of several stops in the new text wins
    assert check_stop("ab\n\nxSTOP", 1, 7, p, (0,), 1) == ("stop", 2)
    # a match wholly in old text is not searched again (caller would have stopped already)
    assert check_stop("xxxxxxxxxx", 8, 7, p, (0,), 1) == (None, None)
    # empty new text: nothing to search
    assert check_stop("STOP", 4, 7, p, (0,), 1) == (None, None)


def test_check_stop_tokens_and_length():
    p = SamplingParams(max_new_tokens=3, stop_token_ids=(42,))
    # a stop token's own text (from 2 in "ab<e>") is cut, as vLLM cuts it
    assert check_stop("ab<e>", 2, 0, p, (0, 1), 1) == ("stop", 2)
    assert check_stop("a", 1, 1, p, (0, 1), 1) == ("stop", 1)
    assert check_stop("a,", 1, 42, p, (0, 1), 1) == ("stop", 1)
    assert check_stop("a", 0, 5, p, (0, 1), 2) == (None, None)
    assert check_stop("a", 0, 5, p, (0, 1), 3) == ("length", None)
    ig = SamplingParams(max_new_tokens=3, stop_token_ids=(42,), ignore_eos=True)
    assert check_stop("a", 0, 0, ig, (0, 1), 1) == (None, None)
    assert check_stop("a", 0, 42, ig, (0, 1), 1) == ("stop", 0)
    # a stop string on the last allowed token is a stop, not length
    s = SamplingParams(max_new_tokens=1, stop=("a",))
    assert check_stop("xa", 1, 5, s, (), 1) == ("stop", 1)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"stop": ("",)}, "stop"),
        # a bool is an int to Python: logprobs=True failed inside a step, in torch.topk
        ({"logprobs": True}, "logprobs"),
        ({"prompt_logprobs": True}, "prompt_logprobs"),
        ({"temperature": True}, "temperature"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        # not a list: a bare TypeError before, or silently cast ("2" -> 2, 2.7 -> 2)
        ({"stop": 5}, "stop"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"stop_token_ids": "2"}, "stop_token_ids"),
        ({"stop_token_ids": (2.7,)}, "stop_token_ids"),
        ({"stop_token_ids": (None,)}, "stop_token_ids"),
        ({"ignore_eos": "no"}, "ignore_eos"),
    ],
)
def test_validate_errors(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs).validate()


def test_validate_ok_and_normalises():
    SamplingParams().validate()
    SamplingParams(temperature=0, top_p=1, top_k=0, min_p=1, logprobs=20).validate()
    p = SamplingParams(stop=["a", "b"], stop_token_ids=[1, 2])  # type: ignore[arg-type]
    assert p.stop == ("a", "b") and p.stop_token_ids == (1, 2)
    assert SamplingParams(stop="x").stop == ("x",)  # type: ignore[arg-type]
    hash(p)


def test_mixed_batch_shapes_and_bf16():
    torch.manual_seed(12)
    logits = torch.randn(5, V).to(torch.bfloat16)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=3),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(top_p=0.5, min_p=0.1),
        SamplingParams(temperature=0.7, seed=3),
    ]
    tokens, lps = _run(logits, params, generators=[None, None, None, None, _gen(3)])
    assert tokens.shape == (5,)
    f = logits.float()
    assert int(tokens[0]) == int(f[0].argmax()) and int(tokens[2]) == int(f[2].argmax())
    assert f[1, tokens[1]] >= f[1].topk(3).values[-1]  # (bf16 values can tie)
    assert lps[2] is not None and lps[2].token_id == int(tokens[2])
    with pytest.raises(ValueError):
        _run(logits, params[:4])


@pytest.mark.parametrize("penalty", [5e-324, 1e-40, 1e-30, 1e39, 1e300])
def test_extreme_repetition_penalty_draws_a_valid_token(penalty):
    # float32 rounds these to 0, a subnormal or infinity: the penalised row must stay a
    # distribution (the fuzzer's 5e-324 once made a NaN row and an index past the vocabulary)
    torch.manual_seed(1)
    logits = torch.randn(4, V) * 5
    logits[:, 7] = 0.0  # 0 * inf is NaN
    logits[3, 9] = -math.inf  # a grammar-masked token stays masked
    seen = [torch.arange(V)] * 3 + [torch.tensor([3, 7, 9])]
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=penalty),
        SamplingParams(temperature=1e-4, top_p=0.9, repetition_penalty=penalty, seed=0),
        SamplingParams(temperature=0.7, top_k=5, min_p=0.1, repetition_penalty=penalty),
        SamplingParams(temperature=1.0, logprobs=3, repetition_penalty=penalty),
    ]
    for _ in range(5):
        tokens, lps = _run(logits, params, generators=[_gen(i) for i in range(4)], seen=seen)
        assert ((tokens >= 0) & (tokens < V)).all() and tokens[3] != 9
        if penalty < 1:  # every token seen: the best positive logit wins, as in the limit
            assert tokens[:2].tolist() == logits[:2].argmax(-1).tolist()
        assert math.isfinite(lps[3].logprob)
