"""The shape and policy parameters of one sparse-attention layer (docs/spec.md §1).

Example:
    >>> p = SparseAttentionParams.minimax_m3(tp_size=8)
    >>> (p.num_heads, p.num_kv_heads, p.num_index_heads, p.gqa_group)
    (8, 1, 1, 8)
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mm3.contract.errors import InputError, describe_validation_error

__all__ = ["SparseAttentionParams", "MINIMAX_M3_MAX_DECODE_QUERY_LEN"]

MINIMAX_M3_MAX_DECODE_QUERY_LEN = 8


class SparseAttentionParams(BaseModel):
    """Head counts, sizes and block-selection policy of a sparse-attention layer.

    ``num_index_heads`` must equal ``num_kv_heads``: index head ``h`` selects
    blocks for KV head ``h``. ``scale`` defaults to ``head_dim ** -0.5``.
    ``index_scale`` is an optional positive factor on index scores; it never
    changes the ranking (docs/spec.md §3.2), so backends may ignore it.

    Example:
        >>> p = SparseAttentionParams(num_heads=16, num_kv_heads=2, head_dim=64, num_index_heads=2,
        ...                           index_head_dim=64, block_size=64, topk=8)
        >>> p.gqa_group, p.softmax_scale, p.local_blocks
        (8, 0.125, 1)
        >>> SparseAttentionParams.minimax_m3(tp_size=2).num_heads      # MiniMax-M3's shapes per TP rank
        32
        >>> SparseAttentionParams.MINIMAX_M3_MAX_DECODE_QUERY_LEN       # its longest decode: 1 + 7 drafts
        8
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    #: the longest decode query MiniMax-M3 runs (1 + draft tokens): a GPU backend's natural
    #: ``max_decode_query_len`` (plugins read it here, through :mod:`mm3.plugin`)
    MINIMAX_M3_MAX_DECODE_QUERY_LEN: ClassVar[int] = MINIMAX_M3_MAX_DECODE_QUERY_LEN

    num_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    num_index_heads: int = Field(gt=0)
    index_head_dim: int = Field(gt=0)
    block_size: int = Field(128, gt=0)
    topk: int = Field(16, gt=0)
    init_blocks: int = Field(0, ge=0)
    local_blocks: int = Field(1, ge=0)
    scale: Optional[float] = Field(None, gt=0)
    index_scale: float = Field(1.0, gt=0)

    def __init__(self, **values: Any) -> None:
        # pydantic's ValidationError is not an mm3 error; every mm3 rejection is
        # (InputError is still a ValueError, as ValidationError was).
        try:
            super().__init__(**values)
        except ValidationError as e:
            raise InputError("invalid SparseAttentionParams: "
                             + describe_validation_error(e, fields=list(type(self).model_fields))) from None

    @model_validator(mode="after")
    def _consistent(self) -> "SparseAttentionParams":
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.num_index_heads != self.num_kv_heads:
            raise ValueError(
                f"num_index_heads ({self.num_index_heads}) must equal num_kv_heads "
                f"({self.num_kv_heads}): index head h selects blocks for KV head h")
        if self.init_blocks + self.local_blocks > self.topk:
            raise ValueError(
                f"init_blocks ({self.init_blocks}) + local_blocks ({self.local_blocks}) exceed topk "
                f"({self.topk}): forced blocks would not fit")
        return self

    @property
    def gqa_group(self) -> int:
        """Query heads per KV head (G = Hq / Hkv)."""
        return self.num_heads // self.num_kv_heads

    @property
    def softmax_scale(self) -> float:
        """``scale`` or its default ``head_dim ** -0.5``."""
        return self.scale if self.scale is not None else self.head_dim ** -0.5

    @classmethod
    def minimax_m3(cls, tp_size: int = 1, **overrides: object) -> "SparseAttentionParams":
        """MiniMax-M3's per-rank shapes at tensor-parallel size ``tp_size`` (1, 2, 4 or 8).

        Query heads are sharded (64 / tp); the 4 KV and index heads are sharded
        down to one per rank and replicated beyond that.
        """
        if tp_size not in (1, 2, 4, 8):
            raise InputError(f"MiniMax-M3 runs at tp_size 1, 2, 4 or 8, got {tp_size}")
        kv = max(1, 4 // tp_size)
        base: dict[str, object] = dict(num_heads=64 // tp_size, num_kv_heads=kv, head_dim=128,
                                       num_index_heads=kv, index_head_dim=128, block_size=128,
                                       topk=16, init_blocks=0, local_blocks=1)
        base.update(overrides)
        return cls(**base)  # type: ignore[arg-type]
