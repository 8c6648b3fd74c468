"""The ``mm3`` command: one module per subcommand, loaded only when that command runs.

* :mod:`.main` - the command table, the parser and :func:`main` (the console script);
* :mod:`.backends` - ``mm3 backends``; :mod:`.config` - ``mm3 config``;
* :mod:`.demo` - ``mm3 demo``; :mod:`.check` - ``mm3 check NAME``; :mod:`.bench` - ``mm3 bench``;
* :mod:`.version` - ``mm3 version`` / ``mm3 --version``.
"""

from mm3.cli.main import (
    COMMANDS, Command, add_command, build_parser, check_configured_backends, default_device, main,
)

__all__ = ["Command", "COMMANDS", "add_command", "main", "build_parser", "default_device",
           "check_configured_backends"]
