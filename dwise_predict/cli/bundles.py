"""Typer commands for bundles: ``export``, ``verify``, ``publish`` and the ``zoo`` group.

Each command validates its options, calls one library function and prints a summary (stdout);
heavy imports stay inside the bodies so ``--help`` is fast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer._click.core import ParameterSource
from typer._click.exceptions import UsageError

from dwise_predict.cli.options import JsonOption, table
from dwise_predict.evaluation.document import fmt

ZooOption = Annotated[Path, typer.Option("--zoo", envvar="DWISE_ZOO", help="Zoo directory (or $DWISE_ZOO).")]
HubOrZooOption = Annotated[Optional[Path], typer.Option("--zoo", envvar="DWISE_ZOO",
                                                        help="Zoo directory (or $DWISE_ZOO); not with the Hub.")]
# probe rows are drawn in memory at 4 bytes x (2 x hidden size + 6) each: 4,096 at a hidden size of
# 8,192 is 270 MB, and `verify` needs a few dozen (two billion asked for 304 GB)
MAX_PROBES = 4096


def export_command(
    run: Annotated[Path, typer.Argument(help="Run directory written by `dwise-predict train`.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Bundle directory to create.")],
    name: Annotated[Optional[str], typer.Option(help="Bundle name (default: the run directory's name).")] = None,
    created: Annotated[
        Optional[str],
        typer.Option(help="ISO time to record as 'created' (default: now); fix it for byte-identical bundles."),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing bundle at --out.")] = False,
    probes: Annotated[int, typer.Option(min=8, max=MAX_PROBES, help="Probe rows stored for `verify`.")] = 64,
    as_json: JsonOption = False,
) -> None:
    """Export a training run as a predictor bundle (contract 2): ONNX, TorchScript, torch.export,
    safetensors, LightGBM, probes, a sealed bundle.json and a model card.

    Examples:

        dwise-predict export runs/tiny --out bundles/tiny

        dwise-predict export runs/llada --out bundles/llada --name llada2-mini --created 2026-01-01T00:00:00Z
    """
    from dwise_predict.exports.bundle import export_bundle
    from dwise_predict.bundles.manifest import read_bundle_manifest

    path = export_bundle(run, out, name=name, created=created, force=force, n_probes=probes)
    manifest = read_bundle_manifest(path)
    if as_json:
        typer.echo(json.dumps({"bundle": str(path), "name": manifest.name, "files": manifest.files}, indent=2))
        return
    summary = table(f"bundle {path}", ("file", "bytes", "sha256"))
    for file, entry in sorted(manifest.files.items()):
        summary.add_row(file, f"{entry['bytes']:,}", entry["sha256"][:16] + "…")
    _print(summary)
    typer.echo(f"next: dwise-predict verify {path}")


def verify_command(
    bundle: Annotated[Path, typer.Argument(help="Bundle directory.")],
    as_json: JsonOption = False,
) -> None:
    """Check every hash of a bundle, then load each artifact in a fresh process (without the
    training stack) and compare TorchScript, torch.export and ONNX with the stored eager outputs
    (what the calibration makes of a raw estimate within 1e-4 of eager, plus 1e-4) and ONNX
    admission with LightGBM. Exit 1 on any failure.

    Examples:

        dwise-predict verify bundles/tiny

        dwise-predict verify bundles/tiny --json | jq '.rows[] | select(.ok | not)'
    """
    from dwise_predict.exports.verify import verify_bundle

    report = verify_bundle(bundle)
    if as_json:
        typer.echo(json.dumps({"bundle": str(bundle), "ok": report.ok, "rows": report.rows}, indent=2))
    else:
        summary = table(f"verify {bundle}", ("artifact", "check", "result", "detail"))
        for row in report.rows:
            summary.add_row(row["artifact"], row["check"], "[green]pass[/]" if row["ok"] else "[red]FAIL[/]", row["detail"])
        _print(summary)
        if report.ok:
            typer.echo("all checks passed")
    if not report.ok:
        from dwise_predict.errors import BundleError

        raise BundleError(f"{bundle} failed {len(report.failures())} check(s): {report.failed_artifacts()}; do not load it")


def publish_command(
    ctx: typer.Context,
    bundle: Annotated[Path, typer.Argument(help="Bundle directory (verified before publishing).")],
    zoo: HubOrZooOption = None,
    hub: Annotated[Optional[str], typer.Option("--hub", help="Hugging Face model repo OWNER/NAME to publish to "
                                               "instead of a zoo (token: `hf auth login` or $HF_TOKEN).")] = None,
    name: Annotated[Optional[str], typer.Option(help="Name in the zoo (default: the bundle's name).")] = None,
    version: Annotated[Optional[str], typer.Option(help="Version (zoo: default next integer; Hub: a tag on the "
                                                   "commit, default none). Never overwritten.")] = None,
    revision: Annotated[Optional[str], typer.Option(help="Hub branch to commit to (default: main).")] = None,
    as_json: JsonOption = False,
) -> None:
    """Verify a bundle and publish it into a zoo directory as a .tar with an index entry, or to a
    Hugging Face Hub repository (--hub: the bundle's files at the root, its model card as the README).

    Examples:

        dwise-predict publish bundles/tiny --zoo /shared/zoo

        dwise-predict publish bundles/llada --zoo /shared/zoo --name llada2-mini --version 2026.01

        dwise-predict publish bundles/tiny --hub my-org/tiny-predictor --version v1
    """
    target = _zoo_or_hub(ctx, zoo, hub, "--hub OWNER/NAME")
    if hub is not None:
        if name is not None:
            raise UsageError("--name is for a zoo: on the Hub the repository names the bundle", ctx)
        from dwise_predict.exports.hub import publish_hub

        done = publish_hub(bundle, hub, revision=revision, version=version)
        typer.echo(json.dumps(done, indent=2) if as_json else
                   f"published {bundle} -> hf://{hub}@{version or done['revision']} (commit {done['commit']})")
        return
    if revision is not None:
        raise UsageError("--revision is for the Hub (--hub): a zoo's versions are --version", ctx)
    from dwise_predict.exports.zoo import publish

    entry = publish(bundle, target, name=name, version=version)
    if as_json:
        typer.echo(json.dumps(entry, indent=2))
        return
    typer.echo(f"published {entry['name']}@{entry['version']} -> {target / entry['file']} "
               f"(sha256 {entry['sha256'][:16]}…)")


def _zoo_or_hub(ctx: typer.Context, zoo: Optional[Path], hub: Optional[str], other: str) -> Optional[Path]:
    """The zoo a command reads or writes, None when it goes to the Hub; both given on the command
    line, or neither, is a usage error ($DWISE_ZOO yields to the Hub)."""
    if hub is not None:
        if zoo is not None and ctx.get_parameter_source("zoo") is ParameterSource.COMMANDLINE:
            raise UsageError(f"give --zoo or {other.split()[0]}, not both", ctx)
        return None
    if zoo is None:
        raise UsageError(f"Missing option '--zoo' (or {other})", ctx)
    return zoo


zoo_app = typer.Typer(help="Browse and pull bundles from a zoo directory.", no_args_is_help=True)


@zoo_app.command("list")
def zoo_list_command(zoo: ZooOption, as_json: JsonOption = False) -> None:
    """List every published bundle.

    Examples:

        dwise-predict zoo list --zoo /shared/zoo
    """
    from dwise_predict.bundles.zoo import list_entries

    entries = list_entries(zoo)
    if as_json:
        typer.echo(json.dumps(entries, indent=2))
        return
    summary = table(f"zoo {zoo}", ("name", "version", "model", "hidden", "ρ admission", "ρ refined", "published"))
    for e in entries:
        metrics = e.get("metrics") or {}
        summary.add_row(
            e["name"], e["version"], _cell((e.get("model") or {}).get("name")), _cell(e.get("hidden_size")),
            _cell(_field(metrics, "admission", "spearman")), _cell(_field(metrics, "refined", "spearman")),
            _cell(e.get("published") or ""),
        )
    _print(summary)


def _field(section: dict, *keys):
    """``section[k1][k2]...``, None where a level is missing or not an object (an index from elsewhere)."""
    for key in keys:
        section = section.get(key) if isinstance(section, dict) else None
    return section


def _cell(value) -> str:
    """A value of a zoo index (which may come from anyone) as a table cell: numbers as `fmt` writes
    them, text with its control characters escaped (a terminal would obey an escape sequence) and
    no Rich markup."""
    from rich.markup import escape

    from dwise_predict.bundles.manifest import printable

    return escape(printable(value, limit=60, quoted=False) if isinstance(value, str) else fmt(value))


@zoo_app.command("show")
def zoo_show_command(
    ref: Annotated[str, typer.Argument(help="NAME or NAME@VERSION (default: latest version).")],
    zoo: ZooOption,
) -> None:
    """Print one index entry as JSON (model fingerprint, metrics, tar sha256).

    Examples:

        dwise-predict zoo show tiny@1 --zoo /shared/zoo
    """
    from dwise_predict.bundles.zoo import find_entry

    typer.echo(json.dumps(find_entry(zoo, ref), indent=2, sort_keys=True))


@zoo_app.command("pull")
def zoo_pull_command(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(help="NAME or NAME@VERSION (default: latest version), or "
                                            "hf://OWNER/NAME[@REVISION] (a Hub branch, tag or commit; default main).")],
    zoo: HubOrZooOption = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="New directory (default: ./NAME-VERSION).")] = None,
) -> None:
    """Fetch a bundle: check the tar's sha256 (or take the Hub's snapshot), extract it safely, screen
    it and check every file's hash. hf:// goes through huggingface_hub's cache (HF_HUB_CACHE;
    HF_HUB_OFFLINE=1 reads only the cache).

    Examples:

        dwise-predict zoo pull tiny --zoo /shared/zoo --out bundles/tiny

        dwise-predict zoo pull tiny@1 --zoo /shared/zoo

        dwise-predict zoo pull hf://my-org/tiny-predictor@v1 --out bundles/tiny
    """
    from dwise_predict.bundles.hub import is_hub_ref, pull_hub

    if is_hub_ref(ref):
        _zoo_or_hub(ctx, zoo, ref, "hf://OWNER/NAME")
        path = pull_hub(ref, out)
    else:
        from dwise_predict.bundles.zoo import pull

        path = pull(_zoo_or_hub(ctx, zoo, None, "an hf://OWNER/NAME reference"), ref, out)
    typer.echo(f"pulled {ref} -> {path}")
    typer.echo(f"next: dwise-predict verify {path}")


def _print(table) -> None:
    from rich.console import Console

    Console(soft_wrap=True).print(table)
