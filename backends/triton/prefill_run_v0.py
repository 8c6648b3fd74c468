"""The previous run kernel of the block-grouped prefill attention, kept to time it beside the current one.

``PrefillAttentionConfig(run_v0=True)`` (bench variant ``prun0``) selects it.
It differs from :func:`.prefill_attention._block_run_kernel` only in where its
numbers go and how it addresses them: each row's partial goes to the pair's
flat slot ``(h * Tc + t) * K + k`` (a 64-bit address per row, from the slot
loaded from the plan; the token is ``slot // K % Tc``), and the K/V strides
inside a page are runtime arguments. Triton 3.6 spills it on sm_90 (255
registers, 88-256 B of stack). The arithmetic is the same, so both give the
same bits. Remove it once the two are timed (benchmarks/NOTES.md §5).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .attention import online_softmax_step
from .prefill_attention import _run_keys
from .tiles import load_query_rows, score_scale
from .tl_utils import kv_scale

__all__: list[str] = []


@triton.jit
def _block_run_v0_kernel(
    q_ptr, s_qt, s_qh, s_qd, k_ptr, s_kp, s_kb, s_kh, s_kd, v_ptr, s_vp, s_vb, s_vh, s_vd,
    pos_ptr, run_seg_ptr, run_page_ptr, run_slot_ptr, run_pairs_ptr, num_runs_ptr, ws_o_ptr, ws_lse_ptr,
    tok0, Tc, nb_max, num_req, G, qk_scale, ks_ptr, s_ks, vs_ptr, s_vs,
    B: tl.constexpr, D: tl.constexpr, K: tl.constexpr, ROWS: tl.constexpr, M: tl.constexpr, RUN: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, STAGES: tl.constexpr = 4, KV_SCALED: tl.constexpr = False,
    SCALE_Q: tl.constexpr = False,
):
    """Runs ``program_id, program_id + programs, ...`` as the current kernel walks them; partials at
    the pairs' flat slots."""
    rows = tl.arange(0, ROWS)
    mi = rows // G
    gi = rows % G
    offs_d = tl.arange(0, D)
    for i in tl.range(tl.program_id(0), tl.load(num_runs_ptr), tl.num_programs(0), num_stages=1):
        seg = tl.load(run_seg_ptr + i)
        page = tl.load(run_page_ptr + i).to(tl.int64)
        n = tl.load(run_pairs_ptr + i)
        b = seg % nb_max
        h = seg // nb_max // num_req
        k_page = k_ptr + page * s_kp + h * s_kh
        v_page = v_ptr + page * s_vp + h * s_vh
        keys_t, vals = _run_keys(k_page, v_page, s_kb, s_kd, s_vb, s_vd, B, D, DOT_DTYPE)
        run_qk_scale = qk_scale * kv_scale(ks_ptr, h, s_ks, KV_SCALED)
        v_scale = kv_scale(vs_ptr, h, s_vs, KV_SCALED)
        key_pos = b * B + tl.arange(0, B)
        for r in tl.range(0, tl.cdiv(n, M), num_stages=STAGES):
            slot = tl.load(run_slot_ptr + i * (M * RUN) + r * M + mi, mask=mi < M, other=-1).to(tl.int64)
            row_ok = slot >= 0
            tok = tok0 + (slot // K) % Tc
            pos = tl.load(pos_ptr + tok, mask=row_ok, other=-1)
            q, undo = load_query_rows(q_ptr, tok, h * G + gi, s_qt, s_qh, s_qd, row_ok, D, DOT_DTYPE, SCALE_Q)
            s = tl.where(row_ok[:, None] & (key_pos[None, :] <= pos[:, None]),
                         tl.dot(q, keys_t, input_precision=DOT_PREC) * score_scale(run_qk_scale, undo, SCALE_Q),
                         float("-inf"))
            m_i, l_i, acc = online_softmax_step(s, vals, tl.full([ROWS], float("-inf"), tl.float32),
                                                tl.zeros([ROWS], tl.float32), tl.zeros([ROWS, D], tl.float32),
                                                DOT_DTYPE, DOT_PREC)
            l_safe = tl.where(l_i > 0, l_i, 1.0)
            part = slot * G + gi
            tl.store(ws_o_ptr + part[:, None] * D + offs_d[None, :],
                     (acc * (v_scale / l_safe)[:, None]).to(ws_o_ptr.dtype.element_ty), mask=row_ok[:, None])
            tl.store(ws_lse_ptr + part, m_i + tl.log2(l_safe), mask=row_ok)
