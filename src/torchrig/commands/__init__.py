"""Subcommands of the torchrig console script."""
