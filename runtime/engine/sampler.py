"""Turning a batch of logits into tokens: grammar masks, logit bias, penalties, temperature,
top-k/top-p/min-p, the draw.

One call handles a whole decode batch. Everything that can be is vectorised over the batch
(penalties, temperature, the top-k/top-p/min-p masks over each row's best candidates, the
draw); only the uniforms loop over seeded rows, so that a seeded row's token depends on nothing
but its own generator and its own logits: the same seeded request gives the same text
whatever else is in the batch. Each row draws by inverse CDF from one uniform; rows with top-k
or top-p are filtered among their best candidates (in full-sort order, widened until they hold
the filtered set), so no step sorts the vocabulary: that sort and a vocabulary of exponential
draws per row cost 7 ms a row on a 49k-token vocabulary on the CPU.

Logprobs are those of the raw model distribution (log_softmax of the incoming logits, before
masks, bias, penalties and temperature), as vLLM and the OpenAI API report them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from runtime.device import on_device, to_device
from runtime.engine.grammar import apply_mask

# Temperatures below this are treated as greedy (vLLM uses the same threshold): dividing by a
# near-zero temperature only overflows to the same argmax.
_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
_CANDIDATES = 256  # tokens a top-k/top-p row is first drawn from (more when its nucleus is wider)
_CDF_BLOCK = 256  # columns per first-level sum of a long row's draw
# |logit| a repetition penalty may push a logit to: beyond it exp() tells nothing more, and
# a temperature down to _GREEDY_EPS still divides it without reaching float32's infinity
_LOGIT_LIMIT = 1e30


def _as_tuple(value: object) -> object:
    """A list or tuple as a tuple (hashable); anything else as it is, for validate() to name."""
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is not a count


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    # HF/vLLM semantics: logits of tokens seen in prompt + output: > 0 divided by it, < 0 times it.
    repetition_penalty: float = 1.0
    # OpenAI semantics, over the generated tokens only: logit -= count * frequency_penalty
    # + (count > 0) * presence_penalty.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # (token id, bias) pairs added to the logits before sampling (OpenAI's logit_bias).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Canonical JSON of a schema the output must match (runtime.engine.grammar); None: free.
    json_schema: str | None = None
    skip_special_tokens: bool = True
    seed: int | None = None
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # None: none; k >= 0: logprob of the sampled token plus the top-k alternatives.
    logprobs: int | None = None
    # Same, for every prompt token after the first.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        # Accept a bare string or lists from an API layer; keep the dataclass hashable.
        stop = (self.stop,) if isinstance(self.stop, str) else _as_tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def validate(self) -> None:
        """Raise ValueError naming the first field out of its allowed range."""

        def bad(field: str, allowed: str, value: object) -> ValueError:
            return ValueError(f"{field} must be {allowed}, got {value!r}")

        t = self.temperature
        if not (_number(t) and 0 <= t < math.inf):  # inf: uniform noise
            raise bad("temperature", ">= 0 and finite", t)
        if not (_number(self.top_p) and 0 < self.top_p <= 1):
            raise bad("top_p", "in (0, 1]", self.top_p)
        if not (_integer(self.top_k) and self.top_k >= 0):
            raise bad("top_k", "an integer >= 0 (0 = off)", self.top_k)
        if not (_number(self.min_p) and 0 <= self.min_p <= 1):
            raise bad("min_p", "in [0, 1]", self.min_p)
        if not (_number(self.repetition_penalty) and self.repetition_penalty > 0):
            raise bad("repetition_penalty", "> 0", self.repetition_penalty)
        for field in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, field)
            if not (_number(v) and -2 <= v <= 2):
                raise bad(field, "in [-2, 2]", v)
        if any(not -100 <= b <= 100 for _, b in self.logit_bias):
            raise bad("logit_bias", "biases in [-100, 100]", self.logit_bias)
        if not (_integer(self.max_new_tokens) and self.max_new_tokens >= 1):
            raise bad("max_new_tokens", "an integer >= 1", self.max_new_tokens)
        for field in ("logprobs", "prompt_logprobs"):
            v = getattr(self, field)
            if v is not None and not (_integer(v) and 0 <= v <= MAX_LOGPROBS):
                raise bad(field, f"None or an integer in [0, {MAX_LOGPROBS}]", v)
        if self.seed is not None and not (_integer(self.seed) and -(2**63) <= self.seed < 2**64):
            raise bad("seed", "None or an integer in torch's range [-2^63, 2^64)", self.seed)
        stop = self.stop
        if not isinstance(stop, tuple) or any(not isinstance(s, str) or not s for s in stop):
            raise bad("stop", "a string or a list of non-empty strings", stop)
        ids = self.stop_token_ids
        if not isinstance(ids, tuple) or any(not (_integer(t) and t >= 0) for t in ids):
            raise bad("stop_token_ids", "a list of non-negative token ids", ids)
        for field in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, field), bool):
                raise bad(field, "true or false", getattr(self, field))


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # top-k (token id, logprob), highest first


@dataclass
class BatchLogprobs:
    """The logprobs a batch's rows asked for, as tensors until lists() reads them: on a GPU
    reading them right after sampling would wait for everything queued since (overlapped
    scheduling copies them to the host behind the step and reads them later)."""

    size: int  # rows in the batch
    rows: list[int]  # the rows that asked, ascending
    ks: list[int]  # their top-k counts
    ids: torch.Tensor | None = None  # [R] sampled ids
    chosen: torch.Tensor | None = None  # [R] their logprobs
    top_vals: torch.Tensor | None = None  # [R, max k]
    top_ids: torch.Tensor | None = None

    @classmethod
    def of(
        cls, logprobs: torch.Tensor, ids: torch.Tensor, size: int, rows: list[int], ks: list[int]
    ) -> BatchLogprobs:
        """From ``logprobs`` [R, V] of the asking rows and their chosen ``ids`` [R]: one topk
        for all of them, nothing read yet."""
        top_vals, top_ids = logprobs.topk(min(max(ks), logprobs.shape[1]), dim=-1)
        chosen = logprobs.gather(1, ids.unsqueeze(1)).squeeze(1)
        return cls(size, rows, ks, ids, chosen, top_vals, top_ids)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> BatchLogprobs:
        """The same with ``fn`` applied to every tensor (a copy to the host)."""
        names = ("ids", "chosen", "top_vals", "top_ids")
        moved = {n: None if getattr(self, n) is None else fn(getattr(self, n)) for n in names}
        return BatchLogprobs(self.size, self.rows, self.ks, **moved)

    def lists(self) -> list[TokenLogprobs | None]:
        out: list[TokenLogprobs | None] = [None] * self.size
        if not self.rows:
            return out
        ids, chosen = self.ids.tolist(), self.chosen.tolist()
        vals, idx = self.top_vals.tolist(), self.top_ids.tolist()
        for j, (i, k) in enumerate(zip(self.rows, self.ks, strict=True)):
            top = list(zip(idx[j][:k], vals[j][:k], strict=True))
            out[i] = TokenLogprobs(token_id=ids[j], logprob=chosen[j], top=top)
        return out


def _apply_repetition_penalty(
    logits: torch.Tensor, params: Sequence[SamplingParams], seen: Sequence[torch.Tensor | None]
) -> torch.Tensor:
    rows = [
        i
        for i, p in enumerate(params)
        if p.repetition_penalty != 1.0 and seen[i] is not None and seen[i].numel() > 0
    ]
    if not rows:
        return logits
    V = logits.shape[1]
    device = logits.device
    ids = [seen[i].to(dtype=torch.long).reshape(-1) for i in rows]
    which = torch.cat([torch.full_like(x, j) for j, x in enumerate(ids)])
    ids = torch.cat(ids)
    keep = (ids >= 0) & (ids < V)
    mask = torch.zeros(len(rows), V, dtype=torch.bool, device=device)
    # one scatter; a device value, since a Python True would be copied from the host (a sync)
    on = torch.ones((), dtype=torch.bool, device=device)
    mask.index_put_((to_device(which[keep], device), to_device(ids[keep], device)), on)
    pen = on_device([params[i].repetition_penalty for i in rows], device, torch.float32)
    idx = on_device(rows, device)
    sub = logits[idx]
    # Any penalty > 0 is valid, but 5e-324 rounds to 0 in float32 and 1e39 to infinity, and
    # 1e-38 pushes a logit past float32's range: several +inf (or 0 * inf) make a NaN row. The
    # factor is bounded so that no logit of the row leaves ±_LOGIT_LIMIT: the order of the
    # penalised logits is kept (a uniform scale), which is all the limit of a larger one adds.
    big = sub.masked_fill(~sub.isfinite(), 0).abs().amax(dim=1, keepdim=True).clamp(min=1.0)
    pen = torch.minimum(torch.maximum(pen.unsqueeze(1), big / _LOGIT_LIMIT), _LOGIT_LIMIT / big)
    penalised = torch.where(sub > 0, sub / pen, sub * pen)
    logits = logits.clone()
    logits[idx] = torch.where(mask & sub.isfinite(), penalised, sub)  # masked stay -inf
    return logits


def _apply_bias_and_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    outputs: Sequence[torch.Tensor | None],
) -> torch.Tensor:
    """logit_bias, presence and frequency penalties as one additive [B, V] term (built with
    scatter-adds on logits.device), only when some row asks for one."""
    rows = [
        i for i, p in enumerate(params) if p.logit_bias or p.presence_penalty or p.frequency_penalty
    ]
    if not rows:
        return logits
    B, V = logits.shape
    device = logits.device
    delta = torch.zeros(B, V, device=device, dtype=logits.dtype)
    for i in rows:
        p = params[i]
        # ids past the logits are dropped on the host: a mask on the device would sync
        if p.logit_bias:
            bias = [(t, b) for t, b in p.logit_bias if t < V]
            ids = on_device([t for t, _ in bias], device)
            delta[i].index_add_(0, ids, on_device([b for _, b in bias], device, logits.dtype))
        out = outputs[i]
        if out is not None and out.numel() and (p.presence_penalty or p.frequency_penalty):
            ids = out.to(dtype=torch.long).reshape(-1)
            ids = to_device(ids[ids < V], device)
            counts = torch.zeros(V, device=device, dtype=logits.dtype)
            counts.index_add_(0, ids, torch.ones_like(ids, dtype=logits.dtype))
            delta[i] -= counts * p.frequency_penalty + (counts > 0) * p.presence_penalty
    return logits + delta


def _uniforms(generators: Sequence[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """One uniform in [0, 1) per row, float64: unseeded rows share one draw from the global
    RNG; each seeded row draws from its own generator alone (on the generator's device), so its
    token depends on nothing else in the batch."""
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        return torch.rand(len(generators), dtype=torch.float64, device=device)
    u = torch.empty(len(generators), dtype=torch.float64, device=device)
    if unseeded:
        drawn = torch.rand(len(unseeded), dtype=torch.float64, device=device)
        u[on_device(unseeded, device)] = drawn
    for i, g in enumerate(generators):
        if g is not None:
            u[i] = torch.rand(1, generator=g, dtype=torch.float64, device=g.device)[0]
    return u


def _inverse_cdf(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the column whose probability interval (softmax of the row, in column order)
    holds u: the first column whose cumulative weight exceeds u * total. Running sums in
    float64; a -inf column has an empty interval and is never drawn. Long rows go in two
    levels, float32 sums of _CDF_BLOCK columns (each within ~1e-7 of its exact value: the
    intervals move by that, relatively) and then one block's running sum: a running sum over
    the whole vocabulary is sequential, and was most of a temperature-only draw."""
    S, N = logits.shape
    w = (logits - logits.max(dim=1, keepdim=True).values).exp()
    if N <= 4 * _CDF_BLOCK:
        return _first_above(w.cumsum(dim=1, dtype=torch.float64), u)
    if N % _CDF_BLOCK:
        w = torch.nn.functional.pad(w, (0, -N % _CDF_BLOCK))
    blocks = w.view(S, -1, _CDF_BLOCK)
    cdf = blocks.sum(dim=2).double().cumsum(dim=1)
    b = _first_above(cdf, u)
    start = torch.where(b > 0, cdf.gather(1, (b - 1).clamp_min(0).unsqueeze(1)).squeeze(1), 0.0)
    x = u * cdf[:, -1] - start  # where u falls inside block b
    inner = blocks.gather(1, b.view(S, 1, 1).expand(S, 1, _CDF_BLOCK)).squeeze(1)
    inner = inner.cumsum(dim=1, dtype=torch.float64)
    return b * _CDF_BLOCK + _first_above(inner, x / inner[:, -1])


def _first_above(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose running sum exceeds u (in [0, 1)) times the row's total;
    below the total even where u * total rounds up to it, so the index has positive weight."""
    total = cdf[:, -1:]
    x = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True).squeeze(1)


def _log_min_p(mins: Sequence[float], device: torch.device) -> torch.Tensor:
    """[S, 1] log(min_p) per row, -inf where min-p is off: prob < min_p * max prob is
    logit < max logit + log(min_p)."""
    return on_device(
        [math.log(m) if m > 0 else -math.inf for m in mins], device, torch.float32
    ).unsqueeze(1)


def _from_candidates(
    x: torch.Tensor,
    count: int,
    ks: list[int],
    ps: list[float],
    u: torch.Tensor,
    lse: torch.Tensor,
) -> tuple[torch.Tensor, list[bool]]:
    """Each row's token drawn among its ``count`` best, and whether those hold its filtered
    set: its top-k is on (at most ``count``) or the candidates' mass reaches its top-p, and no
    kept candidate ties the next token (one more is fetched to tell). ``lse``: each row's
    logsumexp, the top-p normaliser where top-k is off."""
    S, V = x.shape
    device = x.device
    vals, idx = x.topk(min(V, count + 1), dim=-1)
    next_val = vals[:, count] if count < V else None
    vals, idx = vals[:, :count], idx[:, :count]
    by_id = idx.argsort(dim=-1)  # the order of a stable sort: equal values by ascending id
    vals, idx = vals.gather(1, by_id), idx.gather(1, by_id)
    vals, order = vals.sort(dim=-1, descending=True, stable=True)
    idx = idx.gather(1, order)
    pos = torch.arange(count, device=device).unsqueeze(0)
    on = on_device([k < V for k in ks], device, torch.bool)
    remove = pos >= on_device(ks, device).unsqueeze(1)  # top-k
    # top-p over the top-k tokens where top-k is on, else over the whole row
    norm = torch.where(on, vals.masked_fill(remove, -math.inf).logsumexp(dim=1), lse)
    probs = (vals - norm.unsqueeze(1)).exp().masked_fill(remove, 0.0)
    p_t = on_device(ps, device, probs.dtype).unsqueeze(1)
    before = probs.cumsum(dim=1) - probs
    # the best token always stays: a top_p below float32's least number rounds to 0 here
    remove |= (before >= p_t) & (p_t < 1.0) & (pos > 0)
    remove |= vals.isneginf()  # left out by min-p (_sample)
    chosen = _inverse_cdf(vals.masked_fill(remove, -math.inf), u)
    tokens = idx.gather(1, chosen.unsqueeze(1)).squeeze(1)
    if next_val is None:
        return tokens, [True] * S
    held = on | (probs.sum(dim=1) >= p_t.squeeze(1))
    # every kept candidate above the next token: tokens tied with it (whose order a topk does
    # not keep) are all filtered out, here as in a full sort (their prefix mass is the same)
    above = (remove | (vals > next_val.unsqueeze(1))).all(dim=1)
    return tokens, (held & above).tolist()


def widens(device: torch.device) -> bool:
    """Whether top-k/top-p rows start from a few candidates and widen (on the CPU, where a sort
    of the vocabulary is slow) or sort the whole row at once (on a GPU: the widening's check
    reads back to the host, a sync that overlapped scheduling cannot afford, and a device sort
    is cheap)."""
    return device.type == "cpu"


def _nucleus(x: torch.Tensor, ks: list[int], ps: list[float], u: torch.Tensor) -> torch.Tensor:
    """Tokens of rows with top-k and/or top-p (after min-p, in x), drawn from their best
    candidates instead of a sort of the whole vocabulary (2.4 ms a row at 49k tokens on the
    CPU; a topk of 256 is a twentieth of it; on a GPU the whole row, see widens()). A row
    starts with its top-k or _CANDIDATES, whichever is more, and retries with 8x as many while
    they do not hold its filtered set, up to the whole row; its count depends on nothing else
    in the batch. The candidates come in the order of a full stable sort, so the draw is the
    one a sort of the whole row gives."""
    S, V = x.shape
    out = torch.empty(S, dtype=torch.long, device=x.device)
    # the top-p normaliser of rows without top-k (a pass over the vocabulary: only if needed)
    lse = x.logsumexp(dim=1) if any(k >= V for k in ks) else x.new_zeros(S)
    start = [min(V, max(_CANDIDATES, k if k < V else 0)) if widens(x.device) else V for k in ks]
    todo = dict(enumerate(start))
    while todo:
        count = min(todo.values())
        rows = [i for i, c in todo.items() if c == count]
        at = _Rows(rows, S, x.device)
        tokens, fits = _from_candidates(
            at.take(x), count, [ks[i] for i in rows], [ps[i] for i in rows], at.take(u),
            at.take(lse),
        )  # fmt: skip
        done = [i for i, ok in zip(rows, fits, strict=True) if ok]
        if len(done) == S:  # every row at once: always so on a GPU, which sorts whole rows
            return tokens
        if done:
            kept = [j for j, ok in enumerate(fits) if ok]
            out[on_device(done, x.device)] = tokens[on_device(kept, x.device)]
        for i in done:
            del todo[i]
        for i in rows:
            if i in todo:
                todo[i] = min(V, count * 8)
    return out


def _sample(
    x: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """Temperature, min-p, then top-k and top-p over what min-p kept (vLLM's order: top-p
    taken first counted the mass of tokens min-p then removed, so its nucleus was too wide,
    6% of draws on a token vLLM never draws), and one inverse-CDF draw per row. Rows with no
    top-k or top-p draw from the whole row in id order."""
    device = x.device
    S, V = x.shape
    temps = [p.temperature for p in params]
    if any(t != 1.0 for t in temps):
        x = x / on_device(temps, device, x.dtype).unsqueeze(1)
    ks = [p.top_k if 0 < p.top_k < V else V for p in params]
    ps = [float(p.top_p) for p in params]
    mins = [float(p.min_p) for p in params]
    if any(m > 0 for m in mins):  # prob < min_p * max prob, gone before top-k and top-p
        x = x.masked_fill(
            x < x.max(dim=1, keepdim=True).values + _log_min_p(mins, device), -math.inf
        )
    u = _uniforms(generators, device)
    tokens = torch.empty(S, dtype=torch.long, device=device)
    nucleus = [i for i in range(S) if ks[i] < V or ps[i] < 1.0]
    whole = [i for i in range(S) if ks[i] == V and ps[i] >= 1.0]
    if whole:
        at = _Rows(whole, S, device)
        tokens = at.put(tokens, _inverse_cdf(at.take(x), at.take(u)))
    if nucleus:
        at = _Rows(nucleus, S, device)
        sub = [ks[i] for i in nucleus], [ps[i] for i in nucleus]
        tokens = at.put(tokens, _nucleus(at.take(x), *sub, at.take(u)))
    return tokens


class _Rows:
    """Some rows of a batch, indexed on the device (on_device: no stream sync), or no index at
    all where they are every row in order."""

    def __init__(self, rows: list[int], size: int, device: torch.device) -> None:
        self.index = None if rows == list(range(size)) else on_device(rows, device)

    def take(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.index is None else t[self.index]

    def put(self, out: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``out`` with these rows set to ``values`` (``values`` itself for every row)."""
        if self.index is None:
            return values
        out[self.index] = values
        return out


class Sampler:
    """Stateless; per-request state (generators, seen tokens) is owned by the caller."""

    def __call__(self, *args, **kwargs) -> tuple[torch.Tensor, list[TokenLogprobs | None]]:
        """sample(), its logprobs read at once."""
        tokens, logprobs = self.sample(*args, **kwargs)
        return tokens, logprobs.lists()

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        seen: list[torch.Tensor | None],
        outputs: list[torch.Tensor | None] | None = None,
        masks: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, BatchLogprobs]:
        """outputs: each row's generated tokens (presence/frequency penalties); masks: the
        bit-packed grammar masks [B, ceil(V / 32)] (runtime.engine.grammar), None if no row
        is constrained."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
        B = logits.shape[0]
        if not (len(params) == len(generators) == len(seen) == B):
            raise ValueError(
                f"batch of {B} rows needs {B} params/generators/seen, got "
                f"{len(params)}/{len(generators)}/{len(seen)}"
            )
        logits = logits.float()
        device = logits.device
        want_lp = [i for i, p in enumerate(params) if p.logprobs is not None]
        lp_rows = _Rows(want_lp, B, device)
        raw_lp = lp_rows.take(logits).log_softmax(dim=-1) if want_lp else None

        x = logits if masks is None else apply_mask(logits, masks)
        x = _apply_bias_and_penalties(x, params, outputs or [None] * B)
        x = _apply_repetition_penalty(x, params, seen)
        tokens = torch.empty(B, dtype=torch.long, device=device)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        sample = [i for i, p in enumerate(params) if not p.greedy]
        if greedy:
            at = _Rows(greedy, B, device)
            tokens = at.put(tokens, at.take(x).argmax(dim=-1))
        if sample:
            at = _Rows(sample, B, device)
            gens = [generators[i] for i in sample]
            tokens = at.put(tokens, _sample(at.take(x), [params[i] for i in sample], gens))

        if raw_lp is None:
            return tokens, BatchLogprobs(B, [], [])
        ids = lp_rows.take(tokens)
        ks = [params[i].logprobs for i in want_lp]
        return tokens, BatchLogprobs.of(raw_lp, ids, B, want_lp, ks)


def prompt_logprobs(logits: torch.Tensor, prompt_ids: torch.Tensor, k: int) -> list[TokenLogprobs]:
    """For t = 1..T-1: logprob of prompt_ids[t] under logits[t-1], plus the top-k at t-1.

    logits: [T, V] from a prefill over the prompt; returns T-1 entries (none for the first token).
    """
    ids = prompt_ids.reshape(-1).to(device=logits.device, dtype=torch.long)
    if logits.dim() != 2 or logits.shape[0] != ids.shape[0]:
        raise ValueError(
            f"logits must be [T, V] with T = len(prompt_ids) = {ids.shape[0]}, "
            f"got shape {tuple(logits.shape)}"
        )
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if ids.shape[0] < 2:
        return []
    lp = logits[:-1].float().log_softmax(dim=-1)
    n = lp.shape[0]
    return BatchLogprobs.of(lp, ids[1:], n, list(range(n)), [k] * n).lists()


def check_stop(
    text_so_far: str,
    new_text_start: int,
    token_id: int,
    params: SamplingParams,
    eos_ids: tuple[int, ...],
    n_generated: int,
) -> tuple[str | None, int | None]:
    """Whether the sequence finishes after this token: (finish_reason or None, cut index or None).

    text_so_far: all generated (visible) text including this token's; new_text_start: where this
    token's text begins in it; n_generated: tokens generated so far, this one included. For a
    stop string the cut index is where the text must be truncated (text_so_far[:cut]) so the
    stop string is not returned; for a stop token (stop_token_ids, EOS) it is where the token's
    text begins, so that text is not returned either (vLLM's way: with skip_special_tokens false
    the reply ended in "<|im_end|>", which a client sending it back doubled). Priority:
    stop_token_ids, EOS, stop strings, then length.
    """
    if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos_ids):
        return "stop", new_text_start
    if params.stop and new_text_start < len(text_so_far):
        cut: int | None = None
        for s in params.stop:
            # A new match must end inside the new text, so it starts at most len(s) - 1 before it.
            i = text_so_far.find(s, max(0, new_text_start - len(s) + 1))
            if i != -1 and (cut is None or i < cut):
                cut = i
        if cut is not None:
            return "stop", cut
    if n_generated >= params.max_new_tokens:
        return "length", None
    return None, None
