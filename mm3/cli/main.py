"""The ``mm3`` command.

Subcommands are listed in :data:`COMMANDS` by *import path*, and a command's
module is imported only when that command runs: a missing or broken optional
command (``bench`` without matplotlib, say) never breaks ``mm3 backends``.

A command is any object (usually a module) with two functions::

    def add_arguments(parser: argparse.ArgumentParser) -> None: ...
    def run(args: argparse.Namespace) -> int: ...          # the exit status

Add one with a line in :data:`COMMANDS` (or :func:`add_command` at runtime).

``python -m mm3 ARGS`` runs the same command (``mm3/__main__.py``).

Example:
    $ mm3 backends --device cpu
    $ mm3 config
    $ mm3 demo

Errors that mm3 raises on purpose (:class:`~mm3.contract.errors.MM3Error`) print one
line, ``mm3: error: ...``, and exit with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from mm3.contract.errors import MM3Error

__all__ = ["Command", "COMMANDS", "add_command", "main", "build_parser", "default_device",
           "check_configured_backends", "one_line", "table", "UsageError"]


@dataclass(frozen=True)
class Command:
    """One subcommand: its name, one-line help and where its code lives.

    ``target`` is ``"package.module"`` or ``"package.module:attribute"``; the
    object found there has ``add_arguments(parser)`` and ``run(args) -> int``.
    """

    name: str
    help: str
    target: str

    def load(self) -> Any:
        module_name, _, attr = self.target.partition(":")
        obj: Any = importlib.import_module(module_name)
        if attr:
            obj = getattr(obj, attr)
        for fn in ("add_arguments", "run"):
            if not callable(getattr(obj, fn, None)):
                raise AttributeError(f"{self.target} has no {fn}() function")
        return obj


COMMANDS: dict[str, Command] = {}


def add_command(name: str, help: str, target: str) -> None:
    """Register (or replace) subcommand ``name`` implemented at ``target``."""
    COMMANDS[name] = Command(name, help, target)


add_command("backends", "list backends: source, availability, layouts, ops, auto choice, problems",
            "mm3.cli.backends")
add_command("config", "show each effective setting, its value and where it came from",
            "mm3.cli.config")
add_command("demo", "run a realistic paged mixed batch through the selected backend and check it",
            "mm3.cli.demo")
add_command("check", "run the conformance suite against a backend (mm3 check NAME)", "mm3.cli.check")
add_command("bench", "benchmark the backends on a GPU (writes JSON and a plot)", "mm3.cli.bench")
add_command("version", "mm3, Python, torch, Triton, the device and every backend plugin with its version "
            "(for bug reports)", "mm3.cli.version")


def default_device() -> str:
    """The current accelerator's device type if torch sees one, else ``"cpu"``."""
    import torch

    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return acc.type if acc is not None else "cpu"


def one_line(msg: str) -> str:
    return " ".join(part.strip() for part in str(msg).splitlines() if part.strip())


def table(header: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    out = []
    for r in [header, *rows]:
        cells = [str(c).ljust(w) for c, w in zip(r, widths)]
        out.append((indent + "  ".join(cells)).rstrip())
    return out


def check_configured_backends(settings: Any = None, registry: Any = None) -> None:
    """Raise :class:`~mm3.contract.errors.UnknownBackendError` if a configured backend name is not installed.

    ``backend`` (unless ``"auto"``) and ``indexer_backend`` are looked up in the
    registry; the message says where the name came from (argument, ``MM3_*``
    variable or config file) and carries the registry's did-you-mean hint.
    """
    from mm3.runtime.config import default_settings, explain_settings
    from mm3.contract.errors import UnknownBackendError
    from mm3.runtime.registry import default_registry

    settings = settings if settings is not None else default_settings()
    registry = registry if registry is not None else default_registry()
    sources = {key: source for key, _, source in explain_settings(settings)}
    for key in ("backend", "indexer_backend"):
        name = getattr(settings, key)
        if name is None or name == "auto":
            continue
        try:
            registry.get(name)
        except UnknownBackendError as e:
            raise UnknownBackendError(f"{key} = {name!r} (from {sources[key]}): {e}") from None


# -- main --------------------------------------------------------------------------------------------

class UsageError(MM3Error):
    """A command-line mistake detected after argparse (exit 2 like argparse's own)."""


class _VersionAction(argparse.Action):
    """``mm3 --version``: the same report as ``mm3 version``, then exit."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 default: Any = argparse.SUPPRESS, help: Optional[str] = None) -> None:
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: Optional[str] = None) -> None:
        from mm3.cli.version import report
        from mm3.runtime.discovery import PluginLoadWarning

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PluginLoadWarning)   # the report lists excluded plugins
            print(report())
        parser.exit()


class _DefaultsFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to an option's help unless the help already names its default,
    or the default is None/False (a flag or an option that is off unless given)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text or default is None or default is False or default == argparse.SUPPRESS
                or not action.option_strings):
            return text
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        shown = "none" if shown == "" else shown
        return f"{text} (default: {shown})".strip()


def build_parser(selected: Optional[str] = None) -> argparse.ArgumentParser:
    """The argument parser; only ``selected``'s module is imported to add its arguments."""
    parser = argparse.ArgumentParser(prog="mm3", description="MiniMax-M3 block-sparse attention "
                                     "on pluggable backends.")
    parser.add_argument("--version", action=_VersionAction,
                        help="print mm3, Python, torch, Triton, the device and the backend plugins, then exit")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO (selection choices)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for cmd in COMMANDS.values():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help, formatter_class=_DefaultsFormatter)
        if cmd.name == selected:
            cmd.load().add_arguments(p)
    return parser


def _selected(argv: Sequence[str]) -> Optional[str]:
    for token in argv:
        if token in COMMANDS:
            return token
        if not token.startswith("-"):
            return None  # an unknown command: argparse reports it
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``mm3`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    name = _selected(argv)
    try:
        try:
            parser = build_parser(name)
        except (ImportError, AttributeError) as e:
            print(f"mm3: error: command {name!r} is not available: {one_line(str(e))} "
                  f"(from {COMMANDS[name].target}; run `mm3 --help` for the others)", file=sys.stderr)
            return 2
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help/--version (0) or a usage error (2)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    if args.command is None:
        parser.print_help()
        return 2
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    command = COMMANDS[args.command].load()
    try:
        with warnings.catch_warnings():
            # Excluded plugins are listed by `mm3 backends`; raw warnings would only repeat them.
            from mm3.runtime.discovery import PluginLoadWarning

            warnings.simplefilter("ignore", PluginLoadWarning)
            return int(command.run(args) or 0)
    except MM3Error as e:
        print(f"mm3: error: {one_line(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `mm3 check x | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


