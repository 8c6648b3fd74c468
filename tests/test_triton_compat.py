"""backends/triton/compat.py: every private internal it names is where the installed Triton keeps it.

Run on each Triton the project uses (CI's, the H200's), these fail on a release
that moved one of them, that no row of ``compat.RELEASES`` describes, or whose
row's facts are not the release's; before a GPU run would find the host time
back at Triton's own launch, or a user's ``TRITON_INTERPRET=1 mm3 check`` would
report bf16 kernels wrong. Also: no other module of ``mm3_backends`` imports a
private module (one place to look when a release moves something), and a user's
process under ``TRITON_INTERPRET=1`` gets the interpreter's bf16 made right.
"""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from mm3_backends.triton import compat  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ROOT / "backends"


def _release() -> compat.Release:
    version = compat.installed_version()
    row = compat.release_for(version)
    assert row is not None, (
        f"Triton {version} is in no row of compat.RELEASES: read its source for each internal of compat.INTERNALS "
        f"and each fact of compat.Release, then add its row (these tests check the row)")
    return row


# -- the installed release -------------------------------------------------------------------------------------

def test_the_installed_triton_is_a_release_the_table_describes() -> None:
    _release()
    assert compat.release_note() == ""
    import triton
    assert compat.installed_version() == tuple(int(x) for x in triton.__version__.split(".")[:2])


@pytest.mark.parametrize("feature", sorted(compat.INTERNALS))
def test_every_internal_is_where_the_installed_triton_keeps_it(feature: str) -> None:
    if feature == compat.RAW_STREAM and not (torch.version.cuda or torch.version.hip):
        # a CPU build of PyTorch has no CUDA stream to ask for: the public fallback stands in
        assert compat.missing(feature) and compat.current_raw_stream.__name__ == "<lambda>"
        return
    assert compat.missing(feature) == [], f"Triton {compat.installed_version()} moved what {feature!r} reads"


def test_the_installed_triton_keeps_the_facts_its_row_pins() -> None:
    row = _release()
    holder = compat.hook_holder()
    assert holder is compat.lookup(row.hooks)
    assert hasattr(holder.launch_enter_hook, "calls") == row.hook_chain
    # the numpy-sort shortcut replaces tl.topk under the interpreter: the release's own is the one it keeps
    import triton.language as tl
    speed = sys.modules.get("mm3_backends.triton.interpreter_speed")
    network_topk = getattr(speed, "_originals", {}).get((tl, "topk"), tl.topk)
    assert ("descending" in network_topk.arg_names) == row.topk_descending
    from triton.backends.nvidia.driver import CudaLauncher
    named = [p for p in inspect.signature(CudaLauncher.__call__).parameters.values()
             if p.kind == p.POSITIONAL_OR_KEYWORD][1:]
    assert (len(named) == compat.LAUNCH_HEAD) == row.launcher_names_head, named


if os.environ.get("TRITON_INTERPRET") == "1":
    import triton
    import triton.language as tl

    @triton.jit
    def _loop_to_a_reduction(x_ptr, out_ptr, N: tl.constexpr):
        n = tl.max(tl.load(x_ptr + tl.arange(0, N)), axis=0)
        acc = n * 0
        for i in tl.range(0, n):
            acc += i
        tl.store(out_ptr, acc)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="a fact of Triton's CPU interpreter")
def test_the_interpreter_runs_a_loop_bounded_by_a_reduction_as_the_row_says(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from mm3_backends.triton import plugin_factory

    row = _release()
    out = torch.zeros(1, dtype=torch.int32)
    try:
        _loop_to_a_reduction[(1,)](torch.tensor([3, 5, 1, 2], dtype=torch.int32), out, 4)
        ran = out.item() == 10
    except Exception:   # noqa: BLE001 - the release's interpreter refuses it
        ran = False
    assert ran == row.interpreter_runs_kernels
    # on a release whose interpreter cannot, the CPU probe says why instead of a kernel failing
    monkeypatch.setattr(compat, "installed_version", lambda: next(
        r.first for r in compat.RELEASES if not r.interpreter_runs_kernels))
    probe = plugin_factory.interpreter_probe("cuda")
    assert not probe.available and "interpreter cannot run these kernels" in probe.reason


def _jit_launch_call() -> ast.Call:
    """The call of a compiled kernel's launcher in the installed Triton's ``JITFunction.run``."""
    run = compat.lookup(compat.INTERNALS[compat.DIRECT_LAUNCH][0])
    tree = ast.parse(textwrap.dedent(inspect.getsource(run)))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "run" and isinstance(n.func.value, ast.Name) and n.func.value.id == "kernel"]
    assert len(calls) == 1, f"JITFunction.run calls kernel.run {len(calls)} times"
    return calls[0]


