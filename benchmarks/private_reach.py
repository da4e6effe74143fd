"""How often code reaches into another object's private members, per 1,000 lines.

Counts ``x._name`` attribute accesses where ``x`` is not ``self`` or ``cls`` and ``_name`` is a
single-underscore name (dunder names such as ``__name__`` are public protocol and not counted),
and ``from module import _name`` imports of another module's private name. Lines are the
non-blank lines of the files.

    python benchmarks/private_reach.py                      # src/torchrig/trainer
    python benchmarks/private_reach.py src/torchrig --top 15
"""

from __future__ import annotations

import argparse
import ast
import collections
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def reaches(tree: ast.AST) -> tuple[list[str], list[str]]:
    """The private members reached on other objects, and the private names imported."""
    members, imports = [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            owner = node.value
            if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                members.append(node.attr)
        elif isinstance(node, ast.ImportFrom):
            imports.extend(alias.name for alias in node.names if _private(alias.name))
    return members, imports


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", default=str(ROOT / "src" / "torchrig" / "trainer"))
    parser.add_argument("--top", type=int, default=10, help="the most reached names to list")
    args = parser.parse_args(argv)
    files = sorted(Path(args.path).rglob("*.py")) if Path(args.path).is_dir() else [Path(args.path)]
    lines, counted, names, per_file = 0, 0, collections.Counter[str](), []
    imported: list[str] = []
    for file in files:
        text = file.read_text()
        n = sum(1 for line in text.splitlines() if line.strip())
        members, imports = reaches(ast.parse(text))
        lines, counted = lines + n, counted + len(members)
        names.update(members)
        imported += [f"{file.name}: {name}" for name in imports]
        per_file.append((len(members), n, file))
    print(f"{args.path}: {len(files)} files, {lines} non-blank lines")
    print(f"private reaches: {counted} ({1000 * counted / max(lines, 1):.1f} per 1,000 lines)")
    print(f"private names imported from other modules: {len(imported)}")
    for row in imported:
        print(f"  {row}")
    print("by file:")
    for count, n, file in sorted(per_file, key=lambda row: row[0], reverse=True):
        shown = file.relative_to(ROOT) if file.is_relative_to(ROOT) else file
        print(f"  {count:5d}  {1000 * count / max(n, 1):6.1f}/1k  {shown}")
    print(f"most reached ({args.top}):")
    for name, count in names.most_common(args.top):
        print(f"  {count:5d}  {name}")


if __name__ == "__main__":
    main()
