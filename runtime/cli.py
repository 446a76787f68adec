"""The `runtime` command. Serving arrives with the engine; today it verifies artifacts, so a
serving host (which has no `lite`) can check what it was given."""

from __future__ import annotations

from pathlib import Path

import click

from runtime.artifact.reader import Artifact, ArtifactError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="liteserve")
def main() -> None:
    """liteserve's serving side."""


@main.command("verify")
@click.argument("artifact", type=click.Path(path_type=Path))
def verify_cmd(artifact: Path) -> None:
    """Check an artifact's manifest, file sizes and every checksum."""
    try:
        art = Artifact(artifact, checksums=True)
    except ArtifactError as e:
        raise click.ClickException(str(e)) from e
    m = art.manifest
    click.echo(
        f"ok: {artifact} ({m.source.id}, {m.quantization.method} int"
        f"{m.quantization.bits}, {len(m.files)} files verified)"
    )
