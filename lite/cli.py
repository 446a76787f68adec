"""The `lite` command: auto_awq, inspect, ppl. Flag names follow LMDeploy's where they mean
the same thing, so commands from shell history keep working."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import click
from click.core import ParameterSource

from runtime.artifact.reader import ArtifactError

USER_ERRORS = (ValueError, ArtifactError, FileExistsError, PermissionError, FileNotFoundError)


def _fail(e: Exception) -> None:
    raise click.ClickException(str(e)) from e


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="liteserve")
def main() -> None:
    """liteserve's offline side: quantize models into artifacts and measure them."""


@main.command("auto_awq")
@click.argument("model")
@click.option(
    "--work-dir",
    required=True,
    type=click.Path(path_type=Path),
    help="Where the artifact appears (atomically, when finished).",
)
@click.option(
    "--recipe",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="YAML recipe from recipes/; explicit flags override it.",
)
@click.option(
    "--calib-dataset",
    default="pydoc",
    show_default=True,
    help="pydoc (built-in, offline), a .txt/.jsonl/.parquet file, or pileval, "
    "wikitext2, c4, ptb (needs a network).",
)
@click.option(
    "--calib-samples",
    default=128,
    show_default=True,
    type=click.IntRange(min=0),
    help="Blocks of --calib-seqlen tokens; 0 gives round-to-nearest (no AWQ).",
)
@click.option("--calib-seqlen", default=512, show_default=True, type=click.IntRange(min=2))
@click.option("--w-bits", default=4, show_default=True, type=int)
@click.option(
    "--w-group-size",
    default=128,
    show_default=True,
    type=int,
    help="32, 64 or 128 input channels per scale.",
)
@click.option("--w-sym", is_flag=True, help="Symmetric int4 (no zero points).")
@click.option("--seed", default=42, show_default=True, help="Picks the calibration blocks.")
@click.option(
    "--dtype",
    type=click.Choice(["float16", "bfloat16"]),
    default="float16",
    show_default=True,
    help="Storage dtype of the unquantized tensors.",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing artifact at --work-dir.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.pass_context
def auto_awq_cmd(
    ctx: click.Context,
    model: str,
    work_dir: Path,
    recipe: Path | None,
    overwrite: bool,
    quiet: bool,
    **flags,
) -> None:
    """Quantize MODEL (HF directory, hub id, .gguf file, or smollm2-135m-instruct) with AWQ.

    Interrupted runs resume: rerun the same command and calibration continues after the last
    finished layer (state in WORK_DIR.partial/).
    """
    from lite.auto_awq import AwqConfig, auto_awq
    from lite.quantizer import QuantSpec
    from lite.recipe import Recipe, load_recipe

    try:
        rec = load_recipe(recipe) if recipe else Recipe()
        for name, value in rec.flags().items():
            if ctx.get_parameter_source(name) != ParameterSource.COMMANDLINE:
                flags[name] = value
        cfg = AwqConfig(
            spec=QuantSpec(flags["w_bits"], flags["w_group_size"], flags["w_sym"]),
            calib_dataset=flags["calib_dataset"],
            calib_samples=flags["calib_samples"],
            calib_seqlen=flags["calib_seqlen"],
            seed=flags["seed"],
            dtype=flags["dtype"],
            launch=rec.launch,
        )
        command = shlex.join(["lite", *sys.argv[1:]])
        auto_awq(model, work_dir, cfg, command=command, overwrite=overwrite, progress=not quiet)
    except USER_ERRORS as e:
        _fail(e)


@main.command("inspect")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--verify", is_flag=True, help="Check every file's sha256 against the manifest.")
@click.option("--json", "as_json", is_flag=True, help="Print the facts as JSON.")
def inspect_cmd(artifact: Path, verify: bool, as_json: bool) -> None:
    """Describe an artifact; non-zero exit if it is not a valid one."""
    from lite.describe import describe, render

    try:
        facts = describe(artifact, checksums=verify)
    except USER_ERRORS as e:
        _fail(e)
    click.echo(json.dumps(facts, indent=2) if as_json else render(facts))


@main.command("ppl")
@click.option("--model", "model", help="Source model (as for auto_awq) to score as baseline.")
@click.option(
    "--artifact",
    "artifacts",
    multiple=True,
    type=click.Path(path_type=Path),
    help="Artifact to score, dequantized by the reference unpacker; repeatable.",
)
@click.option(
    "--text-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="UTF-8 text to score; default: the held-out part of the pydoc set.",
)
@click.option(
    "--seqlen",
    default=512,
    show_default=True,
    help="Window length: non-overlapping windows, each scored alone, remainder dropped.",
)
@click.option("--limit", type=click.IntRange(min=1), help="Score at most this many windows.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per model.")
def ppl_cmd(
    model: str | None,
    artifacts: tuple[Path, ...],
    text_file: Path | None,
    seqlen: int,
    limit: int | None,
    as_json: bool,
) -> None:
    """Token-level perplexity of a source model and its artifacts on the same tokens.

    Protocol: the text is tokenized once without special tokens and cut into non-overlapping
    windows of --seqlen tokens (default 512); each window is scored on its own and
    ppl = exp(mean next-token NLL). Kept as the quick form of `lite eval --ppl`.
    """
    from lite.perplexity import run_ppl

    if not model and not artifacts:
        raise click.UsageError("give --model, --artifact, or both")
    try:
        results = run_ppl(model, artifacts, text_file, seqlen, limit)
    except USER_ERRORS as e:
        _fail(e)
    if as_json:
        for r in results:
            click.echo(
                json.dumps(
                    {
                        "model": r.name,
                        "ppl": r.ppl,
                        "nll": r.nll,
                        "tokens": r.tokens,
                        "windows": r.windows,
                    }
                )
            )
        return
    base = results[0].ppl if model else None
    click.echo(f"{'model':<48} {'ppl':>10} {'vs source':>10} {'tokens':>8}")
    for r in results:
        delta = f"{100 * (r.ppl / base - 1):+.1f}%" if base else "-"
        click.echo(f"{r.name:<48} {r.ppl:>10.3f} {delta:>10} {r.tokens:>8}")
