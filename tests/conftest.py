"""Suite-wide setup.

Without a GPU, the Triton backends run through Triton's interpreter on CPU
tensors. The interpreter is chosen when a kernel is *decorated*, so the
variable must be set before any kernel module is imported: here, first.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("TRITON_INTERPRET") == "1":
    from interpreter_sort import install as _numpy_sort_for_the_interpreter

    _numpy_sort_for_the_interpreter()  # exact, and 4x faster indexer tests: see tests/interpreter_sort.py

# The contract guard (mm3.debug.guard) checks every backend call the suite makes through
# SparseAttention; production keeps it off (the default). Tests that need the
# default clear MM3_* variables themselves.
os.environ.setdefault("MM3_CHECK_CONTRACTS", "1")
