"""AWQ's two searches, scored exactly and cheaply through the inputs' Gram matrix.

For a linear with weight W and inputs x_t, the output error of a candidate W' summed over all
calibration tokens is sum_t |(W - W') x_t|^2 = tr(E H E^T) with E = W - W' and H = sum_t x_t
x_t^T. H is accumulated once per layer; each candidate then costs O(N K^2) instead of a forward
over every token, so the whole calibration set scores every grid point (no token subsampling).

Precision, the same on every device: statistics (H, sum |x|) accumulate in fp32 and fp64, and
losses are scored in fp64, so a GPU run makes the grid choices the CPU run makes. fp64 costs
nothing on the CPU and on data-center GPUs (an A100/H100/H200 multiplies fp64 matrices at its
plain fp32 rate); on a consumer GPU (1/64 of it) the scale search becomes the slow part.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from lite.quantizer import QuantSpec, fake_quantize


@dataclass
class InputStats:
    """Running statistics of one linear input: Gram matrix and mean |x| per channel."""

    dim: int
    device: torch.device | str = "cpu"  # where the inputs arrive: the statistics live there
    gram: torch.Tensor = field(init=False)
    abs_sum: torch.Tensor = field(init=False)
    count: int = 0

    def __post_init__(self) -> None:
        self.gram = torch.zeros(self.dim, self.dim, dtype=torch.float32, device=self.device)
        self.abs_sum = torch.zeros(self.dim, dtype=torch.float64, device=self.device)

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, self.dim).float()
        self.gram.addmm_(x.T, x)
        self.abs_sum += x.abs().sum(0, dtype=torch.float64)
        self.count += x.shape[0]

    @property
    def mean_abs(self) -> torch.Tensor:
        return (self.abs_sum / max(self.count, 1)).float()

    def rescale(self, s: torch.Tensor) -> None:
        """The inputs become x / s once s is folded into the previous op."""
        inv = 1.0 / s.float()
        self.gram *= inv[:, None] * inv[None, :]
        self.abs_sum *= inv.double()


def output_error(err: torch.Tensor, gram: torch.Tensor) -> float:
    """tr(E H E^T): the squared output error over all calibration tokens. Pass H in fp64 when
    scoring many candidates against it: it is then converted once, not per call."""
    e = err.double()
    return float(((e @ gram.double()) * e).sum())


def weight_importance(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Mean over rows of |w| normalized by its group's max: AWQ's w_mean for duo scaling."""
    n, k = w.shape
    pad = math.ceil(k / group_size) * group_size - k
    g = torch.nn.functional.pad(w.abs().float(), (0, pad)).view(n, -1, group_size)
    g = g / (g.amax(-1, keepdim=True) + 1e-6)
    return g.view(n, -1)[:, :k].mean(0)


@dataclass
class ScaleResult:
    scales: torch.Tensor
    ratio: float | None  # None: identity (no candidate beat it, or the search was not finite)
    loss: float
    identity_loss: float


def search_scale(
    w: torch.Tensor, stats: InputStats, spec: QuantSpec, n_grid: int = 20, duo: bool = True
) -> ScaleResult:
    """Grid over alpha of s = x_mean^a / w_mean^(1-a); identity is a candidate too, so the
    search never does worse than round-to-nearest on its own objective."""
    x_mean = stats.mean_abs
    w_mean = weight_importance(w, spec.group_size)
    gram = stats.gram.double()
    identity = torch.ones_like(x_mean)
    identity_loss = output_error(w - fake_quantize(w, spec), gram)
    best = ScaleResult(identity, None, identity_loss, identity_loss)
    if not math.isfinite(identity_loss):
        best.loss = math.inf
    for ratio, s in scale_candidates(x_mean, w_mean, n_grid, duo):
        loss = output_error(w - fake_quantize(w * s, spec) / s, gram)
        if loss < best.loss:  # NaN never compares smaller, so a non-finite candidate loses
            best = ScaleResult(s, ratio, loss, identity_loss)
    return best


def search_clip(
    w: torch.Tensor, stats: InputStats, spec: QuantSpec, n_grid: int = 20, max_shrink: float = 0.5
) -> torch.Tensor:
    """Per (row, group) range shrink minimizing that group's own output error (AWQ's clip)."""
    n, k = w.shape
    gs = spec.group_size
    groups = math.ceil(k / gs)
    pad = groups * gs - k
    gram = torch.nn.functional.pad(stats.gram.double(), (0, pad, 0, pad))
    blocks = torch.stack(
        [gram[g * gs : (g + 1) * gs, g * gs : (g + 1) * gs] for g in range(groups)]
    )
    best_loss = torch.full((n, groups), math.inf, dtype=torch.float64, device=w.device)
    best_ratio = torch.ones(n, groups, dtype=torch.float32, device=w.device)
    for i in range(int(max_shrink * n_grid)):
        ratio = 1 - i / n_grid
        err = torch.nn.functional.pad(w - fake_quantize(w, spec, ratio), (0, pad))
        e = err.double().view(n, groups, gs).transpose(0, 1)  # [G, N, gs]
        loss = ((e @ blocks) * e).sum(-1).T  # [N, G]
        better = loss < best_loss
        best_loss = torch.where(better, loss, best_loss)
        best_ratio[better] = ratio
    return best_ratio


