"""A plugin's launch configuration under Triton's CPU interpreter: its own, with small tiles.

Each program is simulated in Python, one after another, so the interpreter
wants few programs and small tiles; nothing else changes. Every switch
(which kernel runs, its numerics, the last-program rules) is the plugin's, so
the interpreter runs the code paths the plugin's GPU runs: the cuda plugin's
persistent decode attention and block-grouped prefill, the rocm plugin's grid
decode attention and token-tile prefill. Eight programs still make more than
one flash-decoding split on small decode grids, so the merges run too;
16-key inner tiles make the tiny test blocks take several.

What the interpreter cannot run it skips by itself, whatever the config
says: programmatic dependent launch (:func:`.tl_utils.pdl_enabled`), the
platform launch options (:func:`.tl_utils.launch_options`) and the direct
launch of compiled kernels (:mod:`.fast_launch` launches an interpreted
kernel through Triton); tests/test_triton_interpreter.py shows each, and that
both plugins' interpreter configs differ from their own in these sizes only.
"""

from __future__ import annotations

from .launch import LaunchConfig, override

__all__ = ["for_interpreter", "INTERPRETER_PROGRAMS", "INTERPRETER_ROWS", "INTERPRETER_KEYS"]

#: programs that "fill" the interpreter
INTERPRETER_PROGRAMS = 8
#: query rows of a prefill tile (indexer, token tiles, block-grouped tiles)
INTERPRETER_ROWS = 32
#: keys of an inner tile (decode indexer, decode attention)
INTERPRETER_KEYS = 16


def for_interpreter(launch: LaunchConfig) -> LaunchConfig:
    """``launch`` with the interpreter's program count and tile sizes; every other field is ``launch``'s."""
    rows = dict(rows=INTERPRETER_ROWS)
    grouped = {} if launch.prefill_attention is None else dict(prefill_attention=rows)
    return override(launch, target_programs=INTERPRETER_PROGRAMS, decode_index=dict(block_n=INTERPRETER_KEYS),
                    decode_attention=dict(block_n=INTERPRETER_KEYS), prefill_index=rows, prefill_tiles=rows,
                    **grouped)
