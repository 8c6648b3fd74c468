"""What the per-call shortcuts of the custom ops and the drop-ins keep, and what they must not lose.

Each shortcut saves host time on every call; each test here fails if its shortcut answers
from less than it reads (a kept value of other tensors' facts), calls a hook with other
arguments than the spec's, or leaves gradients on.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from mm3.contract.caches import PagedKVCache
from mm3.contract.facts import _cache_facts, cache_facts
from mm3.integrations.no_grad import without_grad
from mm3.integrations.targets import Made
from mm3.plugin import hookimpl
from mm3.runtime.registry import Registry
from mm3.testing.factories import make_case
from mm3.testing.helpers import default_params

_CASE = make_case(default_params(), decodes=[40], dtype="float32", seed=0)
_TOPK = torch.empty(_CASE.params.num_kv_heads, _CASE.batch.num_tokens, _CASE.params.topk, dtype=torch.int32)
_SPEC_ORDER = (_CASE.index_q, _CASE.caches, _CASE.batch, _CASE.params, _TOPK)


class _Picky:
    """Hookimpls that take one argument of the spec's, or some of them with a default."""

    got: dict[str, Any]

    def __init__(self) -> None:
        self.got = {}

    @hookimpl
    def backend_capabilities(self) -> dict[str, Any]:
        return dict(name="picky", ops=["index_topk", "attention"], device_types=["cpu"], topk_layout="head_major")

    @hookimpl
    def index_topk(self, batch):   # type: ignore[no-untyped-def]
        self.got["index_topk"] = (batch,)

    @hookimpl
    def attention_forward(self, out, q, topk=None):   # type: ignore[no-untyped-def]
        self.got["attention_forward"] = (out, q, topk)


def test_a_hookimpl_of_one_spec_argument_or_with_defaults_gets_exactly_the_ones_it_names() -> None:
    plugin = _Picky()
    be = Registry([plugin], entry_points=False).get("picky")
    be.calls["index_topk"](*_SPEC_ORDER, None)          # as a step calls it: the spec's order, page_faults last
    assert len(plugin.got["index_topk"]) == 1 and plugin.got["index_topk"][0] is _CASE.batch
    out = torch.empty_like(_CASE.q)
    be.calls["attention"](_CASE.q, _CASE.caches, "the top-k", _CASE.batch, _CASE.params, out)
    got = plugin.got["attention_forward"]
    assert got[0] is out and got[1] is _CASE.q and got[2] == "the top-k"


def _variants(c: PagedKVCache) -> list[tuple[torch.Tensor, ...]]:
    """The cache's tensors, and each of them in turn replaced by one of another shape, dtype or role."""
    base = (c.k, c.v, c.index)
    other = {"shape": lambda t: t[:-1], "dtype": lambda t: t.to(torch.float16), "narrow": lambda t: t[..., :2]}
    out = [base]
    for i, change in itertools.product(range(3), other.values()):
        out.append(tuple(change(t) if j == i else t for j, t in enumerate(base)))
    return out


@pytest.mark.parametrize("scales", [False, True])
def test_cache_facts_are_kept_by_every_tensor_they_read(scales: bool) -> None:
    c = _CASE.caches
    s = (torch.ones(c.num_kv_heads), torch.full((c.num_kv_heads,), 2.0)) if scales else (None, None)
    seen: dict[Any, Any] = {}
    for k, v, index in _variants(c):
        for ks, vs in ((s[0], s[1]), (s[0], None), (None, s[1]), (s[0][:1] if scales else None, s[1])):
            got = cache_facts(k, v, index, ks, vs)
            assert got == _cache_facts(k, v, index, ks, vs, None, None, None)    # the same value as made anew
            assert cache_facts(k, v, index, ks, vs) is got                      # and the same object again
            seen.setdefault(got, got)
    assert len(seen) >= 10   # the variants are facts of their own (each equal to its facts made anew, above)


def test_block_scales_are_part_of_what_cache_facts_are_kept_by() -> None:
    c = _CASE.caches
    scale = torch.zeros(*c.k.shape[:-1], 2, dtype=torch.float8_e4m3fn)
    plain = cache_facts(c.k, c.v, c.index, None, None)
    scaled = cache_facts(c.k, c.v, c.index, None, None, scale, scale, None)
    assert plain.k_block_scale is None and scaled.k_block_scale is not None
    assert scaled == _cache_facts(c.k, c.v, c.index, None, None, scale, scale, None)


def test_without_grad_turns_gradients_off_only_where_they_are_on() -> None:
    seen = []

    @without_grad
    def op(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch.is_grad_enabled())
        return x * 2

    x = torch.ones(3, requires_grad=True)
    assert not op(x).requires_grad and seen == [False] and torch.is_grad_enabled()
    with torch.inference_mode():
        op(torch.ones(3))
    with torch.no_grad():
        op(x)
    assert seen == [False, False, False] and torch.is_grad_enabled()
    assert op.__name__ == "op"


def test_a_kept_choice_key_is_equal_by_value_and_hashed_once() -> None:
    calls = []

    class Counted:
        def __hash__(self) -> int:
            calls.append(1)
            return 7

        def __eq__(self, other: object) -> bool:
            return isinstance(other, Counted)

    made, again = Made((Counted(), "req", "cpu")), Made((Counted(), "req", "cpu"))
    assert len(calls) == 2          # each hashed its value once, when made
    table = {made: 1}
    for _ in range(3):
        assert table[made] == 1 and table[again] == 1 and hash(made) == hash(again)
    assert len(calls) == 2          # and no lookup hashed a value again
    assert Made((1, "req", "cpu")) != Made((2, "req", "cpu")) and Made((1,)) != (1,)
