"""LoRA on the experts, unmaterialized: the low-rank segment of the grouped GEMMs and the per-pair projection.

A leaf (imports only Triton). LoRA on an experts projection W [E, out, in] adds s * B_e @ A_e
per expert, A [E, r, in], B [E, out, r]; the kernels never form it. Per pair p of expert e:

- `_experts_project_kernel`, one program per block of pairs (`experts_routing.expert_blocks`):
  out[p, :r] = SCALE * src[row(p)] @ M_e^T, with M_e [r, n] read through strides (so A_e, or
  B_e^T, as they lie in PEFT's weights), src rows gathered by token (p // TOP_K) or by pair;
  fp32 accumulation, one rounding to out's dtype. Rows of padding and sentinel pairs are not
  written. This gives x_lr = s x A^T, h_lr = s h A_d^T (forward) and s dOut B_d, s dP B
  (backward): [S, r] each.
- `low_rank_segment`: acc [BLOCK_M, cols] += lr[rows, :R] @ M_e[:R, cols] in fp32, the r more K
  steps a grouped GEMM runs after its main loop ([x | x_lr] against [W | B]), so its epilogue
  sees the whole pre-activation.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def low_rank_segment(acc, lr_ptr, rows, mask_m, stride_lm, m_ptr, stride_mr, stride_mc, cols, mask_c, R,
                     BLOCK_R: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """acc + lr[rows, :R] @ M[:R, cols] (fp32): lr [S, R] rows by pair; m_ptr at the expert's M."""
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    lr = tl.load(lr_ptr + rows[:, None] * stride_lm + offs_r[None, :],
                 mask=mask_m[:, None] & mask_r[None, :], other=0.0)  # [BLOCK_M, BLOCK_R]
    m = tl.load(m_ptr + offs_r[:, None] * stride_mr + cols.to(tl.int64)[None, :] * stride_mc,
                mask=mask_r[:, None] & mask_c[None, :], other=0.0)  # [BLOCK_R, BLOCK_COLS]
    return tl.dot(lr.to(m.dtype), m, acc, input_precision=INPUT_PRECISION)


@triton.jit
def _experts_project_kernel(
    src_ptr, pairs_ptr, blocks_ptr, m_ptr, out_ptr,
    NUM_PAIRS, N, R, NUM_EXPERTS, SCALE,
    stride_sm, stride_sn, stride_me, stride_mr, stride_mn, stride_om,
    TOP_K: tl.constexpr, BY_TOKEN: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    expert = tl.load(blocks_ptr + pid)
    if expert < NUM_EXPERTS:
        pairs = tl.load(pairs_ptr + pid * BLOCK_M + tl.arange(0, BLOCK_M))
        mask_m = pairs < NUM_PAIRS
        rows = pairs.to(tl.int64)
        src_rows = rows // TOP_K if BY_TOKEN else rows
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        offs_k = tl.arange(0, BLOCK_K)
        s_ptrs = src_ptr + src_rows[:, None] * stride_sm + offs_k[None, :] * stride_sn  # [BLOCK_M, BLOCK_K]
        m_ptrs = (m_ptr + expert.to(tl.int64) * stride_me + offs_r[None, :] * stride_mr
                  + offs_k[:, None].to(tl.int64) * stride_mn)  # [BLOCK_K, BLOCK_R]
        # -- main loop over n: src[row] @ M_e^T, fp32 --
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k in range(0, tl.cdiv(N, BLOCK_K)):
            k_left = N - k * BLOCK_K
            s = tl.load(s_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
            m = tl.load(m_ptrs, mask=(offs_k[:, None] < k_left) & mask_r[None, :], other=0.0)
            acc = tl.dot(s.to(m.dtype), m, acc, input_precision=INPUT_PRECISION)
            s_ptrs += BLOCK_K * stride_sn
            m_ptrs += BLOCK_K * stride_mn
        out_ptrs = out_ptr + rows[:, None] * stride_om + offs_r[None, :]  # [BLOCK_M, BLOCK_R]
        tl.store(out_ptrs, (acc * SCALE).to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_r[None, :])


def block_r(rank: int) -> int:
    """The low-rank segment's tile along r: a power of two, at least 16 (tl.dot's least K)."""
    return max(16, triton.next_power_of_2(rank))
