"""`batcher keygen`: a CurveZMQ key pair for a broker, a worker or a client."""

from __future__ import annotations

import click

from batcher.cli.options import LogOptions, local_option, logging_options, setup


@click.command()
@click.argument("directory", type=click.Path(file_okay=False))
@local_option("--name", default="batcher", help="Base name of the two files.")
@local_option("--force", is_flag=True, help="Replace a key pair of that name already in DIRECTORY.")
@logging_options
def keygen(directory: str, name: str, force: bool, logs: LogOptions) -> None:
    """Write a CurveZMQ key pair to DIRECTORY: NAME.key (public, to share) and
    NAME.key_secret (secret, keep private). An existing pair is kept unless --force:
    every peer holding its public key would have to be given the new one."""
    from batcher.transport.security import KeyExistsError, generate_keys

    setup(logs)
    try:
        public, secret = generate_keys(directory, name, force=force)
    except KeyExistsError as exc:
        raise click.ClickException(str(exc)) from None
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--name") from None
    click.echo(f"public key: {public}\nsecret key: {secret}")
