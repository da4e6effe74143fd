"""benchmarks/private_reach.py: what counts as reaching into another object's private members."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from private_reach import reaches


def test_only_other_objects_private_members_and_private_imports_count() -> None:
    source = """
from .a import _hidden, public
from .b import __version__
class C:
    def f(self, other):
        self._mine, cls._also_mine = 1, 2
        other._theirs()
        return type(other).__name__, other.public, trainer._state._deep
"""
    members, imports = reaches(ast.parse(source))
    assert sorted(members) == ["_deep", "_state", "_theirs"]
    assert imports == ["_hidden"]
