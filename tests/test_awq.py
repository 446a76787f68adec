"""AWQ searches: they beat round-to-nearest where activations have outliers, and fail safe."""

import copy
import math

import pytest
import torch

from lite.auto_awq import (
    AwqConfig,
    AwqFallbackWarning,
    calibrate_layer,
    capture,
    pack_layer,
    record_probes,
    run_layer,
)
from lite.awq import (
    BlockProbe,
    InputStats,
    block_loss,
    block_of,
    choose_clip_block,
    output_error,
    search_clip,
    search_scale,
    search_scale_block,
    soften_clip,
)
from lite.families import LAYER_GROUPS
from lite.quantizer import QuantSpec, fake_quantize
from runtime.artifact.layout import dequantize


def _layer(seed: int = 0, kv_heads: int = 2, family: str = "llama"):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        family,
        hidden_size=192,
        intermediate_size=320,
        num_attention_heads=6,
        num_key_value_heads=kv_heads,
        head_dim=32,
        num_hidden_layers=1,
        vocab_size=64,
    )
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config).float().eval()
    layer = model.model.layers[0]
    for name, p in layer.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.05)
        elif "norm" in name:
            p.data = 1 + 0.1 * torch.randn_like(p)
        else:  # Qwen2's q/k/v biases, zero as transformers initializes them
            p.data = 0.5 * torch.randn_like(p)
    x = torch.randn(8, 64, 192)
    x[..., [3, 50, 121, 190]] *= 25.0  # outlier channels, as real LLM activations have
    pos = model.model.rotary_emb(x, torch.arange(64)[None])
    return layer, x, pos


def _served(layer, clip: dict) -> torch.nn.Module:
    """The layer as the artifact will serve it: weights unpacked from what pack_layer wrote."""
    tensors = pack_layer(layer, AwqConfig(spec=QuantSpec(group_size=64)), "", clip)
    served = copy.deepcopy(layer)
    for name, lin in served.named_modules():
        if isinstance(lin, torch.nn.Linear):
            n, k = lin.weight.shape
            lin.weight.data = dequantize(
                tensors[f"{name}.qweight"], tensors[f"{name}.qparams"], n, k, 64
            )
        elif name.endswith("norm"):
            lin.weight.data = tensors[f"{name}.weight"].float()
    return served


def _output_error(layer, quantized, x, pos) -> float:
    return float((run_layer(layer, x, pos) - run_layer(quantized, x, pos)).pow(2).mean())


def test_awq_beats_rtn_on_outlier_channels() -> None:
    layer, x, pos = _layer()
    cfg = AwqConfig(spec=QuantSpec(group_size=64))
    rtn = _served(layer, {})
    awq = copy.deepcopy(layer)
    result = calibrate_layer(awq, LAYER_GROUPS["llama"], x, pos, cfg, "l")
    assert result.fallbacks == []
    assert torch.allclose(result.outputs, run_layer(layer, x, pos))  # fp outputs go on
    assert set(result.clip) == {
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    }  # never q or k
    awq = _served(awq, result.clip)
    e_rtn, e_awq = _output_error(layer, rtn, x, pos), _output_error(layer, awq, x, pos)
    assert e_awq < 0.8 * e_rtn, (e_awq, e_rtn)


def test_gram_error_equals_direct_output_error() -> None:
    torch.manual_seed(3)
    w, x = torch.randn(40, 70), torch.randn(500, 70)
    stats = InputStats(70)
    stats.add(x[:200])
    stats.add(x[200:])
    w_hat = fake_quantize(w, QuantSpec(group_size=32))
    direct = float(((w - w_hat) @ x.T).double().pow(2).sum())
    assert output_error(w - w_hat, stats.gram) == pytest.approx(direct, rel=1e-4)
    assert torch.allclose(stats.mean_abs, x.abs().mean(0), atol=1e-5)


def test_scale_search_never_worse_than_identity() -> None:
    torch.manual_seed(4)
    w, x = torch.randn(64, 96), torch.randn(300, 96)
    x[:, :3] *= 30
    stats = InputStats(96)
    stats.add(x)
    spec = QuantSpec(group_size=32)
    result = search_scale(w, stats, spec)
    assert result.loss <= result.identity_loss
    assert result.ratio is not None  # with outliers some alpha must beat plain RTN
    rescaled = output_error(w - fake_quantize(w * result.scales, spec) / result.scales, stats.gram)
    assert rescaled == pytest.approx(result.loss, rel=1e-9)


