"""mm3: MiniMax-M3-style block-sparse attention on any hardware through pluggable backends."""
from mm3.contract.batch import BatchMetadata
from mm3.contract.buffers import PagedKVCache, TopkBuffer
from mm3.contract.capabilities import BackendCapabilities, Probe, Requirements
from mm3.contract.errors import *  # noqa: F401,F403
from mm3.contract.hookspecs import hookimpl, hookspec
from mm3.runtime.config import Settings
from mm3.contract.params import SparseAttentionParams
from mm3.runtime.backend import Backend
from mm3.runtime.registry import Registry, default_registry
from mm3.runtime.selection import Selection, select
from mm3.runtime.layer import SparseAttention
from mm3.runtime.scope import use_backend

__version__ = "0.1.0"
