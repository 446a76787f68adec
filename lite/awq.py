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
    for i in range(n_grid):
        ratio = i / n_grid
        s = x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 0.0001) if duo else x_mean.pow(ratio)
        s = s.clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        if not torch.isfinite(s).all():
            continue
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
