"""The one error of the checkpoint package."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, altered, unsafe, or does not match what it is loaded into."""


class DamagedCheckpointError(CheckpointError):
    """A file ``meta.json`` lists fails its check: missing, of another size, another SHA-256, or
    not a regular file (``torchrig checkpoint`` exits with 1 for it, 2 for any other refusal)."""
