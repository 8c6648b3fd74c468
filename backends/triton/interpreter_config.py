"""A plugin's launch configuration under Triton's CPU interpreter: its own, with small tiles.

Each program is simulated in Python, one after another, so the interpreter
wants few programs and small tiles; nothing else changes. Every switch
(which kernel runs, its numerics, the last-program rules) is the plugin's, so
the interpreter runs the code paths the plugin's GPU runs: the cuda plugin's
persistent decode attention and block-grouped prefill, the rocm plugin's grid
decode attention and token-tile prefill. Eight programs still make more than
one flash-decoding split on small decode grids, so the merges run too;
16-key inner tiles make the tiny test blocks take several.

Which sizes shrink is said by each config where it declares the field
(``rows: int = size(interpreter=INTERPRETER_ROWS)``: a field with no default,
whose value under the interpreter is 32), so a new kernel's config states its
interpreter sizes itself; :func:`for_interpreter` applies every one of them.

What the interpreter cannot run it skips by itself, whatever the config
says: programmatic dependent launch (:func:`.tl_utils.pdl_enabled`), the
platform launch options (:func:`.tl_utils.launch_options`) and the direct
launch of compiled kernels (:mod:`.fast_launch` launches an interpreted
kernel through Triton); tests/test_triton_interpreter.py shows each, and that
both plugins' interpreter configs differ from their own in these sizes only.

Example:
    >>> from dataclasses import dataclass
    >>> @dataclass(frozen=True)
    ... class Tiles:
    ...     rows: int = size(interpreter=INTERPRETER_ROWS)
    ...     warps: int
    >>> for_interpreter(Tiles(rows=128, warps=8))
    Tiles(rows=32, warps=8)
"""

from __future__ import annotations

from dataclasses import field, fields, is_dataclass, replace
from typing import Any, TypeVar

__all__ = ["for_interpreter", "size", "INTERPRETER_PROGRAMS", "INTERPRETER_ROWS", "INTERPRETER_KEYS"]

#: programs that "fill" the interpreter
INTERPRETER_PROGRAMS = 8
#: query rows of a prefill tile (indexer, token tiles, block-grouped tiles)
INTERPRETER_ROWS = 32
#: keys of an inner tile (decode indexer, decode attention)
INTERPRETER_KEYS = 16

_KEY = "interpreter"

Config = TypeVar("Config")


def size(*, interpreter: int) -> Any:
    """A config field (``dataclasses.field``, no default) whose value under the interpreter is ``interpreter``."""
    return field(metadata={_KEY: interpreter})


def for_interpreter(config: Config) -> Config:
    """``config`` (a :class:`.launch.LaunchConfig`, or any config dataclass) with every field declared with
    :func:`size` set to its interpreter value, in nested configs too; every other field is ``config``'s."""
    changes: dict[str, Any] = {}
    for f in fields(config):  # type: ignore[arg-type]
        value = getattr(config, f.name)
        if _KEY in f.metadata:
            changes[f.name] = f.metadata[_KEY]
        elif is_dataclass(value) and not isinstance(value, type):
            changes[f.name] = for_interpreter(value)
    return replace(config, **changes)  # type: ignore[type-var]
