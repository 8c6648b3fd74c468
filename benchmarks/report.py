"""Turn the harness's records into JSON, a Markdown report, PNG plots and a target scorecard.

Records are flat dicts (see :mod:`benchmarks.harness`): one per (configuration,
implementation, part) with ``ms`` and, where counted, ``bytes``/``GBps``/
``pct_copy`` or ``flops``/``TFLOPs``; failed peers carry ``error``, skipped
configurations ``note``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable, Optional

__all__ = ["write_all", "targets", "markdown", "summary_text", "check_failures", "rate", "TOLERANCES"]

K = 1024
FP8 = "float8_e4m3fn"
#: (selection agreement with cpu_ref, max |attention error|) below which a check fails
TOLERANCES = {"sel_match": 0.95, "attn_max_err": 2e-2, "flex_diff": 3e-2}


def rate(tflops: float) -> str:
    """A TFLOP/s figure: whole numbers at GPU rates, two significant digits below 10 (a CPU's or a
    tiny shape's rate, which a whole number would print as 0).

    Example:
        >>> rate(771.4), rate(0.0123)
        ('771', '0.012')
    """
    return f"{tflops:.0f}" if tflops >= 10 else f"{tflops:.2g}"


def _find(records: Iterable[dict], **kw: Any) -> Optional[dict]:
    for r in records:
        if "ms" in r and all(r.get(k, _UNRECORDED.get(k)) == v for k, v in kw.items()):
            return r
    return None


#: what a record written before a field existed means by its absence
_UNRECORDED = {"kv_dtype": "bfloat16"}


def _mm3(records: list[dict]) -> str:
    for r in records:
        if str(r.get("impl", "")).startswith("mm3:"):
            return r["impl"]
    return "mm3:?"


#: decode rows of the targets: (label, shape, batch, context, index dtype, K/V dtype)
_DECODE_ROWS = [("TP1 B64 64K", "TP1", 64, 64 * K, "bfloat16", "bfloat16"),
                ("TP1 B1 64K", "TP1", 1, 64 * K, "bfloat16", "bfloat16"),
                ("TP1 B64 16K", "TP1", 64, 16 * K, "bfloat16", "bfloat16"),
                ("TP8 B64 64K", "TP8", 64, 64 * K, "bfloat16", "bfloat16"),
                ("TP8 B1 64K", "TP8", 1, 64 * K, "bfloat16", "bfloat16"),
                ("TP1 B64 64K fp8 index", "TP1", 64, 64 * K, FP8, "bfloat16"),
                ("TP1 B64 64K fp8 index + fp8 K/V", "TP1", 64, 64 * K, FP8, FP8)]
#: the public layer's decode step in a CUDA graph (us), by row label
_LAYER_US = {"TP1 B64 64K": 318, "TP1 B1 64K": 18, "TP1 B64 16K": 137, "TP8 B64 64K": 278, "TP8 B1 64K": 17,
             "TP1 B64 64K fp8 index": 216, "TP1 B64 64K fp8 index + fp8 K/V": 190}
#: the prefill step through the public layer (ms): (shape, context) -> goal
_PREFILL_MS = {("TP1", 0): 2.0, ("TP1", 32 * K): 2.7, ("TP8", 0): 0.40, ("TP8", 32 * K): 0.63}


def targets(records: list[dict], ceil: dict) -> list[dict]:
    """The performance targets (BENCHMARKS.md), each with the goal, the measured figure and whether it is met.

    Timed on the public path (``layer``: what an engine calls) with the bare hooks' step
    beside it: mm3's own cost on a decode step is the difference.
    """
    me = _mm3(records)
    out: list[dict] = []

    def add(name: str, goal: str, measured: Optional[float], ok: bool, text: str) -> None:
        out.append({"target": name, "goal": goal, "measured": measured, "met": ok if measured is not None else None,
                    "text": text, "note": ""})

    for label, shape, batch, ctx, idx, kv in _DECODE_ROWS:
        key = dict(kind="decode", shape=shape, batch=batch, context=ctx, qlen=1, index_dtype=idx, kv_dtype=kv)
        layer, hooks = _find(records, impl=me, part="layer", **key), _find(records, impl=me, part="step", **key)
        us = layer["ms"] * 1e3 if layer else None
        goal = _LAYER_US[label]
        add(f"decode {label}: public layer (CUDA graph)", f"<= {goal} us", us, us is not None and us <= goal,
            f"{us:.1f} us (hooks {hooks['ms'] * 1e3:.1f} us)" if layer and hooks else "not measured")
        gap = (layer["ms"] - hooks["ms"]) * 1e3 if layer and hooks else None
        allowed = 1.0 if batch == 1 else 0.01 * hooks["ms"] * 1e3 if hooks else 0.0
        add(f"decode {label}: layer minus bare hooks", "<= 1 us" if batch == 1 else "<= 1%", gap,
            gap is not None and gap <= allowed, f"{gap:+.1f} us" if gap is not None else "not measured")
    a = _find(records, impl=me, part="attention", kind="decode", shape="TP1", batch=64, context=64 * K, qlen=1,
              index_dtype="bfloat16", kv_dtype=FP8)
    add("decode TP1 B64 64K fp8 K/V: attention", "<= 45 us", a and a["ms"] * 1e3, a is not None and a["ms"] <= 0.045,
        f"{a['ms'] * 1e3:.1f} us" if a else "not measured")
    for (shape, ctx), goal in _PREFILL_MS.items():
        r = _find(records, impl=me, part="layer", kind="prefill", shape=shape, context=ctx, locality=0.0,
                  kv_dtype="bfloat16")
        add(f"prefill {shape} 8K ctx {ctx // K}K: public layer", f"<= {goal} ms", r and r["ms"],
            r is not None and r["ms"] <= goal, f"{r['ms']:.3f} ms" if r else "not measured")
    for ctx in (0, 32 * K):
        r = _find(records, impl=me, part="attention", kind="prefill", shape="TP1", context=ctx, locality=0.0,
                  kv_dtype="bfloat16")
        add(f"prefill TP1 8K ctx {ctx // K}K: sparse attention", ">= 320 TFLOP/s (stretch 400)",
            r and r["TFLOPs"], r is not None and r["TFLOPs"] >= 320,
            f"{_tflops(r['TFLOPs'])} TFLOP/s ({r['ms']:.3f} ms)" if r else "not measured")
    return out


def check_failures(records: list[dict]) -> list[str]:
    """Correctness checks that failed: selection agreement, attention error, FlexAttention agreement."""
    bad = []
    for r in records:
        c = r.get("check") or {}
        if "sel_match" in c and c["sel_match"] < TOLERANCES["sel_match"]:
            bad.append(f"{r['config']} {r['impl']}: selection agrees with the reference on "
                       f"{c['sel_match'] * 100:.1f}% of rows")
        if "attn_max_err" in c and not c["attn_max_err"] <= TOLERANCES["attn_max_err"]:
            bad.append(f"{r['config']} {r['impl']}: attention max error {c['attn_max_err']:.3g}")
        if "max_abs_diff_vs_mm3" in c and not c["max_abs_diff_vs_mm3"] <= TOLERANCES["flex_diff"]:
            bad.append(f"{r['config']} flex: differs from mm3 by {c['max_abs_diff_vs_mm3']:.3g}")
    return bad


# -- Markdown ----------------------------------------------------------------------------------------

def _us(r: Optional[dict]) -> str:
    if r is None:
        return "-"
    return f"{r['ms'] * 1e3:.1f}" if r["ms"] < 10 else f"{r['ms'] * 1e3:.0f}"


def _ctxs(n: int) -> str:
    return f"{n // K}K" if n >= K and n % K == 0 else str(n)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return lines


def _mb(nbytes: float) -> str:
    """Megabytes with a figure that shows at tiny sizes too.

    Example:
        >>> _mb(1344.5e6), _mb(36e3)
        ('1344.5', '0.036')
    """
    mb = nbytes / 1e6
    return f"{mb:.1f}" if mb >= 0.1 else f"{mb:.2g}"


def _check_cell(chk: dict) -> str:
    """Selection agreement / max attention error against the reference, or ``-`` where nothing was checked."""
    if "sel_match" not in chk:
        return "-"
    return f"{chk['sel_match'] * 100:.0f}% / {chk['attn_max_err']:.0e}"


def _decode_rows(records: list[dict]) -> list[list[str]]:
    me = _mm3(records)
    configs: dict[str, dict] = {}
    for r in records:
        if r.get("kind") == "decode" and "ms" in r:
            configs.setdefault(r["config"], r)
    rows = []
    for name, r0 in configs.items():
        key = dict(config=name)
        idx, att, st = (_find(records, impl=me, part=p, **key) for p in ("indexer", "attention", "step"))
        fl, cu, ef = (_find(records, impl=f"sdpa:{n}", **key) for n in ("flash", "cudnn", "efficient"))
        default = _find(records, impl="sdpa:default", **key)
        fx = _find(records, impl="flex", **key)
        cr = _find(records, impl="cpu_ref", part="step", **key)
        best = min([x for x in (fl, cu, default) if x], key=lambda x: x["ms"], default=None)
        chk = (st or {}).get("check") or {}
        rows.append([
            r0["shape"], str(r0["batch"]), _ctxs(r0["context"]), str(r0["qlen"]),
            ("fp8" if r0["index_dtype"] == FP8 else "bf16") + (" kv-fp8" if r0.get("kv_dtype") == FP8 else ""),
            str(st["sets"]) if st else "-",
            _us(idx), f"{idx['pct_copy']:.0f}%" if idx and "pct_copy" in idx else "-",
            _us(att), f"{att['pct_copy']:.0f}%" if att and "pct_copy" in att else "-",
            _us(st), _mb(st["bytes"]) if st else "-",
            f"{st['pct_copy']:.1f}%" if st and "pct_copy" in st else "-",
            _us(fl), _us(cu), _us(ef), _us(default), _us(fx), _us(cr),
            f"{best['ms'] / st['ms']:.1f}x" if best and st else "-",
            _check_cell(chk),
        ])
    return rows


def _tflops(x: float) -> str:
    """A TFLOP/s figure with the digits it has: tiny CPU runs would all print 0 at a GPU's precision.

    Example:
        >>> _tflops(531.6), _tflops(0.0031)
        ('532', '0.0031')
    """
    return f"{x:.0f}" if x >= 10 else f"{x:.2g}"


def measured_targets(records: list[dict], ceil: dict) -> tuple[list[dict], int]:
    """The targets this run measured, and how many it did not (their configurations did not run).

    Example:
        >>> measured_targets([], {})[0], measured_targets([], {})[1] > 10
        ([], True)
    """
    all_targets = targets(records, ceil)
    done = [t for t in all_targets if t["measured"] is not None]
    return done, len(all_targets) - len(done)


def _unmeasured_targets(env: dict, done: int, left: int) -> str:
    """Why ``left`` targets have no figure: a run that could measure none, or rows left out of this one.

    Example:
        >>> print(_unmeasured_targets({"tiny": True, "cuda_graphs": False, "device": "cpu"}, 0, 21).split("; ")[-1])
        this run used tiny shapes (--tiny) on cpu, not a CUDA GPU
        >>> _unmeasured_targets({"cuda_graphs": True}, 5, 16).split(":")[0]
        '16 target(s) not measured'
    """
    if done:
        return f"{left} target(s) not measured: their configurations did not run (--only, --max-priority or --budget-s)"
    this = [w for w, on in (("tiny shapes (--tiny)", env.get("tiny")),
                            (f"{env.get('device')}, not a CUDA GPU", not env.get("cuda_graphs", True))) if on]
    return (f"none of the {left} targets applies to this run: they are set for MiniMax-M3 shapes on an H200 in CUDA "
            f"graphs (BENCHMARKS.md); " + (f"this run used {' on '.join(this)}" if this else
                                           "their configurations did not run (--only, --max-priority or --budget-s)"))


def _targets_lines(env: dict, records: list[dict], ceil: dict) -> list[str]:
    done, left = measured_targets(records, ceil)
    lines = _table(["target", "goal", "measured", "met"],
                   [[t["target"], t["goal"], t["text"], "yes" if t["met"] else "**no**"] for t in done]) if done else []
    if left:
        lines += ["" if lines else None, _unmeasured_targets(env, len(done), left) + "."]
    return [x for x in lines if x is not None]


def _independent_reference(env: dict) -> bool:
    """Were the backend's results checked against another backend?"""
    return bool(env.get("reference")) and env.get("reference") != env.get("backend")


def _not_measured(env: dict, ceil: dict) -> list[str]:
    """What this run could not measure, and why (one line each)."""
    out = []
    if not env.get("cuda_graphs", True):
        out += [f"CUDA-graph times: {env.get('device')} is not a CUDA device, so every time is an eager call "
                f"timed on the host clock",
                "SDPA's flash, cuDNN and efficient kernels (CUDA only): the default SDPA of this device is "
                "timed instead; per-kernel profiles (GPU only)"]
    if not ceil:
        why = ("--tiny: a copy or matmul of tiny sizes says nothing about the device" if env.get("tiny")
               else "--no-ceilings")
        out.append(f"copy bandwidth and matmul ceilings, so no `%copy` shares ({why})")
    if not _independent_reference(env):
        ref = env.get("reference")
        out.append(f"correctness: the backend under test `{env.get('backend')}` is the reference, so nothing checks "
                   f"it here (--reference NAME)" if ref else "correctness: no reference backend was available")
    return out


def _keep_measured_columns(header: list[str], rows: list[list[str]]) -> tuple[list[str], list[list[str]]]:
    """Drop the columns no row has a figure in (``-`` everywhere): what a run did not measure is said once,
    in its own section, not as a column of dashes."""
    keep = [i for i in range(len(header)) if not rows or any(r[i] != "-" for r in rows)]
    return [header[i] for i in keep], [[r[i] for i in keep] for r in rows]


def _prefill_rows(records: list[dict]) -> list[list[str]]:
    me = _mm3(records)
    configs: dict[str, dict] = {}
    for r in records:
        if r.get("kind") == "prefill" and "ms" in r:
            configs.setdefault(r["config"], r)

    def ms_tf(r: Optional[dict]) -> str:
        if r is None:
            return "-"
        return f"{r['ms']:.3f}" + (f" ({_tflops(r['TFLOPs'])})" if "TFLOPs" in r else "")
    rows = []
    for name, r0 in configs.items():
        key = dict(config=name)
        idx, att, st = (_find(records, impl=me, part=p, **key) for p in ("indexer", "attention", "step"))
        chk = next((x.get("check") for x in records if x.get("config") == name and x.get("impl") == me
                    and x.get("check")), None) or {}
        sd = [_find(records, impl=f"sdpa:{n}", **key) for n in ("flash", "cudnn", "efficient", "default")]
        fx = _find(records, impl="flex", **key)
        cr = _find(records, impl="cpu_ref", **key)
        rows.append([
            r0["shape"], _ctxs(r0["context"]), "random" if not r0.get("locality") else f"shared {r0['locality']:g}",
            f"{chk['overlap_next_token']:.2f}" if "overlap_next_token" in chk else "-",
            ms_tf(idx), ms_tf(att), ms_tf(st),
            *[f"{x['ms']:.3f}" if x else "-" for x in sd], ms_tf(fx), ms_tf(cr),
            _check_cell(chk),
        ])
    return rows


def _variant_rows(records: list[dict]) -> list[list[str]]:
    me = _mm3(records)
    rows = []
    configs = []
    for r in records:
        if "variant" in r and r["config"] not in configs:
            configs.append(r["config"])
    for name in configs:
        impls = [me] + sorted({r["impl"] for r in records if r.get("config") == name and "variant" in r})
        for impl in impls:
            cells = []
            for part in ("indexer", "attention", "step"):
                r = _find(records, config=name, impl=impl, part=part)
                d = _find(records, config=name, impl=me, part=part)
                if r is None:
                    cells.append("-")
                    continue
                t = f"{r['ms'] * 1e3:.1f} us" if r["ms"] < 1 else f"{r['ms']:.3f} ms"
                cells.append(t + (f" ({d['ms'] / r['ms']:.2f}x)" if d and impl != me else ""))
            chk = next((x.get("check") for x in records if x.get("config") == name and x.get("impl") == impl
                        and x.get("check")), None) or {}
            err = next((x["error"] for x in records if x.get("config") == name and x.get("impl") == impl
                        and "error" in x), "")
            rows.append([name, impl, *cells, _check_cell(chk) + (f" ERROR {err[:80]}" if err else "")])
    return rows


def _size(n: float) -> str:
    """Bytes as a reader counts them.

    Example:
        >>> _size(65536), _size(200 << 20)
        ('66 KB', '210 MB')
    """
    return f"{n / 1e6:.0f} MB" if n >= 1e6 else f"{n / 1e3:.0f} KB"


def markdown(env: dict, ceil: dict, records: list[dict]) -> str:
    graphs = env.get("cuda_graphs", True)
    lines = [f"# mm3 benchmark: {env.get('gpu', env.get('device'))}", ""]
    ref = env.get("reference")
    lines.append(f"- date: {env.get('date')}; backend under test: `{env.get('backend')}`; reference: "
                 + (f"`{ref}`" if _independent_reference(env) else
                    f"none other than the backend under test (`{ref}`)" if ref else "none available"))
    lines.append(f"- torch {env.get('torch')}, triton {env.get('triton')}, python {env.get('python')}"
                 + (f", CUDA {env['cuda']}, {env['sms']} SMs, L2 {env['l2_MB']} MB, {env['memory_GiB']} GiB"
                    if "sms" in env else ""))
    lines.append(f"- command: `{env.get('command')}`; times are medians "
                 + (f"in CUDA graphs, inputs rotated over >= {_size(env.get('rotate_bytes', 0))} per measurement"
                    if graphs else f"of eager calls on {env.get('device')} (host clock)"))
    lines.append("")
    kinds = {k: len({r["config"] for r in records if r.get("kind") == k and "ms" in r}) for k in ("decode", "prefill")}
    peers_seen = sorted({str(r["impl"]) for r in records if "ms" in r and not str(r.get("impl", "")).startswith("mm3:")})
    lines += ["## What this run measured", "",
              f"- measured: {kinds['decode']} decode and {kinds['prefill']} prefill configuration(s) of "
              f"`{env.get('backend')}` ({'tiny shapes' if env.get('tiny') else 'MiniMax-M3 shapes'}) on "
              f"{env.get('gpu', env.get('device'))}" + (f"; beside it: {', '.join(peers_seen)}" if peers_seen else "")]
    lines += [f"- not measured: {x}" for x in _not_measured(env, ceil)]
    lines.append("")
    if ceil:
        lines += ["## Ceilings (measured in this run)", ""]
        lines += _table(["what", "result", "median time"], [
            ["device-to-device copy (bytes read + written)", f"{ceil['copy']['GBps']:.0f} GB/s",
             f"{ceil['copy']['ms']:.3f} ms"],
            ["pure read (sum of a large fp32 tensor)", f"{ceil['read']['GBps']:.0f} GB/s", f"{ceil['read']['ms']:.3f} ms"],
            [f"bf16 matmul {ceil['matmul_bf16']['n']}^3", f"{rate(ceil['matmul_bf16']['TFLOPs'])} TFLOP/s",
             f"{ceil['matmul_bf16']['ms']:.3f} ms"]])
        lines.append("")
    lines += ["## Targets", ""] + _targets_lines(env, records, ceil) + [""]
    checked = ("`check` = selection agreement with the reference on the first and last request / max |attention "
               "error| there." if _independent_reference(env) else "")
    lines += [f"## Decode ({'CUDA graphs' if graphs else 'eager calls'}; times in us)", "",
              " ".join(x for x in (
                  "`%copy` = minimal bytes / time as a share of the measured copy bandwidth." if ceil else "",
                  "Dense SDPA and FlexAttention are attention only (they need no indexer); `vs dense` = the faster "
                  "of flash/cuDNN (or the default SDPA) over the mm3 step.", checked) if x), ""]
    lines += _table(*_keep_measured_columns(
        ["shape", "batch", "ctx", "q", "index", "sets", "indexer", "%copy", "attention", "%copy", "step", "min MB",
         "step %copy", "sdpa flash", "sdpa cudnn", "sdpa eff.", "sdpa default", "flex attn", "cpu_ref step",
         "vs dense", "check"], _decode_rows(records)))
    lines.append("")
    chunks = sorted({r["chunk"] for r in records if r.get("kind") == "prefill" and "chunk" in r})
    lines += [f"## Prefill ({' / '.join(_ctxs(c) for c in chunks) or '8K'}-token chunk; ms, TFLOP/s in parentheses)",
              "", "mm3 TFLOP/s count sparse FLOPs (the keys each token's selected blocks give it); SDPA is dense "
              "causal attention over the whole context. `overlap` = share of a token's blocks its successor "
              "also selected." + (" " + checked if checked else ""), ""]
    lines += _table(*_keep_measured_columns(
        ["shape", "ctx", "selection", "overlap", "indexer", "attention", "step", "sdpa flash", "sdpa cudnn",
         "sdpa eff.", "sdpa default", "flex attn", "cpu_ref", "check"], _prefill_rows(records)))
    lines.append("")
    var = _variant_rows(records)
    if var:
        lines += ["## Launch-config variants (same inputs, same run)", "",
                  "Each variant is the cuda plugin with some `LaunchConfig` fields changed "
                  "(benchmarks/variants.py), checked against the reference first; `x` = default time / "
                  "variant time (> 1 is faster).", ""]
        lines += _table(["configuration", "implementation", "indexer", "attention", "step", "check"], var)
        lines.append("")
    probs = [r for r in records if "error" in r or "note" in r and str(r.get("note", "")).startswith("skipped")]
    if probs:
        lines += ["## Errors and skips", ""]
        for r in probs:
            lines.append(f"- {r.get('config')} {r.get('impl', '')} {r.get('part', '')}: "
                         f"{r.get('error') or r.get('note')}")
        lines.append("")
    fails = check_failures(records)
    if fails:
        lines += ["## FAILED CHECKS", ""] + [f"- {f}" for f in fails] + [""]
    return "\n".join(lines)


def summary_text(env: dict, ceil: dict, records: list[dict]) -> str:
    """A short plain-text table of the targets (printed last, so it lands in a log's tail)."""
    done, left = measured_targets(records, ceil)
    lines = ["", "targets:"]
    for t in done:
        lines.append(f"  [{'MET ' if t['met'] else 'MISS'}] {t['target']}: {t['text']} (goal {t['goal']})")
    if left:
        lines.append(f"  {_unmeasured_targets(env, len(done), left)}")
    return "\n".join(lines)


# -- plots -------------------------------------------------------------------------------------------

LINES = [  # (impl, part, index dtype or None, label, style)
    ("mm3", "step", "bfloat16", "mm3 step", "-o"),
    ("mm3", "step", FP8, "mm3 step (fp8 index)", "-s"),
    ("mm3", "indexer", "bfloat16", "mm3 indexer", ":o"),
    ("mm3", "attention", "bfloat16", "mm3 attention", ":^"),
    ("sdpa:flash", "attention", "bfloat16", "SDPA flash (dense)", "--x"),
    ("sdpa:cudnn", "attention", "bfloat16", "SDPA cuDNN (dense)", "--+"),
    ("sdpa:efficient", "attention", "bfloat16", "SDPA efficient (dense)", "--d"),
    ("sdpa:default", "attention", "bfloat16", "SDPA (dense)", "--x"),
    ("flex", "attention", "bfloat16", "FlexAttention (same selection)", "-.v"),
    ("cpu_ref", "step", "bfloat16", "cpu_ref step", "-.*"),
]


def _plot_decode(records: list[dict], path: Path) -> Optional[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    me = _mm3(records)
    dec = [r for r in records if r.get("kind") == "decode" and r.get("qlen") == 1 and "ms" in r]
    panels = sorted({(r["shape"], r["batch"]) for r in dec})
    if not panels:
        return None
    cols = min(4, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.6 * rows), squeeze=False)
    for ax, (shape, batch) in zip(axes.flat, panels):
        for impl, part, idt, label, style in LINES:
            name = me if impl == "mm3" else impl
            pts = sorted((r["context"], r["ms"] * 1e3) for r in dec if r["shape"] == shape and r["batch"] == batch
                         and r["impl"] == name and r["part"] == part and r["index_dtype"] == idt
                         and r.get("kv_dtype", "bfloat16") == "bfloat16")
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label, ms=4)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"decode {shape}, batch {batch}, q1", fontsize=10)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("time (us)")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles, labels = [], []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    if labels:   # a run of only some rows may plot none
        fig.legend(handles, labels, loc="lower center", ncol=min(5, len(labels)), fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_prefill(records: list[dict], path: Path) -> Optional[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    me = _mm3(records)
    pre = [r for r in records if r.get("kind") == "prefill" and "ms" in r]
    panels = sorted({(r["shape"], r.get("locality", 0.0)) for r in pre})
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False)
    series = [(me, "indexer", "mm3 indexer", ":o"), (me, "attention", "mm3 attention", ":^"),
              (me, "step", "mm3 step", "-o"), ("sdpa:flash", "attention", "SDPA flash (dense causal)", "--x"),
              ("sdpa:cudnn", "attention", "SDPA cuDNN (dense causal)", "--+"),
              ("sdpa:default", "attention", "SDPA (dense causal)", "--x"),
              ("flex", "attention", "FlexAttention (same selection)", "-.v"), ("cpu_ref", "step", "cpu_ref step", "-.*")]
    for ax, (shape, loc) in zip(axes[0], panels):
        for impl, part, label, style in series:
            pts = sorted((r["context"], r["ms"]) for r in pre if r["shape"] == shape and
                         r.get("locality", 0.0) == loc and r["impl"] == impl and r["part"] == part)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label, ms=4)
        ax.set_yscale("log")
        ax.set_title(f"prefill {shape}, {'random' if not loc else f'shared {loc:g}'} selection", fontsize=10)
        ax.set_xlabel("cached context before the chunk (tokens)")
        ax.set_ylabel("time (ms)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_blockmaps(maps: list[dict], path: Path) -> Optional[Path]:
    if not maps:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    heads = max(m["bitmap"].shape[0] for m in maps)
    fig, axes = plt.subplots(len(maps), heads, figsize=(3.2 * heads, 3.4 * len(maps)), squeeze=False)
    for row, m in enumerate(maps):
        bm = m["bitmap"]                     # [H, T, nb] bool
        H, T, nb = bm.shape
        g = max(1, T // 1024)                # rows: groups of g tokens (any selection in the group)
        img = bm[:, : (T // g) * g].view(H, T // g, g, nb).float().mean(2)
        for h in range(heads):
            ax = axes[row][h]
            if h >= H:
                ax.axis("off")
                continue
            ax.imshow(img[h].numpy(), aspect="auto", interpolation="nearest", cmap="Greys", vmin=0, vmax=1,
                      extent=(0, nb, (T // g) * g, 0))
            ax.set_title(f"{m['config']}\nhead {h} (overlap {m['overlap']:.2f})", fontsize=7)
            ax.set_xlabel("block")
            ax.set_ylabel("token of the chunk")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_all(out: Path, env: dict, ceil: dict, records: list[dict], blockmaps: list[dict]) -> list[Path]:
    """Write results.json, results.md and the plots (when matplotlib is importable)."""
    files = []
    data = {"environment": env, "ceilings": ceil, "targets": targets(records, ceil), "records": records}
    (out / "results.json").write_text(json.dumps(data, indent=1, default=_jsonable))
    files.append(out / "results.json")
    (out / "results.md").write_text(markdown(env, ceil, records))
    files.append(out / "results.md")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib not installed: no plots", flush=True)
        return files
    for fn, name in ((_plot_decode, "decode_vs_context.png"), (_plot_prefill, "prefill_vs_context.png")):
        p = fn(records, out / name)
        if p:
            files.append(p)
    p = _plot_blockmaps(blockmaps, out / "blockmap.png")
    if p:
        files.append(p)
    return files


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return str(x)