def test_clip_search_lowers_each_groups_error() -> None:
    torch.manual_seed(5)
    w, x = torch.randn(32, 64), torch.randn(400, 64)
    w[:, 7] *= 8  # a weight outlier: clipping it pays off for some rows
    stats = InputStats(64)
    stats.add(x)
    spec = QuantSpec(group_size=32)
    ratio = search_clip(w, stats, spec)
    assert ratio.shape == (32, 2)
    assert (ratio <= 1).all() and (ratio >= 0.55 - 1e-6).all()
    assert (ratio < 1).any()
    clipped = output_error(w - fake_quantize(w, spec, ratio), stats.gram)
    plain = output_error(w - fake_quantize(w, spec), stats.gram)
    assert clipped < plain


def test_non_finite_inputs_fall_back_with_named_warning() -> None:
    layer, x, pos = _layer(seed=1)
    x[0, 0, 0] = math.inf
    before = layer.input_layernorm.weight.clone()
    cfg = AwqConfig(spec=QuantSpec(group_size=64))
    with pytest.warns(AwqFallbackWarning, match=r"model\.layers\.7 input_layernorm"):
        result = calibrate_layer(layer, LAYER_GROUPS["llama"], x, pos, cfg, "model.layers.7")
    assert any("input_layernorm" in n for n in result.fallbacks)
    assert torch.equal(layer.input_layernorm.weight, before)  # identity: nothing folded


@pytest.mark.parametrize("kv_heads,family", [(2, "llama"), (6, "llama"), (6, "qwen2")])
def test_scale_folding_preserves_the_fp_function(kv_heads: int, family: str) -> None:
    """Scales move between ops but the unquantized layer computes the same thing; v -> o is
    scaled only without grouped-query attention (and then divides Qwen2's v bias too)."""
    layer, x, pos = _layer(seed=2, kv_heads=kv_heads, family=family)
    before = run_layer(layer, x, pos)
    v_before = layer.self_attn.v_proj.weight.clone()
    cfg = AwqConfig(spec=QuantSpec(group_size=64))
    calibrate_layer(layer, LAYER_GROUPS["llama"], x, pos, cfg, "l")
    after = run_layer(layer, x, pos)
    assert torch.allclose(after, before, rtol=1e-4, atol=1e-4 * before.abs().max())
    ratio = layer.self_attn.v_proj.weight / v_before
    same_per_column = torch.allclose(ratio, ratio[:1].expand_as(ratio), rtol=1e-4)
    # The input-norm scale multiplies v's columns; with 6 kv heads (no GQA) v's 192 outputs
    # line up with o's inputs and v's rows are divided by a second scale too.
    assert not torch.allclose(ratio, torch.ones_like(ratio))
    assert same_per_column == (kv_heads == 2)


def test_chunked_statistics_equal_one_pass() -> None:
    """--calib-batch-size 1: the statistics of one pass over all samples up to float summation
    order, the same outputs, and the same search choices."""
    layer, x, pos = _layer(seed=6)
    groups = LAYER_GROUPS["llama"]
    whole, out_whole = capture(layer, groups, x, pos)  # 8 samples in one chunk
    chunked, out_chunked = capture(layer, groups, x, pos, rows=1)
    for g in groups:
        a, b = whole[g], chunked[g]
        assert a.count == b.count == 8 * 64
        assert torch.allclose(b.gram, a.gram, rtol=1e-5, atol=1e-6 * float(a.gram.abs().max()))
        assert torch.allclose(b.abs_sum, a.abs_sum, rtol=1e-12)
    assert torch.allclose(out_chunked, out_whole, rtol=1e-5, atol=1e-6)

    cfg = AwqConfig(spec=QuantSpec(group_size=64))
    one = calibrate_layer(copy.deepcopy(layer), groups, x, pos, cfg, "l")
    many = calibrate_layer(copy.deepcopy(layer), groups, x, pos, cfg, "l", rows=3)
    assert one.ratios == many.ratios and len(one.ratios) == 3  # v -> o skipped under GQA
    for name, ratio in one.clip.items():
        assert torch.equal(many.clip[name], ratio), name