def test_the_installed_tritons_jit_calls_the_launcher_as_the_direct_launch_does() -> None:
    """The direct launch calls ``run(grid x 3, stream, function, packed_metadata, launch metadata, enter hook,
    exit hook, *every parameter)`` (compat.compiled_launch): the call Triton's own JIT makes. Another call here
    (a new argument, another order, the parameters passed otherwise) is a Triton it does not fit."""
    call = _jit_launch_call()
    head = [ast.unparse(a) for a in call.args[:compat.LAUNCH_HEAD]]
    assert head[:7] == ["grid_0", "grid_1", "grid_2", "stream", "kernel.function", "kernel.packed_metadata",
                        "launch_metadata"], head
    assert head[7].endswith("launch_enter_hook") and head[8].endswith("launch_exit_hook"), head
    rest = call.args[compat.LAUNCH_HEAD:]
    assert len(rest) == 1 and isinstance(rest[0], ast.Starred) and "bound_args" in ast.unparse(rest[0]), \
        "the kernel's parameters are passed otherwise than as *bound_args.values() (every parameter)"
    assert not call.keywords


def test_the_installed_tritons_launchers_take_that_call() -> None:
    for internal in compat.INTERNALS[compat.DIRECT_LAUNCH][4:]:
        launcher = compat.lookup(internal.replace(".__call__", ""))
        assert compat.launcher_problem(launcher) == "", compat.launcher_problem(launcher)


def test_a_launch_hook_of_the_installed_triton_is_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    """A profiler's launch hook needs Triton's launch metadata: while one is installed every launch takes
    Triton's path (tests/test_fast_launch.py)."""
    holder = compat.hook_holder()
    assert not compat.hooks_installed()
    hook = holder.launch_enter_hook

    def profiler(metadata: Any) -> None:
        return None
    if hasattr(hook, "add"):     # a chain of hooks
        hook.add(profiler)
        try:
            assert compat.hooks_installed()
        finally:
            hook.remove(profiler)
    else:
        monkeypatch.setattr(holder, "launch_enter_hook", profiler)
        assert compat.hooks_installed()
        monkeypatch.undo()
    assert not compat.hooks_installed()


def test_the_kernels_mode_is_the_one_they_were_decorated_in() -> None:
    from mm3_backends.triton import attention, plugin_factory

    want = "interpreted" if os.environ.get("TRITON_INTERPRET") == "1" else "compiled"
    assert compat.kernel_mode(attention._decode_attention_kernel) == want
    assert plugin_factory._loaded_kernel_mode() == want
    assert compat.kernel_mode(print) == "interpreted" and compat.jit_params(print) is None


# -- the table and the lookups -------------------------------------------------------------------------------

def test_the_release_rows_are_ordered_and_apart() -> None:
    rows = compat.RELEASES
    assert all(r.first <= r.last and r.read for r in rows)
    assert all(a.last < b.first for a, b in zip(rows, rows[1:])), "rows overlap or are out of order"
    assert compat.release_for((3, 6)) is rows[0] and compat.release_for((3, 9)) is rows[-1]
    assert compat.release_for((2, 9)) is None and compat.release_for((99, 0)) is None


def test_a_release_the_table_does_not_know_is_said(monkeypatch: pytest.MonkeyPatch) -> None:
    from mm3_backends.triton import plugin_factory

    monkeypatch.setattr(compat, "installed_version", lambda: (99, 1))
    note = compat.release_note()
    assert "Triton 99.1 is not a release" in note and all(v in note for r in compat.RELEASES for v in r.read)
    assert note in plugin_factory._with_release_note("reason")
    monkeypatch.setattr(compat, "installed_version", lambda: compat.RELEASES[0].first)
    assert compat.release_note() == "" and plugin_factory._with_release_note("reason") == "reason"


def test_lookup_says_what_is_missing() -> None:
    with pytest.raises(LookupError, match=r"triton\.runtime\.jit:JITFunction\.moved \(no moved\)"):
        compat.lookup("triton.runtime.jit:JITFunction.moved")
    with pytest.raises(LookupError, match=r"triton\.no_such_module \(ModuleNotFoundError"):
        compat.lookup("triton.no_such_module:x")
    assert compat.lookup("triton.no_such_module:x | triton.runtime.jit:JITFunction") is \
        compat.lookup("triton.runtime.jit:JITFunction")


