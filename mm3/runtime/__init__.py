"""The runtime: find backends, configure, choose, and run the composed op.

* :mod:`.discovery` - entry points, where a plugin came from, why one was excluded;
* :mod:`.backend` - :class:`~mm3.runtime.backend.Backend`, a bound backend;
* :mod:`.registry` - every valid backend, loaded once; the process-wide default;
* :mod:`.config` - :class:`~mm3.runtime.config.Settings`: arguments > env > file > defaults;
* :mod:`.selection` - ``select()``: the choice and the trace that explains it;
* :mod:`.scope` - ``use_backend(...)``: a scoped choice;
* :mod:`.layer` - :class:`~mm3.runtime.layer.SparseAttention`, indexer -> top-k buffer -> attention;
* :mod:`.distributed` - tensor-parallel sharding of a layer.

The public names are re-exported by :mod:`mm3`.
"""