def test_block_of_names_the_module_a_group_feeds() -> None:
    assert block_of(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")) == "self_attn"
    assert block_of(("mlp.gate_proj", "mlp.up_proj")) == "mlp"
    assert block_of(("mlp.down_proj",)) is None  # its own output is the block: Gram form
    assert block_of(("a.b.x", "a.c.y")) == "a"
    assert block_of(("x", "y")) is None


def _probe(layer, x, pos, block: str, rows: int | None = None) -> BlockProbe:
    return record_probes(layer, {block}, x, pos, len(x), rows)[block]


@pytest.mark.parametrize("block", ["self_attn", "mlp"])
def test_block_probe_replays_the_fp_block_and_chunking_only_reorders_sums(block: str) -> None:
    """Unchanged weights replay to zero error; a perturbed weight gives the same loss whether
    recorded in one chunk or one sequence per chunk (fp64 sums, fp32 forwards: rtol 1e-4)."""
    layer, x, pos = _layer(seed=3)
    whole, chunked = _probe(layer, x, pos, block), _probe(layer, x, pos, block, rows=1)
    assert len(whole.calls) == 1 and len(chunked.calls) == len(x)
    assert whole.loss() == 0.0
    lin = [m for m in layer.get_submodule(block).modules() if isinstance(m, torch.nn.Linear)][0]
    w_q = fake_quantize(lin.weight.data, QuantSpec(group_size=64))
    a, b = block_loss([lin], w_q, whole), block_loss([lin], w_q, chunked)
    assert a > 0 and math.isclose(a, b, rel_tol=1e-4)
    assert not torch.equal(lin.weight.data, w_q)  # the original weight is back


@pytest.mark.parametrize("seed", [0, 4])
def test_block_search_beats_gram_choice_on_the_block_output(seed: int) -> None:
    """Both searches try the same grid, so the block search's pick is never worse on the
    block output than the Gram-form pick, nor than the identity (round-to-nearest)."""
    layer, x, pos = _layer(seed=seed)
    spec = QuantSpec(group_size=64)
    for group in (LAYER_GROUPS["llama"][0], LAYER_GROUPS["llama"][2]):
        stats, _ = capture(layer, (group,), x, pos)
        probe = _probe(layer, x, pos, block_of(group.linears))
        linears = [layer.get_submodule(n) for n in group.linears]
        w = torch.cat([lin.weight.data for lin in linears])
        gram = search_scale(w, stats[group], spec)
        block = search_scale_block(linears, stats[group], spec, probe)
        gram_on_block = block_loss(
            linears, fake_quantize(w * gram.scales, spec) / gram.scales, probe
        )
        assert block.loss <= gram_on_block * (1 + 1e-12)
        assert block.loss <= block.identity_loss
        assert block.ratio is not None  # outlier channels: some scale beats identity
        assert torch.equal(torch.cat([lin.weight.data for lin in linears]), w)  # restored


def test_block_clip_strength_never_worse_than_full_or_no_clip() -> None:
    """Each linear's chosen strength is the best of those tried on the block output."""
    layer, x, pos = _layer(seed=5)
    spec = QuantSpec(group_size=64)
    group = LAYER_GROUPS["llama"][2]  # gate/up -> mlp
    stats, _ = capture(layer, (group,), x, pos)
    probe = _probe(layer, x, pos, "mlp")
    linears = [layer.get_submodule(n) for n in group.linears]
    clips = [search_clip(lin.weight.data, stats[group], spec) for lin in linears]
    chosen = choose_clip_block(linears, clips, spec, probe)

    def loss(strengths: list[float]) -> float:
        parts = [
            fake_quantize(lin.weight.data, spec, soften_clip(c, s))
            for lin, c, s in zip(linears, clips, strengths, strict=True)
        ]
        return block_loss(linears, torch.cat(parts), probe)

    best = loss(chosen)
    assert best <= loss([1.0, 1.0]) * (1 + 1e-12)
    assert best <= loss([0.0, 0.0]) * (1 + 1e-12)
    assert all(s in (0.0, 0.5, 1.0) for s in chosen)


def test_block_objective_config_switches_the_search() -> None:
    """The default (block_objective=()) is the Gram form everywhere and picks what
    search_scale picks; the block search may pick otherwise but keeps the fp function."""
    layer, x, pos = _layer(seed=0)
    groups = LAYER_GROUPS["llama"]
    spec = QuantSpec(group_size=64)
    gram = calibrate_layer(copy.deepcopy(layer), groups, x, pos, AwqConfig(spec=spec), "l")
    stats, _ = capture(layer, groups, x, pos)
    w = torch.cat([layer.get_submodule(n).weight.data for n in groups[0].linears])
    assert gram.ratios[groups[0].label] == search_scale(w, stats[groups[0]], spec).ratio
    blocked = copy.deepcopy(layer)
    before = run_layer(blocked, x, pos)
    block_cfg = AwqConfig(spec=spec, block_objective=("self_attn",), block_clip=("mlp",))
    calibrate_layer(blocked, groups, x, pos, block_cfg, "l")
    after = run_layer(blocked, x, pos)
    assert torch.allclose(after, before, rtol=1e-4, atol=1e-4 * before.abs().max())
