"""The one error of the checkpoint package."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, altered, unsafe, or does not match what it is loaded into."""