def test_a_moved_internal_turns_its_feature_off_with_its_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(compat.INTERNALS, compat.BF16, (*compat.INTERNALS[compat.BF16],
                                                        "triton.runtime.interpreter:InterpreterBuilder.gone"))
    from mm3_backends.triton import interpreter
    assert interpreter.missing() == ["triton.runtime.interpreter:InterpreterBuilder.gone (no gone)"]
    monkeypatch.setattr(interpreter, "_ORIGINALS", {})
    with pytest.warns(RuntimeWarning, match="InterpreterBuilder.gone.*bf16 kernels under TRITON_INTERPRET=1 compute"):
        assert interpreter.install() is False


# -- one place ----------------------------------------------------------------------------------------------

#: modules whose contents are Triton's (or PyTorch's) own business
PRIVATE = ("triton.runtime", "triton.compiler", "triton.backends", "triton.knobs", "triton._C", "torch._C")
#: names that only compat.py may spell
PRIVATE_NAMES = ("InterpretedFunction", "_cuda_getCurrentRawStream", "CompiledKernel", "CudaLauncher", "HIPLauncher")


def _private_uses(path: Path) -> list[str]:
    """The private modules ``path`` imports and the private names it spells (in code or in a string)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith(PRIVATE)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [m for m in [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                      if m.startswith(PRIVATE)]
        text = {ast.Name: "id", ast.Attribute: "attr", ast.Constant: "value"}.get(type(node))
        spelled = getattr(node, text, None) if text else None
        if isinstance(spelled, str):
            found += [name for name in PRIVATE_NAMES if name in spelled]
    return sorted(set(found))


def test_no_other_backend_module_reaches_into_triton_internals(tmp_path: Path) -> None:
    offenders = {str(p.relative_to(ROOT)): uses for p in sorted(BACKENDS.rglob("*.py"))
                 if p.name != "compat.py" and (uses := _private_uses(p))}
    assert not offenders, f"only backends/triton/compat.py may name Triton's private internals: {offenders}"
    sample = tmp_path / "sample.py"
    sample.write_text("from triton.runtime import interpreter\nimport torch._C\n"
                      "mode = type(kernel).__name__ == 'InterpretedFunction'\n")
    assert _private_uses(sample) == ["InterpretedFunction", "torch._C", "triton.runtime", "triton.runtime.interpreter"]


def test_the_interpreter_patches_use_only_internals_compat_names() -> None:
    """What :mod:`.interpreter` and :mod:`.interpreter_speed` read of Triton's interpreter module is named in
    ``compat.INTERNALS`` (so a release that moves it fails above, not in a user's run)."""
    named = {i.split(":")[1].split(".")[0] for internals in compat.INTERNALS.values() for i in internals
             if i.startswith("triton.runtime.interpreter:")}
    for module in ("interpreter.py", "interpreter_speed.py"):
        tree = ast.parse((BACKENDS / "triton" / module).read_text())
        used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                and n.value.id in ("interpreter", "interp")}
        assert used and used <= named, f"{module} reads {sorted(used - named)} of the interpreter unnamed in compat"


# -- what a user's process gets ------------------------------------------------------------------------------

_USER_RUN = """
import sys
from mm3.runtime.registry import Registry
from mm3.testing.conformance import plan_cases
from mm3_backends.cpu_ref import plugin as cpu_ref
from mm3_backends.cuda import plugin as cuda

registry = Registry(plugins=[cuda, cpu_ref], entry_points=False)
case, = [c for c in plan_cases(registry.get("cuda"), device="cpu", quick=True, dtypes=["bfloat16"],
                               index_dtypes=["bfloat16"]) if c.name == "indexer/mixed_h1:bfloat16"]
patched = case.run().passed                  # as `mm3 check cuda` runs it: the plugin's hook, kernels imported
from mm3_backends.triton import compat, interpreter
builder = compat.interpreter_module().InterpreterBuilder
for name, theirs in interpreter._ORIGINALS.items():   # the interpreter's own bf16, to show the case can fail
    setattr(builder, name, theirs)
print(patched, case.run().passed)
"""


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the patch is for Triton's CPU interpreter")
def test_a_users_process_under_the_interpreter_gets_bf16_right() -> None:
    """A fresh process (no test suite around it) with ``TRITON_INTERPRET=1``: the cuda plugin's bf16 indexer
    case of ``mm3 check`` passes, and fails with the interpreter's own bf16 put back."""
    if compat.interpreter_problem():
        pytest.skip(compat.interpreter_problem())
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", _USER_RUN], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["True", "False"], proc.stdout + proc.stderr[-3000:]
