"""``mm3 config``: each effective setting, its value and its source."""

from __future__ import annotations

import argparse
import json
from typing import Any

from mm3.cli.main import check_configured_backends, table

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    from mm3.runtime.config import default_settings, explain_settings

    settings = default_settings()
    rows = explain_settings(settings)
    if args.json:
        print(json.dumps({"config_file": str(settings.config_file) if settings.config_file else None,
                          "settings": [{"key": k, "value": v, "source": s} for k, v, s in rows]},
                         indent=2, default=str))
        check_configured_backends(settings)
        return 0
    cfg = settings.config_file
    print(f"mm3 settings (config file: {cfg if cfg else 'none found'})")
    print("\n".join(table(["KEY", "VALUE", "SOURCE"],
                           [[k, _show(v), s] for k, v, s in rows])))
    check_configured_backends(settings)
    return 0


def _show(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return ",".join(map(str, value)) or "[]"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)

