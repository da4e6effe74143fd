"""``torchrig env``: the environment report to paste into a bug report.

``torchrig env`` prints readable tables (``rich``); ``torchrig env --json`` prints the same facts
as JSON for machines. Gathering lives in :mod:`torchrig.envinfo`; this module only prints.
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "env",
        help="print the environment (Python, torch build, accelerators, devices, precisions) for bug reports",
        description="Print what torchrig sees on this machine. Paste the output into bug reports.",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    from torchrig.envinfo import gather

    info = gather()
    if not getattr(args, "json", False):
        try:
            render(info)
            return 0
        except ImportError as err:  # rich is a dependency, but a broken install is when this runs
            print(f"(tables need rich, which failed to import: {err}; printing JSON)")
    print(json.dumps(info, indent=2, sort_keys=False, default=str))
    return 0


def _text(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ", ".join(_text(v) for v in value)
    if isinstance(value, dict) and set(value) == {"error"}:
        return f"error: {value['error']}"
    return str(value)


def _gib(n: Any) -> str:
    return f"{n / 2**30:.1f} GiB" if isinstance(n, int) else _text(n)


def render(info: dict[str, Any], console: Any = None) -> None:
    """Print ``info`` (from :func:`torchrig.envinfo.gather`) as rich tables."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    summary = Table(title="torchrig env", show_header=False, title_justify="left")
    summary.add_column("section", style="bold")
    summary.add_column("key")
    summary.add_column("value", overflow="fold")
    for section in ("system", "torch", "torchrig", "precision", "distributed", "cluster"):
        data = info.get(section)
        if not isinstance(data, dict) or set(data) == {"error"}:
            summary.add_row(section, "error", _text(data))
            continue
        for i, (key, value) in enumerate(data.items()):
            if isinstance(value, dict) and key != "error":
                value = ", ".join(f"{k}: {_text(v)}" for k, v in value.items())
            summary.add_row(section if i == 0 else "", key, _text(value))
    console.print(summary)
    console.print(_accelerator_table(info.get("accelerators"), Table))
    packages = info.get("packages")
    if isinstance(packages, dict) and "error" not in packages:
        rows = [f"{name} {version}" for name, version in packages.items() if version]
        missing = [name for name, version in packages.items() if not version]
        console.print(f"[bold]packages:[/bold] {', '.join(rows)}")
        console.print(f"[bold]not installed:[/bold] {', '.join(missing) or '-'}")
    else:
        console.print(f"[bold]packages:[/bold] {_text(packages)}")


def _accelerator_table(accelerators: Any, table_cls: Any) -> Any:
    table = table_cls(title="accelerators", title_justify="left")
    for col in ("name", "available", "devices", "precisions (auto)", "why not / description"):
        table.add_column(col, overflow="fold")
    if not isinstance(accelerators, dict) or set(accelerators) == {"error"}:
        table.add_row("-", "error", "", "", _text(accelerators))
        return table
    for name, acc in accelerators.items():
        if not isinstance(acc, dict) or "error" in acc:
            table.add_row(name, "error", "", "", _text(acc))
        elif not acc["available"]:
            table.add_row(name, "no", "", "", acc.get("reason", ""))
        else:
            precisions = f"{_text(acc.get('supported_precisions'))} ({_text(acc.get('auto_precision'))})"
            about = acc.get("description", "")
            if acc.get("fp8_refused"):  # the one precision a device may lack for a reason of its own
                about += f"\nno fp8-mixed: {_text(acc['fp8_refused'])}"
            table.add_row(name, "yes", _devices_text(acc), precisions, about)
    return table


def _devices_text(acc: dict[str, Any]) -> str:
    lines = [f"{_text(acc.get('device_count'))} device(s)"]
    for dev in acc.get("devices", []):
        parts = [str(dev.get("index")), _text(dev.get("name"))]
        if "total_memory_bytes" in dev:
            parts.append(_gib(dev["total_memory_bytes"]))
        if "capability" in dev:
            parts.append(f"cc {_text(dev['capability'])}")
        lines.append(" ".join(parts))
    for key, label in (("can_allocate", "tensors"), ("bf16_supported", "bf16"), ("fp16_supported", "fp16")):
        if key in acc:
            lines.append(f"{label}: {_text(acc[key])}")
    return "\n".join(lines)
