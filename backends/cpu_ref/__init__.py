"""``cpu_ref``: the reference backend (plain PyTorch, any device, head-major top-k).

The plugin module is :mod:`mm3_backends.cpu_ref.plugin` (entry point ``cpu_ref``);
the kernels are :func:`mm3_backends.cpu_ref.indexer.index_topk` and
:func:`mm3_backends.cpu_ref.attention.attention_forward`, usable directly.
"""
