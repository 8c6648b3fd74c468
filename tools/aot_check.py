"""Compile every kernel for NVIDIA (sm_90) and AMD (gfx942) ahead of time, with no GPU.

The interpreter proves the kernels' arithmetic on the CPU, but not that they
*compile* for a GPU (tile minimums of ``tl.dot``, layouts, register limits).
This tool runs the real launchers of ``mm3_backends.triton`` (the indexer, the
attention, the block-grouped prefill and its plan) on CPU tensors at
MiniMax-M3 shapes with each plugin's launch configuration, records every
launch instead of running it, and compiles each recorded launch with Triton's
own compiler for both targets. For NVIDIA it also reports registers and stack
(spill) bytes from the cubin. It is a developer's tool, not part of the
installed packages (tests/test_triton_compile.py runs it).

Run from the repository (Triton's interpreter must be off: it replaces the kernels)::

    python tools/aot_check.py

Exit status 0 when everything compiled.
"""

from __future__ import annotations

import inspect

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

__all__ = ["Launch", "record_launches", "compile_launch", "main"]

_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
          torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5", torch.uint8: "u8"}


@dataclass
class Launch:
    """One recorded kernel launch: the JIT function, its arguments, constexprs and launch options."""

    label: str
    kernel: Any
    args: tuple
    kwargs: dict
    options: dict = field(default_factory=dict)

    def signature(self) -> tuple[dict[str, str], dict[str, Any], dict[tuple[int], list]]:
        """(signature, constexprs, attrs) as the JIT would specialize this call.

        Like the JIT: an int argument equal to 1 becomes a constant, and ints
        divisible by 16 and (aligned) pointers carry ``tt.divisibility = 16``;
        without these the compiler cannot vectorize and the resource numbers
        would be meaningless. A ``do_not_specialize`` int
        (``mm3_backends.triton.tl_utils.step_kernel``) is neither.
        """
        names = list(self.kernel.arg_names)
        values = dict(zip(names, self.args))
        values.update({k: v for k, v in self.kwargs.items() if k in names})
        for p in getattr(self.kernel, "params", ()):   # parameters left to their defaults
            if p.name not in values and getattr(p, "default", inspect.Parameter.empty) is not inspect.Parameter.empty:
                values[p.name] = p.default
        sig: dict[str, str] = {}
        constexprs: dict[str, Any] = {}
        attrs: dict[tuple[int], list] = {}
        aligned = [["tt.divisibility", 16]]
        free = {p.num for p in getattr(self.kernel, "params", ()) if getattr(p, "do_not_specialize", False)}
        for i, name in enumerate(names):
            v = values[name]
            if i in self.kernel.constexprs:
                sig[name], constexprs[name] = "constexpr", v
            elif isinstance(v, torch.Tensor):
                sig[name] = "*" + _TYPES[v.dtype]
                attrs[(i,)] = aligned
            elif isinstance(v, bool):
                sig[name] = "i1"
            elif isinstance(v, int) and i in free:
                sig[name] = "i32" if -2**31 <= v < 2**31 else "i64"
            elif isinstance(v, int) and v == 1:
                sig[name], constexprs[name] = "constexpr", 1
            elif isinstance(v, int):
                sig[name] = "i32" if -2**31 <= v < 2**31 else "i64"
                if v % 16 == 0:
                    attrs[(i,)] = aligned
            else:
                sig[name] = "fp32"
        return sig, constexprs, attrs


