"""A worker process's exit codes (sysexits.h), the contract between a worker and the
`serve` that supervises it: the supervisor reads why a worker ended without importing
the worker's module."""

from __future__ import annotations

#: A worker given an address it cannot connect to (EX_USAGE): respawning cannot help.
EXIT_BAD_ADDRESS = 64
#: A worker the broker told to exit, its batch past its time limit (EX_TEMPFAIL): serve respawns it.
EXIT_HUNG = 75
#: A worker whose model cannot be imported or built (EX_CONFIG).
EXIT_MODEL_LOAD_FAILED = 78
