"""Drop-in modules that serve an inference engine's own op signatures with mm3's backends.

* :mod:`mm3.integrations.vllm` - vLLM's MiniMax-M3 ops (``minimax_m3_index_decode``,
  ``minimax_m3_sparse_attn``...), their arguments and return conventions, on the
  backends mm3's selection picks;
* :mod:`mm3.integrations.sglang` - SGLang's MiniMax-M3 sparse functions
  (``minimax_sparse_decode``, ``minimax_sparse_prefill`` and the four kernel-level
  ones), their arguments and results, on the same selection;
* :mod:`mm3.integrations.targets` - the bound backends of such a call, selected
  once per call's requirements;
* :mod:`mm3.integrations.block_scores` - the index block scores and the top-k
  chosen from them, for engines whose ops hand scores around (a fused indexer
  never materialises them).

Nothing here imports an engine, and ``import mm3`` imports nothing here.
"""