def record_launches(plugin_spec: Any, label: str) -> list[Launch]:
    """Every launch the plugin's hooks make on a mixed M3 step per shape variant (nothing runs: the
    launch layer records them, ``fast_launch.recording``)."""
    from mm3.contract import BatchMetadata, SparseAttentionParams, TopkBuffer
    from mm3.contract.slots import TokenSlots
    from mm3.testing.factories import as_token_slots, make_case
    from mm3_backends.triton import attention, contents, index_scores, indexer
    from mm3_backends.triton.addressing import block_columns
    from mm3_backends.triton.fast_launch import recording
    from mm3_backends.triton.launch import override

    with recording() as launches:
        # PDL off, as the compile check always ran: its launches are proven on the GPU (tests/gpu)
        cfg = override(plugin_spec.launch.for_device_sms(132), algorithms=dict(pdl=False))
        # (tp, dtype, index dtype, decode query len, decodes, prefills[, K/V dtype, K/V scale, query dtype,
        # page layout, addressing]); fp32 (tests only) is left out:
        # its ieee dots take ten times longer to compile
        m3 = SparseAttentionParams.minimax_m3
        # the smallest shapes the fuzzer draws: top-1 (a one-wide sort), 16-token blocks,
        # 16-wide heads, a one-block context; these once compiled under the interpreter only
        tiny = SparseAttentionParams(num_heads=1, num_kv_heads=1, head_dim=16, num_index_heads=1,
                                     index_head_dim=16, block_size=16, topk=1, local_blocks=0)
        variants = [
            (m3(tp_size=1), torch.bfloat16, torch.bfloat16, 1, [300] * 64, [(5, 260)]),
            (m3(tp_size=8), torch.float16, torch.float8_e4m3fn, 4, [300] * 8, [(5, 260)]),
            # fp8 K/V with bf16 queries: the fp16 dots with scaled query rows (numerics.kv_fp8_as_f16)
            (m3(tp_size=1), torch.bfloat16, torch.float8_e4m3fn, 1, [300] * 64, [(5, 260)], "float8_e4m3fn"),
            # fp8 K/V scaled per (KV head, token slot): each key's own factors in the attention kernels
            (m3(tp_size=8), torch.bfloat16, torch.bfloat16, 2, [300] * 64, [(5, 260)], "float8_e4m3fn", "slot"),
            # e5m2 K/V: the same kernels, widening e5m2 (to fp16 in decode, to bf16 in prefill)
            (m3(tp_size=1), torch.bfloat16, torch.bfloat16, 1, [300] * 64, [(5, 260)], "float8_e5m2"),
            (tiny, torch.bfloat16, torch.bfloat16, 1, [1], [(1, 1)]),
            (tiny, torch.bfloat16, torch.bfloat16, 1, [1], [(1, 1)], "float8_e4m3fn"),
            # the authors' q8kv8: fp8 queries (fp16 dots of widened e4m3) on unscaled e4m3 K/V, and on bf16 K/V
            (m3(tp_size=8), torch.bfloat16, torch.float8_e4m3fn, 2, [300] * 64, [(5, 260)], "float8_e4m3fn_unscaled",
             "head", torch.float8_e4m3fn),
            (m3(tp_size=1), torch.bfloat16, torch.bfloat16, 1, [300] * 64, [(5, 260)], None, "head",
             torch.float8_e4m3fn),
            # the authors' q8kv4: fp8 queries on NVFP4 K/V and index keys (unpacked on chip); bf16 queries on
            # NVFP4 K/V in HND pages at TP1 (eight KV heads: the block-grouped prefill compiles in-page strides in)
            (m3(tp_size=8), torch.bfloat16, "nvfp4", 2, [300] * 64, [(5, 260)], "nvfp4", "head", torch.float8_e4m3fn),
            (m3(tp_size=8), torch.bfloat16, "nvfp4", 1, [300] * 64, [(5, 260)], "nvfp4", "head", torch.float8_e4m3fn),
            (m3(tp_size=1), torch.bfloat16, torch.bfloat16, 1, [300] * 64, [(5, 260)], "nvfp4", "head", None, "HND"),
            # head dim 16: one scale per row
            (tiny, torch.bfloat16, "nvfp4", 1, [1], [(1, 1)], "nvfp4"),
            # token slots (SGLang's page_size=1): every kernel gathers its keys through the slot table, in 16-bit,
            # fp8 scaled per slot with e4m3 index keys, and the authors' q8kv4 with NVFP4 index keys
            (m3(tp_size=1), torch.bfloat16, torch.bfloat16, 1, [300] * 64, [(5, 260)], None, "head", None, "NHD",
             "slots"),
            (m3(tp_size=8), torch.bfloat16, torch.float8_e4m3fn, 2, [300] * 64, [(5, 260)], "float8_e4m3fn", "slot",
             None, "NHD", "slots"),
            (m3(tp_size=8), torch.bfloat16, "nvfp4", 2, [300] * 64, [(5, 260)], "nvfp4", "head", torch.float8_e4m3fn,
             "NHD", "slots"),
            (tiny, torch.bfloat16, torch.bfloat16, 1, [1], [(1, 1)], None, "head", None, "NHD", "slots"),
        ]
        for p, dtype, idt, dq, decodes, prefills, *kv in variants:
            case = make_case(p, decodes=decodes, prefills=prefills, decode_query_len=dq,
                             dtype=dtype, index_dtype=idt, seed=0, kv_dtype=kv[0] if kv else None,
                             kv_scale=kv[1] if len(kv) > 1 else "head", q_dtype=kv[2] if len(kv) > 2 else None,
                             kv_layout=kv[3] if len(kv) > 3 else "NHD")
            if len(kv) > 4 and kv[4] == "slots":
                case = as_token_slots(case, torch.Generator().manual_seed(0))
            T = case.batch.num_tokens
            b = case.batch      # the contents check of a batch with its own context lengths, and of one without
            derived = BatchMetadata.from_device(b.query_start_loc, b.seq_lens, b.block_table, num_decodes=b.num_decodes,
                                                num_tokens=T, max_query_len=max(dq, 5), block_size=p.block_size,
                                                decode_query_len=dq, slots=b.slots)
            for batch in (b, derived):
                contents.check_contents(batch, case.caches.num_pages, torch.zeros(1, dtype=torch.int64), cfg)
            topk = TopkBuffer.allocate(T, p.num_kv_heads, p.topk, plugin_spec.topk_layout)
            indexer.index_topk(case.index_q, case.caches, case.batch, p, topk, cfg)
            # a step of decodes alone, judged in its score launch (the layer hands the word: judges_contents)
            nd = b.num_decodes
            decodes = BatchMetadata.from_device(b.query_start_loc[:nd + 1], b.seq_lens[:nd], b.block_table[:nd],
                                                num_decodes=nd, num_tokens=b.num_decode_tokens, max_query_len=dq,
                                                block_size=p.block_size, decode_query_len=dq,
                                                slots=None if b.slots is None else
                                                TokenSlots.of(b.slots.table, b.slots.rows[:nd]))
            indexer.index_topk(case.index_q, case.caches, decodes, p, topk.rows(0, decodes.num_tokens), cfg,
                               torch.zeros(1, dtype=torch.int64), judge=True)
            attention.attention_forward(case.q, case.caches, topk, case.batch, p,
                                        torch.empty_like(case.q, dtype=case.out_dtype), cfg)
            # the block scores, as vLLM's drop-in asks for them: a row of 16-aligned columns
            width = -(-block_columns(case.batch) // 16) * 16
            scores = torch.empty(p.num_index_heads, T, width, dtype=torch.float32)
            index_scores.index_scores(case.index_q, case.caches, case.batch, p, scores, cfg)
    return [Launch(f"{label}:{x.name}", x.kernel, x.args, {**x.constexprs, **x.options}, x.options) for x in launches]


def _nvidia_usage(kernel: Any) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    line = next((ln for ln in out.splitlines() if "REG:" in ln), "")
    return " ".join(line.split()[:2])


def compile_launch(launch: Launch, target: str) -> tuple[Optional[str], str]:
    """Compile ``launch`` for ``target`` ('nvidia' or 'amd'); returns (error or None, resource note)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    gpu = GPUTarget("cuda", 90, 32) if target == "nvidia" else GPUTarget("hip", "gfx942", 64)
    options = dict(launch.options)
    if target == "nvidia":
        options = {k: v for k, v in options.items() if k in ("num_warps", "num_stages")}
    sig, constexprs, attrs = launch.signature()
    try:
        k = triton.compile(ASTSource(launch.kernel, sig, constexprs=constexprs, attrs=attrs), target=gpu,
                           options=options)
    except Exception as e:  # any compiler failure is the finding
        return f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}", ""
    note = _nvidia_usage(k) if target == "nvidia" else ""
    return None, f"{note} smem {k.metadata.shared}".strip()


def main(argv: Optional[list[str]] = None) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("aot_check: unset TRITON_INTERPRET (the interpreter replaces the kernels)", file=sys.stderr)
        return 2
    from mm3_backends.cuda.plugin import PLATFORM as CUDA
    from mm3_backends.rocm.plugin import PLATFORM as ROCM

    failures = 0
    seen: set[str] = set()
    for spec, target in ((CUDA, "nvidia"), (ROCM, "amd"), (ROCM, "nvidia")):
        for launch in record_launches(spec, spec.name):
            sig, constexprs, _ = launch.signature()
            key = f"{target}:{launch.kernel.__name__}:{sorted(sig.items())}:{constexprs}:{launch.options}"
            if key in seen:
                continue
            seen.add(key)
            t0 = time.perf_counter()
            err, note = compile_launch(launch, target)
            failures += err is not None
            shown = {k: v for k, v in constexprs.items() if k.isupper() and k != "DOT_PREC"}
            print(f"{'FAIL' if err else 'ok  '} {target:6} {launch.label:32} {time.perf_counter() - t0:5.1f}s "
                  f"{note:30} {shown} {launch.options}" + (f"\n     {err}" if err else ""), flush=True)
    print(f"{len(seen)} compilations, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
