"""Suite-wide setup.

Without a GPU, the Triton backends run through Triton's interpreter on CPU
tensors. The interpreter is chosen when a kernel is *decorated*, so the
variable must be set before any kernel module is imported: here, first.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# (Under the interpreter, the kernel modules' import makes its bf16 right and takes its exact
# shortcuts: mm3_backends.triton.interpreter and .interpreter_speed, the code `mm3 check` runs.)

# The suite runs the production default (check_contracts="first": the guard checks the first
# step of each batch kind); a test that needs the guard on every step passes
# Settings(check_contracts="always") itself.

# The Triton plugins' names as test parameters: such a test runs the kernels, through the
# interpreter when there is no GPU.
TRITON_PLUGINS = {"cuda", "rocm"}


def pytest_collection_modifyitems(items):  # type: ignore[no-untyped-def]
    """Mark ``interpreter`` every test parametrized with a Triton plugin (``backend="cuda"``, a
    ``cuda->rocm`` pair...), so ``-m "not interpreter"`` is the quick subset README promises."""
    import pytest

    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if any(isinstance(v, str) and v in TRITON_PLUGINS for v in params.values()):
            item.add_marker(pytest.mark.interpreter)
