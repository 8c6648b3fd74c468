"""What a backend declares it can do, and what a call needs.

A backend never tells the core which platform it is; it declares capabilities
(this module) and answers a probe. The core compares a :class:`Requirements`
object with each backend's :class:`BackendCapabilities` and keeps the reasons
for every mismatch, so selection can explain itself.

Torch types stay out of these models: dtypes and devices are strings, so the
models serialise, compare and print without importing torch.

Example:
    >>> caps = BackendCapabilities(
    ...     name="my_backend", ops={"index_topk", "attention"},
    ...     device_types={"cpu"}, topk_layout="token_major")
    >>> req = Requirements(device_type="cpu", ops={"attention"}, dtype="bfloat16",
    ...     index_cache_dtype="bfloat16", head_dim=128, index_head_dim=128,
    ...     block_size=128, topk=16, gqa_group=8, decode_query_len=1)
    >>> caps.unmet(req)
    []
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mm3.contract.hookspecs import INDEX_OPS, STEP_OPS, Op

__all__ = [
    "TopkLayout",
    "TopkOrder",
    "KVCacheLayout",
    "DType",
    "IndexDType",
    "KVDType",
    "QueryDType",
    "Addressing",
    "BackendCapabilities",
    "Requirements",
    "Probe",
]

TopkLayout = Literal["head_major", "token_major"]
"""Storage order of a top-k buffer: ``head_major`` = [H, T, K], ``token_major`` = [T, H, K]."""

TopkOrder = Literal["score", "ascending"]
"""The order of the valid ids in a top-k row: ``score`` = as the selection ranked them, highest score first
(or any order not promised to be ascending); ``ascending`` = increasing ids. ``-1`` follows them either way."""

KVCacheLayout = Literal["NHD", "HND"]
"""Storage order inside one KV page: tokens-then-heads (NHD) or heads-then-tokens (HND)."""

DType = Literal["bfloat16", "float16", "float32"]
IndexDType = Literal["bfloat16", "float16", "float32", "float8_e4m3fn", "nvfp4"]
KVDType = Literal["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fn_unscaled", "nvfp4"]
"""A K/V cache format: the attention dtype, fp8 (``float8_e4m3fn``, ``float8_e5m2``) with scales, e4m3
without a scale (``float8_e4m3fn_unscaled``) or ``nvfp4`` (docs/spec.md §1, :mod:`mm3.contract.quant`).
A backend lists each quantized format it reads: one it does not list is passed over."""
Addressing = Literal["pages", "slots"]
"""How a batch finds the cache row of a request's token (docs/spec.md §2): ``pages`` = through its block
table, ``block_table[r, pos // block_size]`` is the page holding ``block_size`` consecutive positions;
``slots`` = through a slot table, ``slot_table[slot_rows[r], pos]`` is the token's own row of a cache of
one-token pages (SGLang's ``req_to_token`` with ``--page-size 1``)."""
QueryDType = Literal["float8_e4m3fn"]
"""A query dtype besides the attention dtypes: fp8 e4m3 queries, no scale (the output is ``out``'s dtype)."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class BackendCapabilities(_Frozen):
    """A backend's static declaration of what it computes and how it wants data.

    ``None`` in a limit field means "no limit". ``frozenset`` fields accept any
    iterable. Validation errors name the offending field, and the registry
    reports them with the plugin's distribution. Each field's ``description``
    is what ``mm3 backends --json`` and docs/spec.md §7 show.

    Example:
        >>> caps = BackendCapabilities(name="mine", ops={"attention"}, device_types={"cuda"},
        ...                            topk_layout="token_major", max_decode_query_len=4)
        >>> caps.priority, sorted(caps.dtypes), caps.cuda_graph_safe
        (0, ['bfloat16', 'float16', 'float32'], False)
        >>> BackendCapabilities.model_fields["max_decode_query_len"].description
        'the longest decode query it handles: 1 + draft tokens of speculative decoding'
    """

    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
                      description="the unique name users select it by (MM3_BACKEND=name); an identifier")
    description: str = Field("", description="one line for humans, shown by mm3 backends")
    priority: int = Field(0, description="auto selection tries higher priorities first (cpu_ref 0, the GPU "
                                         "backends 100)")
    device_types: frozenset[str] = Field(min_length=1, description='torch device types it runs on, e.g. {"cuda"}')
    ops: frozenset[Op] = Field(min_length=1, description='the ops it implements: "index_topk", "attention" or '
                                                         'both, and optionally "index_scores" (block scores); each '
                                                         'needs its hook')
    topk_layout: TopkLayout = Field(description="the top-k buffer layout it allocates and prefers: head_major "
                                                "[H, T, K] or token_major [T, H, K]")
    topk_requires_contiguous: bool = Field(
        False, description="its hooks read raw storage: hand them a dense buffer in topk_layout (the core "
                           "converts another one each step)")
    topk_order: TopkOrder = Field(
        "score", description="the order index_topk writes a row's ids in: score (highest score first, or no "
                             "promise) or ascending (increasing ids); -1 last either way")
    topk_order_required: Optional[Literal["ascending"]] = Field(
        None, description="the order attention_forward needs a row's ids in: None = any (a row is a set), "
                          "ascending = increasing ids, -1 last (the core sorts rows written in another order)")
    kv_cache_layout: KVCacheLayout = Field("NHD", description="the KV page layout it is fastest on, NHD or HND "
                                                              "(both must work)")
    dtypes: frozenset[DType] = Field(frozenset({"bfloat16", "float16", "float32"}),
                                     description="attention dtypes of q, out and 16-bit K/V caches")
    index_cache_dtypes: frozenset[IndexDType] = Field(frozenset({"bfloat16", "float8_e4m3fn"}),
                                                      description="index cache dtypes the indexer reads (nvfp4: "
                                                                  "packed e2m1 with per-16 e4m3 scales)")
    kv_cache_dtypes: frozenset[KVDType] = Field(
        frozenset({"bfloat16", "float16", "float32"}),
        description="K/V cache formats the attention reads; float8_e4m3fn and float8_e5m2 = scaled fp8, "
                    "float8_e4m3fn_unscaled = e4m3 without a scale, nvfp4 = packed e2m1 with per-16 e4m3 "
                    "scales: each declared on its own")
    query_dtypes: frozenset[QueryDType] = Field(
        frozenset(), description="query dtypes it reads besides its attention dtypes: float8_e4m3fn = fp8 "
                                 "queries without a scale, the output in out's dtype")
    head_dims: Optional[frozenset[int]] = Field(None, description="attention head dims it supports; None = any")
    index_head_dims: Optional[frozenset[int]] = Field(None, description="index head dims it supports; None = any")
    block_sizes: Optional[frozenset[int]] = Field(None, description="KV page (= sparse block) sizes it supports; "
                                                                    "None = any")
    max_topk: Optional[int] = Field(None, ge=1, description="the most blocks per token it selects or reads; "
                                                            "None = no limit")
    max_gqa_group: Optional[int] = Field(None, ge=1, description="the most query heads per KV head it attends "
                                                                 "with; None = no limit")
    max_decode_query_len: int = Field(1, ge=1, description="the longest decode query it handles: 1 + draft "
                                                           "tokens of speculative decoding")
    cuda_graph_safe: bool = Field(False, description="a decode step through it can be captured in a CUDA graph "
                                                     "and replayed")
    kv_slot_scales: bool = Field(
        False, description="the attention reads fp8 K/V scales per KV head and token slot ([Hkv, num_pages * "
                           "block_size], vLLM's per-token layout) besides per-tensor and per-head [Hkv] ones")
    addressings: frozenset[Addressing] = Field(
        frozenset({"pages"}), description="how its hooks find a token's cache row: pages = through the block "
                                          "table (every backend), slots = through a slot table per token "
                                          "(BatchMetadata.slot_table / slot_rows, one-token cache pages)")
    reports_bad_page_ids: bool = Field(
        False, description="index_topk clamps every block-table entry it loads into the cache and lowers its "
                           "page_faults word to a bad one it meets (mm3.contract.page_ids), so the layer "
                           "runs no page-id check of its own on device tables")
    judges_contents: bool = Field(
        False, description="index_topk, handed the layer's page_faults word, also judges the batch's contents "
                           "into it (the rules of check_contents, docs/errors.md §2.6), so the layer makes no "
                           "check_contents call before it; needs reports_bad_page_ids")

    @model_validator(mode="after")
    def _judging_needs_the_word(self) -> "BackendCapabilities":
        if self.judges_contents and not self.reports_bad_page_ids:
            raise ValueError("judges_contents needs reports_bad_page_ids: index_topk is handed the page_faults "
                             "word only then; declare both, or neither")
        return self

    def accepts_topk(self, layout: str, dense: bool) -> bool:
        """Can this backend's hooks use a top-k buffer in ``layout`` (``dense`` or not) as it is?

        Always, unless it declares ``topk_requires_contiguous``: then only a
        dense buffer in its own ``topk_layout``. The one rule behind the core's
        per-step conversion, the selection trace, the bound backend's argument
        check, the guard, the mock backend and the conformance suite.

        Example:
            >>> strict = BackendCapabilities(name="strict", ops={"attention"}, device_types={"cpu"},
            ...                              topk_layout="token_major", topk_requires_contiguous=True)
            >>> strict.accepts_topk("token_major", dense=True), strict.accepts_topk("head_major", dense=True)
            (True, False)
            >>> strict.accepts_topk("token_major", dense=False)
            False
        """
        return not self.topk_requires_contiguous or (layout == self.topk_layout and dense)

    def unmet(self, req: "Requirements") -> list[str]:
        """Every reason this backend cannot serve ``req`` (empty list = capable)."""
        reasons: list[str] = []
        if req.device_type not in self.device_types:
            reasons.append(f"device type {req.device_type!r} not in {sorted(self.device_types)}")
        missing = set(req.ops) - set(self.ops)
        if missing:
            reasons.append(f"does not provide op(s) {sorted(missing)} (provides {sorted(self.ops)})")
        if Op.ATTENTION in req.ops and req.dtype not in self.dtypes:
            reasons.append(f"dtype {req.dtype} not in {sorted(self.dtypes)}")
        if Op.ATTENTION in req.ops and req.query_dtype and req.query_dtype not in self.query_dtypes:
            reasons.append(f"cannot read {req.query_dtype} queries (query_dtypes {sorted(self.query_dtypes)})")
        kv = req.kv_cache_dtype or req.dtype
        if Op.ATTENTION in req.ops and kv not in self.kv_cache_dtypes:
            reasons.append(f"KV cache dtype {kv} not in {sorted(self.kv_cache_dtypes)} "
                           f"({_cannot_read(kv, self.kv_cache_dtypes)})")
        if Op.ATTENTION in req.ops and req.kv_slot_scales and not self.kv_slot_scales:
            reasons.append("cannot read K/V scales per token slot (k_scale/v_scale [Hkv, num_slots]): it "
                           "does not declare kv_slot_scales")
        if req.addressing not in self.addressings:
            reasons.append(f"cannot find tokens through {req.addressing} (it declares addressings "
                           f"{sorted(self.addressings)}): token slots, a slot table row per request with one "
                           f"cache row per token, need 'slots'")
        index = bool(INDEX_OPS & req.ops)
        if index and req.index_cache_dtype not in self.index_cache_dtypes:
            reasons.append(
                f"index cache dtype {req.index_cache_dtype} not in {sorted(self.index_cache_dtypes)}"
                + (" (cannot read an NVFP4 index cache)" if req.index_cache_dtype == "nvfp4" else ""))
        checks = [
            ("head_dim", req.head_dim, self.head_dims, Op.ATTENTION in req.ops),
            ("index_head_dim", req.index_head_dim, self.index_head_dims, index),
            ("block_size", req.block_size, self.block_sizes, True),
        ]
        for field, value, allowed, applies in checks:
            if applies and allowed is not None and value not in allowed:
                reasons.append(f"{field} {value} not in {sorted(allowed)}")
        # block scores select nothing: the top-k limit is the other ops'
        if self.max_topk is not None and req.topk > self.max_topk and STEP_OPS & req.ops:
            reasons.append(f"topk {req.topk} > max_topk {self.max_topk}")
        if (Op.ATTENTION in req.ops and self.max_gqa_group is not None
                and req.gqa_group > self.max_gqa_group):
            reasons.append(f"GQA group {req.gqa_group} > max_gqa_group {self.max_gqa_group}")
        if req.decode_query_len > self.max_decode_query_len:
            reasons.append(
                f"decode query length {req.decode_query_len} > max_decode_query_len "
                f"{self.max_decode_query_len}")
        if req.cuda_graph and not self.cuda_graph_safe:
            reasons.append("CUDA-graph capture requested but backend is not cuda_graph_safe")
        return reasons


def _cannot_read(kv: str, declared: frozenset[str]) -> str:
    """Why a backend declaring K/V cache dtypes ``declared`` cannot read a ``kv`` cache, in words."""
    if kv == "nvfp4":
        return "cannot read NVFP4 K/V (packed e2m1 with per-16 e4m3 scales)"
    if kv == "float8_e4m3fn_unscaled":
        return "cannot read e4m3 K/V without a scale"
    if not kv.startswith("float8_"):
        return "cannot read this K/V cache"
    formats = sorted(d for d in declared if d.startswith("float8_") and not d.endswith("_unscaled"))
    if formats:
        return f"cannot read {kv} K/V: of fp8 formats it reads {' and '.join(formats)} only"
    return "cannot read fp8 K/V with scales"


class Requirements(_Frozen):
    """What one use of the op needs; derived from params, device and dtypes.

    ``SparseAttention`` builds this for you; build it by hand only to ask
    the registry what would be chosen.
    """

    device_type: str
    ops: frozenset[Op] = STEP_OPS  # type: ignore[assignment]
    dtype: DType = "bfloat16"
    index_cache_dtype: IndexDType = "bfloat16"
    kv_cache_dtype: Optional[KVDType] = Field(None, description="None: the attention dtype")
    query_dtype: Optional[QueryDType] = Field(None, description="None: the attention dtype (fp8 queries: the "
                                                                "output is in the attention dtype)")
    kv_slot_scales: bool = Field(False, description="fp8 K/V scaled per KV head and token slot (not per tensor "
                                                    "or per head)")
    addressing: Addressing = Field("pages", description="how the batch finds a token's cache row: pages (a "
                                                         "block table) or slots (a slot table)")
    head_dim: int = 128
    index_head_dim: int = 128
    block_size: int = 128
    topk: int = 16
    gqa_group: int = 16
    decode_query_len: int = 1
    cuda_graph: bool = False

    def for_ops(self, *ops: str) -> "Requirements":
        """The same requirements restricted to ``ops`` (e.g. only ``Op.INDEX_TOPK``)."""
        return self.model_copy(update={"ops": frozenset(Op(op) for op in ops)})


class Probe(_Frozen):
    """The answer to "can this backend run on this device, here, now?".

    Example:
        >>> Probe.no("Triton is not installed (pip install triton)").available
        False
    """

    available: bool
    reason: str = ""
    auto: bool = Field(True, description="may auto selection pick it? False = only when named")

    @classmethod
    def yes(cls, reason: str = "available") -> "Probe":
        return cls(available=True, reason=reason)

    @classmethod
    def no(cls, reason: str) -> "Probe":
        return cls(available=False, reason=reason)

    @classmethod
    def named_only(cls, reason: str) -> "Probe":
        """Available, but only when asked for by name: ``auto`` passes it over.

        For test-only paths (a GPU backend under Triton's interpreter on the
        CPU) that work but that nobody should get by accident.
        """
        return cls(available=True, reason=reason, auto=False)
