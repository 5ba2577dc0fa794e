"""`python -m batcher` is the `batcher` command."""

from batcher.cli import main

main()
