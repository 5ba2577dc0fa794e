"""`python -m batcher` is the `batcher` command."""

from batcher.cli.commands import main

main()
