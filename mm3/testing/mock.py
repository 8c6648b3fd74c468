"""``MockBackend``: a configurable backend that records calls and can misbehave on purpose.

It declares whatever capabilities a test needs (any name, layout, ops,
priority, availability...), records every hook call, delegates the math to a
real backend (``cpu_ref`` by default, found through its entry point, so
importing mm3 never imports a backend) and can inject one fault:

==================  ====================================================================
``fault``           what happens
==================  ====================================================================
``"raise"``         ``index_topk`` / ``attention_forward`` fail half-way: they write
                    :data:`GARBAGE` into the first half of their step's rows (top-k ids,
                    or outputs), then raise :class:`MockFault`
``"no_write"``      ``index_topk`` / ``attention_forward`` return without writing anything
``"wrong_layout"``  vLLM's bug: ``alloc_topk_buffer`` wraps storage of the *other* layout
                    in a buffer labelled with the declared one, and ``index_topk`` writes
                    like a raw-pointer kernel that assumes a dense buffer in the declared
                    layout. With one head both memory maps coincide and all is well; with
                    ``H > 1`` :class:`~mm3.TopkBuffer` refuses the mislabelled storage, so
                    the allocation fails (``PluginError`` from the bound backend), and a
                    buffer of the other layout handed to ``index_topk`` gets scrambled rows.
``"out_of_range"``  ``index_topk`` writes block id ``nb`` (one past the token's last
                    visible block) into slot 0 of the first real token, head 0
``"write_past_rows"``  ``index_topk`` also writes ``0`` into every row at or past ``T`` of
                    the buffer it allocated (the step only receives ``rows(0, T)``, so the
                    mock writes through the full buffer it kept)
``"nan_output"``    ``attention_forward`` leaves NaN in the last row of ``out[:T]``
``"unordered"``     ``index_topk`` leaves its delegate's rows in score order, whatever
                    ``topk_order`` it declares
==================  ====================================================================

The top-k order it declares holds (but with ``fault="unordered"``): with ``topk_order="ascending"`` its
``index_topk`` sorts the rows its delegate wrote, and with
``topk_order_required="ascending"`` its ``attention_forward`` raises
``AssertionError`` on rows handed to it in another order.

Example:
    >>> from mm3.runtime.registry import Registry
    >>> mock = MockBackend("mock_tm", topk_layout="token_major", priority=5)
    >>> be = Registry(plugins=[mock], entry_points=False).get("mock_tm")
    >>> be.alloc_topk_buffer(8, 2, 4, "cpu").layout
    'token_major'
    >>> [c.hook for c in mock.calls if c.hook == "alloc_topk_buffer"]
    ['alloc_topk_buffer']
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union, get_args

import torch

from mm3.contract.batch import BatchMetadata
from mm3.contract.buffers import PagedKVCache, TopkBuffer
from mm3.contract.capabilities import BackendCapabilities, Probe
from mm3.contract.errors import InputError, UnknownBackendError
from mm3.contract.hookspecs import hookimpl
from mm3.contract.params import SparseAttentionParams
from mm3.contract.topk_order import is_ascending, sort_ascending_

__all__ = ["MockBackend", "MockFault", "Call", "Fault", "FAULTS", "GARBAGE"]

Fault = Literal["raise", "no_write", "wrong_layout", "out_of_range", "write_past_rows", "nan_output", "unordered"]
FAULTS: tuple[str, ...] = get_args(Fault)

GARBAGE = 12345
"""What ``fault="raise"`` leaves in the rows it wrote before raising (as an id, or as an output value)."""

_DEFAULT_CAPABILITIES: dict[str, Any] = dict(
    ops=frozenset({"index_topk", "attention"}),
    device_types=frozenset({"cpu", "cuda"}),
    topk_layout="head_major",
    max_decode_query_len=16,
    kv_cache_dtypes=frozenset({"bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2",  # as cpu_ref
                               "float8_e4m3fn_unscaled", "nvfp4"}),
    index_cache_dtypes=frozenset({"bfloat16", "float8_e4m3fn", "nvfp4"}),
    query_dtypes=frozenset({"float8_e4m3fn"}),
    kv_slot_scales=True,
    addressings=frozenset({"pages", "slots"}),    # as cpu_ref, its default delegate
    description="mm3.testing.MockBackend",
)


class MockFault(RuntimeError):
    """Raised by a :class:`MockBackend` built with ``fault="raise"``."""


@dataclass(frozen=True)
class Call:
    """One recorded hook call: its name and its arguments by name (the objects, not copies)."""

    hook: str
    args: dict[str, Any] = field(default_factory=dict)


def _other(layout: str) -> str:
    return "token_major" if layout == "head_major" else "head_major"


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _load_entry_point(name: str) -> object:
    """The plugin registered under entry point ``name`` of the ``mm3.backends`` group."""
    from mm3.runtime.discovery import list_entry_points  # deferred: keep mm3.testing import-light

    for ep in list_entry_points():
        if ep.name == name:
            return ep.load()
    raise UnknownBackendError(
        f"MockBackend: no installed backend entry point named {name!r} to delegate to; install it "
        f"(pip install -e .) or pass delegate=<plugin module, plugin object or mm3 Backend>")


class MockBackend:
    """A plugin object (register it like a module) with configurable capabilities.

    Args:
        name: backend name (``capabilities.name``).
        delegate: who does the math: a plugin module/object or a
            :class:`~mm3.runtime.backend.Backend` (anything with ``index_topk`` /
            ``attention_forward``), or an entry-point name. Default ``"cpu_ref"``,
            loaded on first use.
        fault: one of :data:`FAULTS` (see the module docstring), or ``None``.
        available: what ``backend_probe`` answers; ``probe_reason`` says why.
        **capabilities: any :class:`~mm3.contract.capabilities.BackendCapabilities` field
            (``topk_layout``, ``ops``, ``priority``, ``dtypes``...), overriding the
            defaults (both ops, cpu+cuda, head-major, decode query length 16).

    Attributes:
        calls: every hook call, in order, as :class:`Call`.
        allocated: every buffer ``alloc_topk_buffer`` returned.
    """

    def __init__(self, name: str = "mock", *, delegate: Union[object, str, None] = "cpu_ref",
                 fault: Optional[Fault] = None, available: bool = True,
                 probe_reason: str = "mock backend",
                 **capabilities: Any) -> None:
        if fault is not None and fault not in FAULTS:
            raise InputError(f"MockBackend: unknown fault {fault!r}; use one of {list(FAULTS)} or None")
        self.capabilities = BackendCapabilities(**{**_DEFAULT_CAPABILITIES, **capabilities, "name": name})
        self.fault = fault
        self.available = available
        self.probe_reason = probe_reason
        self._delegate_spec = delegate if delegate is not None else "cpu_ref"
        self._delegate: Optional[object] = None
        self.calls: list[Call] = []
        self.allocated: list[TopkBuffer] = []

    # -- bookkeeping ----------------------------------------------------------------
    def calls_to(self, hook: str) -> list[Call]:
        """The recorded calls of one hook."""
        return [c for c in self.calls if c.hook == hook]

    def reset(self) -> None:
        """Forget recorded calls and allocated buffers."""
        self.calls.clear()
        self.allocated.clear()

    def _record(self, hook: str, **args: Any) -> None:
        self.calls.append(Call(hook, args))

    # A method, not a property: pluggy getattr()s every attribute of a plugin
    # at registration, which would resolve the delegate eagerly.
    def resolve_delegate(self) -> object:
        """The object doing the math (loaded on first use, then cached)."""
        if self._delegate is None:
            spec = self._delegate_spec
            self._delegate = _load_entry_point(spec) if isinstance(spec, str) else spec
        return self._delegate

    def _delegate_capabilities(self) -> Optional[BackendCapabilities]:
        """The delegate's declaration, when it has one (a plugin, or a bound backend)."""
        d = self.resolve_delegate()
        caps = getattr(d, "capabilities", None)
        if caps is None and callable(getattr(d, "backend_capabilities", None)):
            caps = d.backend_capabilities()  # type: ignore[attr-defined]
        return caps if isinstance(caps, BackendCapabilities) else None

    def _for_delegate(self, buf: TopkBuffer) -> Optional[str]:
        """The layout ``buf`` must be converted to before the delegate accepts it, or None."""
        caps = self._delegate_capabilities()
        if caps is None or caps.accepts_topk(buf.layout, buf.is_dense()):
            return None
        return caps.topk_layout

    # -- hooks ----------------------------------------------------------------------------
    @hookimpl
    def backend_capabilities(self) -> BackendCapabilities:
        self._record("backend_capabilities")
        return self.capabilities

    @hookimpl
    def backend_probe(self, device: torch.device) -> Probe:
        self._record("backend_probe", device=device)
        return Probe.yes(self.probe_reason) if self.available else Probe.no(self.probe_reason)

    @hookimpl
    def alloc_topk_buffer(self, num_tokens: int, num_heads: int, topk: int,
                          device: torch.device) -> TopkBuffer:
        self._record("alloc_topk_buffer", num_tokens=num_tokens, num_heads=num_heads, topk=topk,
                     device=device)
        layout = self.capabilities.topk_layout
        if self.fault == "wrong_layout":
            # Memory laid out in the other order, labelled as the declared one: TopkBuffer
            # refuses it unless one head makes both orders the same memory map.
            real = TopkBuffer.allocate(num_tokens, num_heads, topk, _other(layout), device)
            buf = TopkBuffer._wrap(real.storage.permute(1, 0, 2), layout)
        else:
            buf = TopkBuffer.allocate(num_tokens, num_heads, topk, layout, device)
        self.allocated.append(buf)
        return buf

    @hookimpl
    def index_topk(self, index_q: torch.Tensor, caches: PagedKVCache, batch: BatchMetadata,
                   params: SparseAttentionParams, out: TopkBuffer) -> None:
        self._record("index_topk", index_q=index_q, caches=caches, batch=batch, params=params, out=out)
        T = batch.num_tokens
        if self._faulted("index_topk", out.head_major()[:, : (T + 1) // 2]):
            return
        need = self._for_delegate(out)
        if self.fault == "wrong_layout" or need is not None:
            scratch = TopkBuffer.allocate(T, out.num_heads, out.topk, need or out.layout, out.device)
            self.resolve_delegate().index_topk(index_q, caches, batch, params, scratch)  # type: ignore[attr-defined]
            if self.fault == "wrong_layout":
                self._write_as_dense(scratch, out.rows(0, T), self.capabilities.topk_layout)
            else:
                out.rows(0, T).copy_(scratch)
        else:
            self.resolve_delegate().index_topk(index_q, caches, batch, params, out)  # type: ignore[attr-defined]
        if self.capabilities.topk_order == "ascending" and self.fault != "unordered":   # what it declares
            sort_ascending_(out.rows(0, T))
        if self.fault == "out_of_range":
            real = (batch.token_positions >= 0).nonzero()
            if real.numel():
                t = int(real[0, 0])
                out.head_major()[0, t, 0] = int(batch.token_positions[t]) // params.block_size + 1
        elif self.fault == "write_past_rows":
            for full in self.allocated:
                if _same_memory(full.storage, out.storage) and full.num_tokens > T:
                    full.head_major()[:, T:] = 0

    def _faulted(self, hook: str, first_half: torch.Tensor) -> bool:
        """Inject ``"raise"`` (write :data:`GARBAGE` into ``first_half``, raise) or ``"no_write"`` (True)."""
        if self.fault == "raise":
            first_half.fill_(GARBAGE)
            raise MockFault(f"mock backend {self.capabilities.name!r}: injected fault in {hook}")
        return self.fault == "no_write"

    @staticmethod
    def _write_as_dense(src: TopkBuffer, out: TopkBuffer, layout: str) -> None:
        """Write ``src`` the way a kernel assuming a dense ``layout`` buffer would.

        The target addresses are those of a contiguous ``layout`` tensor starting
        at ``out``'s first element, whatever ``out``'s real layout and strides
        are. They stay inside ``out``'s allocation because a step's rows never
        exceed its capacity.
        """
        dense = src.to_layout(layout).storage
        s = out.storage
        torch.as_strided(s, dense.shape, dense.stride(), s.storage_offset()).copy_(dense)

    @hookimpl
    def attention_forward(self, q: torch.Tensor, caches: PagedKVCache, topk: TopkBuffer,
                          batch: BatchMetadata, params: SparseAttentionParams,
                          out: torch.Tensor) -> None:
        self._record("attention_forward", q=q, caches=caches, topk=topk, batch=batch, params=params,
                     out=out)
        if self._faulted("attention_forward", out[: (batch.num_tokens + 1) // 2]):
            return
        if self.capabilities.topk_order_required == "ascending" and batch.num_tokens and \
                not bool(is_ascending(topk.rows(0, batch.num_tokens).storage).all()):
            raise AssertionError(f"mock backend {self.capabilities.name!r} declares topk_order_required="
                                 f"'ascending' and was handed rows that are not: {topk.head_major().tolist()}")
        need = self._for_delegate(topk)
        if need is not None:
            topk = topk.to_layout(need)
        self.resolve_delegate().attention_forward(q, caches, topk, batch, params, out)  # type: ignore[attr-defined]
        T = batch.num_tokens
        if self.fault == "nan_output" and T > 0:
            out[T - 1] = float("nan")

    def __repr__(self) -> str:
        c = self.capabilities
        return (f"MockBackend({c.name!r}, topk_layout={c.topk_layout!r}, ops={sorted(c.ops)}, "
                f"fault={self.fault!r})")
