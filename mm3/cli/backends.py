"""``mm3 backends``: what is installed, from where, whether it runs here, what auto picks."""

from __future__ import annotations

import argparse
import json

from mm3.cli.main import UsageError, check_configured_backends, default_device, one_line, table
from mm3.contract.capabilities import BackendCapabilities
from mm3.contract.errors import MM3Error

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None,
                        help="torch device to probe (default: the current accelerator, else cpu)")
    parser.add_argument("--tp", type=int, default=8, choices=(1, 2, 4, 8),
                        help="MiniMax-M3 tensor-parallel size for the 'auto' column (default 8)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--verbose", action="store_true",
                        help="print full tracebacks of excluded plugins")


def _capabilities(caps: BackendCapabilities) -> dict:
    """Every field of a backend's capabilities, as JSON values; sets sorted, so the output is stable."""
    data = caps.model_dump(mode="json")
    return {k: sorted(v) if isinstance(v, list) else v for k, v in data.items()}


def run(args: argparse.Namespace) -> int:
    import torch

    from mm3.contract.params import SparseAttentionParams
    from mm3.runtime.registry import default_registry
    from mm3.runtime.selection import requirements_for, select

    device = args.device or default_device()
    try:
        torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise UsageError(f"invalid --device {device!r}: {e}") from None
    reg = default_registry()
    backends = reg.backends()
    problems = reg.problems()

    params = SparseAttentionParams.minimax_m3(tp_size=args.tp)
    req = requirements_for(params, torch.bfloat16, torch.bfloat16, device)
    picks: dict[str, list[str]] = {}
    auto_line: str
    try:
        sel = select(req, reg, device=device)
        picks.setdefault(sel.attention.name, []).append("attention")
        picks.setdefault(sel.indexer.name, []).append("indexer")
        auto_line = (f"auto picks attention={sel.attention.name}, indexer={sel.indexer.name} "
                     f"for MiniMax-M3 TP{args.tp} bfloat16 on {device}")
        if sel.topk_conversion:
            auto_line += " (top-k buffer converted each step)"
    except MM3Error as e:
        auto_line = f"auto finds no backend for MiniMax-M3 TP{args.tp} bfloat16 on {device}: " \
                    f"{one_line(str(e)).split(' Candidates:')[0]}"

    if args.json:
        data = {
            "device": device,
            "auto": {role: name for name, roles in picks.items() for role in roles},
            "backends": [{
                "name": b.name, "distribution": b.source.distribution, "version": b.source.version,
                "entry_point": b.source.entry_point, "available": b.probe(device).available,
                "reason": b.probe(device).reason, "topk_layout": b.capabilities.topk_layout,
                "topk_requires_contiguous": b.capabilities.topk_requires_contiguous,
                "kv_cache_layout": b.capabilities.kv_cache_layout,
                "ops": sorted(b.capabilities.ops), "priority": b.priority,
                "capabilities": _capabilities(b.capabilities),
            } for b in backends],
            "capability_fields": {name: f.description for name, f in BackendCapabilities.model_fields.items()},
            "problems": [{
                "name": p.name, "distribution": p.distribution, "version": p.version,
                "entry_point": p.source.entry_point, "stage": p.stage, "error": p.error,
            } for p in problems],
        }
        print(json.dumps(data, indent=2))
        check_configured_backends(registry=reg)
        return 0

    print(f"mm3 backends (probed on {device})")
    if backends:
        rows = []
        for b in backends:
            probe = b.probe(device)
            c = b.capabilities
            layout = c.topk_layout + (" (contiguous)" if c.topk_requires_contiguous else "")
            rows.append([
                b.name, b.source.dist_label,
                "yes" if probe.available else "no", layout, c.kv_cache_layout,
                ",".join(sorted(c.ops)), str(c.priority), "+".join(picks.get(b.name, [])),
                probe.reason,
            ])
        header = ["NAME", "SOURCE", "AVAILABLE", "TOPK LAYOUT", "KV", "OPS", "PRIORITY",
                  "AUTO", "REASON"]
        print("\n".join(table(header, rows)))
    else:
        print("  (no usable backends)")
    print(auto_line)
    print()
    if problems:
        print(f"problems ({len(problems)} plugin(s) excluded):")
        for p in problems:
            print(f"  {p.name} from {p.source.dist_label} [{p.stage}]: {p.error}")
            if args.verbose and p.details:
                print("    " + p.details.rstrip().replace("\n", "\n    "))
    else:
        print("problems: none")
    check_configured_backends(registry=reg)
    return 0