def block_of(linears: tuple[str, ...]) -> str | None:
    """The module a scale group feeds: the lowest common parent of its linears when there are
    several (q/k/v -> self_attn, gate/up -> mlp), None for a single linear, whose own output
    is the block and is scored exactly (over every token) by the Gram form."""
    if len(linears) < 2:
        return None
    parents = [name.rsplit(".", 1)[0] if "." in name else "" for name in linears]
    common = parents[0].split(".")
    for p in parents[1:]:
        parts = p.split(".")
        n = 0
        while n < min(len(common), len(parts)) and common[n] == parts[n]:
            n += 1
        common = common[:n]
    return ".".join(common) or None


def _first(out: object) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out  # type: ignore[return-value]


@dataclass
class BlockProbe:
    """A module's recorded calls (inputs and full-precision outputs) on a subsample of the
    calibration tokens, replayed to score candidates by the error at the module's output.

    The Gram form sees each linear alone; the block output also sees how errors of the
    group's linears combine downstream (through softmax and the value mixing in attention,
    through SiLU(gate) * up in the MLP), which is what the served model computes. Replaying
    one recorded chunk at a time keeps memory at one chunk's activations."""

    module: torch.nn.Module
    calls: list[tuple[tuple, dict, torch.Tensor]] = field(default_factory=list)

    def record(self, args: tuple, kwargs: dict, out: object) -> None:
        self.calls.append((args, kwargs, _first(out).detach().clone()))

    def loss(self) -> float:
        """Squared error of the module's current output against the recorded one, in fp64."""
        total = 0.0
        with torch.inference_mode():
            for args, kwargs, target in self.calls:
                diff = _first(self.module(*args, **kwargs)).double() - target.double()
                total += float(diff.pow(2).sum())
        return total


def _set_weights(linears: list[torch.nn.Linear], w: torch.Tensor) -> None:
    """Split the group's stacked [sum N, K] weight back into its linears."""
    start = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight.data = w[start : start + n]
        start += n


def block_loss(linears: list[torch.nn.Linear], w_q: torch.Tensor, probe: BlockProbe) -> float:
    """The probe's output error with the group's linears set to w_q; weights restored after."""
    saved = [lin.weight.data for lin in linears]
    try:
        _set_weights(linears, w_q)
        return probe.loss()
    finally:
        for lin, w in zip(linears, saved, strict=True):
            lin.weight.data = w


def scale_candidates(
    x_mean: torch.Tensor, w_mean: torch.Tensor, n_grid: int, duo: bool
) -> list[tuple[float, torch.Tensor]]:
    """AWQ's grid: s = x_mean^a / w_mean^(1-a), normalized; non-finite candidates dropped."""
    out = []
    for i in range(n_grid):
        ratio = i / n_grid
        s = x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 0.0001) if duo else x_mean.pow(ratio)
        s = s.clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        if torch.isfinite(s).all():
            out.append((ratio, s))
    return out


def search_scale_block(
    linears: list[torch.nn.Linear],
    stats: InputStats,
    spec: QuantSpec,
    probe: BlockProbe,
    n_grid: int = 20,
    duo: bool = True,
) -> ScaleResult:
    """The same grid as `search_scale`, each candidate scored by the block output error with
    all of the group's linears quantized at once (as AutoAWQ and llm-compressor score it)."""
    w = torch.cat([lin.weight.data for lin in linears])
    x_mean = stats.mean_abs
    w_mean = weight_importance(w, spec.group_size)
    identity_loss = block_loss(linears, fake_quantize(w, spec), probe)
    best = ScaleResult(torch.ones_like(x_mean), None, identity_loss, identity_loss)
    if not math.isfinite(identity_loss):
        best.loss = math.inf
    for ratio, s in scale_candidates(x_mean, w_mean, n_grid, duo):
        loss = block_loss(linears, fake_quantize(w * s, spec) / s, probe)
        if loss < best.loss:  # NaN never compares smaller, so a non-finite candidate loses
            best = ScaleResult(s, ratio, loss, identity_loss)
    return best


def soften_clip(ratio: torch.Tensor, strength: float) -> torch.Tensor:
    """Move a per-(row, group) clip toward no clip: strength 1 keeps it, 0 removes it."""
    return 1 - strength * (1 - ratio)


def choose_clip_block(
    linears: list[torch.nn.Linear],
    clips: list[torch.Tensor | None],
    spec: QuantSpec,
    probe: BlockProbe,
    strengths: tuple[float, ...] = (0.0, 0.5, 1.0),
) -> list[float]:
    """Per linear (in order, the others quantized with their choices so far), the strength
    of its Gram-form clip that gives the lowest block output error. The Gram form chooses
    each (row, group) against that linear's own output; the block sees whether shrinking
    ranges there also helps after the nonlinearity, and can back it off."""
    w = [lin.weight.data for lin in linears]
    chosen = [1.0 if c is not None else 0.0 for c in clips]

    def quantized() -> torch.Tensor:
        parts = []
        for wi, ci, si in zip(w, clips, chosen, strict=True):
            parts.append(fake_quantize(wi, spec, 1.0 if ci is None else soften_clip(ci, si)))
        return torch.cat(parts)

    for i, clip in enumerate(clips):
        if clip is None:
            continue
        losses = {}
        for strength in strengths:
            chosen[i] = strength
            loss = block_loss(linears, quantized(), probe)
            losses[strength] = loss if math.isfinite(loss) else math.inf
        chosen[i] = min(strengths, key=lambda st: (losses[st], -st))  # ties: keep the clip
    return chosen
