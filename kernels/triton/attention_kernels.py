"""Flash attention in Triton, forward and backward.

q: (batch, heads, seq_q, head_dim); k, v: (batch, kv_heads, seq_k, head_dim), heads a multiple of
kv_heads (grouped-query). Causal masking is top-left aligned, as torch SDPA's `is_causal`. Any
sequence length (blocks are masked at the edges); head_dim up to 128 (non-powers of two such as
80 and 96 are padded inside the kernel). Scores, softmax statistics and accumulators are fp32;
the log-sum-exp of every row is kept for the backward pass, which recomputes the probabilities
block by block instead of storing them.

With document ids (packed sequences, `doc_ids` non-decreasing along the sequence) a query sees
only keys of its own document; a query block starts at the first key block holding its first
document and a key block stops at the last query of its last document, so blocks that share no
document are never visited (at 2k tokens of 8 documents, 1/8 of the causal work).

Backward runs as two kernels, one owning a block of keys (dK, dV: for grouped-query heads it
walks every query head of its group, so no atomics are needed), one owning a block of queries (dQ).

Under TRITON_INTERPRET=1 (CPU) the tiles are upcast to fp32 right after loading: the interpreter's
bf16 arithmetic is not faithful.
"""
import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read once: @triton.jit reads it too
LOG2E = 1.4426950408889634


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, DOC, KV_LO, qk_scale,
                s_qb, s_qh, s_qs, s_kb, s_kh, s_ks, s_vb, s_vh, s_vs, s_ob, s_oh, s_os,
                H, GROUP, SQ, SK, HEAD_DIM, NUM_M,
                CAUSAL: tl.constexpr, DOCS: tl.constexpr, UPCAST: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    kvh = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < SQ
    mask_d = offs_d < HEAD_DIM

    q = tl.load(Q + b * s_qb + h * s_qh + offs_m[:, None] * s_qs + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_base = K + b * s_kb + kvh * s_kh
    v_base = V + b * s_vb + kvh * s_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = SK
    if CAUSAL:
        hi = tl.minimum(SK, (pid_m + 1) * BLOCK_M)
    lo = 0
    if DOCS:  # key blocks before the first document of this query block are skipped
        lo = tl.load(KV_LO + b * NUM_M + pid_m)
        doc_q = tl.load(DOC + b * SQ + offs_m, mask=mask_m, other=-1)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        mask_n = cols < SK
        kt = tl.load(k_base + cols[None, :] * s_ks + offs_d[:, None],
                     mask=mask_n[None, :] & mask_d[:, None], other=0.0)  # (D, N)
        if UPCAST:
            kt = kt.to(tl.float32)
        s = tl.dot(q, kt) * qk_scale  # base-2 logits
        valid = mask_n[None, :]
        if CAUSAL:
            valid = valid & (cols[None, :] <= offs_m[:, None])
        if DOCS:
            doc_k = tl.load(DOC + b * SK + cols, mask=mask_n, other=-2)
            valid = valid & (doc_q[:, None] == doc_k[None, :])
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if DOCS:  # a row may see no key of this block yet (its document starts later): keep
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # exp2(-inf - -inf) from NaN
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * s_vs + offs_d[None, :],
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if DOCS:  # rows past the sequence's end saw no key (their document id matches none)
        l_i = tl.where(mask_m, l_i, 1.0)
    acc = acc / l_i[:, None]
    tl.store(LSE + pid_bh * SQ + offs_m, m_i + tl.log2(l_i), mask=mask_m)  # base 2
    tl.store(O + b * s_ob + h * s_oh + offs_m[:, None] * s_os + offs_d[None, :],
             acc.to(O.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DOC, Q_HI, qk_scale, sm_scale,
                     s_qb, s_qh, s_qs, s_kb, s_kh, s_ks, s_vb, s_vh, s_vs,
                     KVH, GROUP, SQ, SK, HEAD_DIM, NUM_N,
                     CAUSAL: tl.constexpr, DOCS: tl.constexpr, UPCAST: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One block of keys of one kv head; dO shares q's strides, dK/dV share k's."""
    pid_n = tl.program_id(0)
    pid_bkv = tl.program_id(1)
    b = pid_bkv // KVH
    kvh = pid_bkv % KVH
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_n = offs_n < SK
    mask_d = offs_d < HEAD_DIM
    kv_mask = mask_n[:, None] & mask_d[None, :]
    k = tl.load(K + b * s_kb + kvh * s_kh + offs_n[:, None] * s_ks + offs_d[None, :],
                mask=kv_mask, other=0.0)
    v = tl.load(V + b * s_vb + kvh * s_vh + offs_n[:, None] * s_vs + offs_d[None, :],
                mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    lo = 0
    if CAUSAL:
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M  # earlier queries see none of these keys
    hi = SQ
    if DOCS:  # queries past the last document of this key block see none of these keys
        hi = tl.load(Q_HI + b * NUM_N + pid_n)
        doc_k = tl.load(DOC + b * SK + offs_n, mask=mask_n, other=-2)
    for g in range(0, GROUP):
        h = kvh * GROUP + g
        q_base = Q + b * s_qb + h * s_qh
        do_base = DO + b * s_qb + h * s_qh
        row_base = (b * KVH * GROUP + h) * SQ
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + offs_m0
            mask_m = offs_m < SQ
            q_mask = mask_m[:, None] & mask_d[None, :]
            q = tl.load(q_base + offs_m[:, None] * s_qs + offs_d[None, :], mask=q_mask, other=0.0)
            do = tl.load(do_base + offs_m[:, None] * s_qs + offs_d[None, :], mask=q_mask,
                         other=0.0)
            if UPCAST:
                q = q.to(tl.float32)
                do = do.to(tl.float32)
            lse = tl.load(LSE + row_base + offs_m, mask=mask_m, other=0.0)
            delta = tl.load(DELTA + row_base + offs_m, mask=mask_m, other=0.0)
            p = tl.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse[:, None])  # (M, N)
            valid = mask_m[:, None] & mask_n[None, :]
            if CAUSAL:
                valid = valid & (offs_n[None, :] <= offs_m[:, None])
            if DOCS:
                doc_q = tl.load(DOC + b * SQ + offs_m, mask=mask_m, other=-1)
                valid = valid & (doc_q[:, None] == doc_k[None, :])
            p = tl.where(valid, p, 0.0)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do)
            dp = tl.dot(do, tl.trans(v))
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
    out = b * s_kb + kvh * s_kh + offs_n[:, None] * s_ks + offs_d[None, :]
    tl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, DOC, KV_LO, qk_scale, sm_scale,
                   s_qb, s_qh, s_qs, s_kb, s_kh, s_ks, s_vb, s_vh, s_vs,
                   H, GROUP, SQ, SK, HEAD_DIM, NUM_M,
                   CAUSAL: tl.constexpr, DOCS: tl.constexpr, UPCAST: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One block of queries of one head; dO and dQ share q's strides."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    kvh = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < SQ
    mask_d = offs_d < HEAD_DIM
    q_mask = mask_m[:, None] & mask_d[None, :]
    q_off = b * s_qb + h * s_qh + offs_m[:, None] * s_qs + offs_d[None, :]
    q = tl.load(Q + q_off, mask=q_mask, other=0.0)
    do = tl.load(DO + q_off, mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(LSE + pid_bh * SQ + offs_m, mask=mask_m, other=0.0)
    delta = tl.load(DELTA + pid_bh * SQ + offs_m, mask=mask_m, other=0.0)
    k_base = K + b * s_kb + kvh * s_kh
    v_base = V + b * s_vb + kvh * s_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = SK
    if CAUSAL:
        hi = tl.minimum(SK, (pid_m + 1) * BLOCK_M)
    lo = 0
    if DOCS:
        lo = tl.load(KV_LO + b * NUM_M + pid_m)
        doc_q = tl.load(DOC + b * SQ + offs_m, mask=mask_m, other=-1)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        mask_n = offs_n < SK
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_base + offs_n[:, None] * s_ks + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * s_vs + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        p = tl.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse[:, None])
        valid = mask_m[:, None] & mask_n[None, :]
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None])
        if DOCS:
            doc_k = tl.load(DOC + b * SK + offs_n, mask=mask_n, other=-2)
            valid = valid & (doc_q[:, None] == doc_k[None, :])
        p = tl.where(valid, p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    tl.store(DQ + q_off, (dq * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)


def _blocks(head_dim_block: int, backward: bool):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). Small blocks in the interpreter: its cost is
    per program and per op, and small blocks exercise the multi-block and edge paths in tests."""
    if INTERPRET:
        return 16, 16, 1, 1
    if backward:
        return 64, 64, 4 if head_dim_block <= 64 else 8, 2
    return 128, 64, 4 if head_dim_block <= 64 else 8, 3


def _strides(t):
    return t.stride(0), t.stride(1), t.stride(2)


def _key_starts(doc_ids, block_m: int, block_n: int):
    """(batch, query blocks) int32: per query block, the first key block (as a key index) that
    holds its first document; earlier keys belong to earlier documents only."""
    first_docs = doc_ids[:, ::block_m].contiguous()
    first_keys = torch.searchsorted(doc_ids, first_docs, right=False)
    return ((first_keys // block_n) * block_n).to(torch.int32).contiguous()


def _query_ends(doc_ids, block_n: int):
    """(batch, key blocks) int32: per key block, one past the last query of its last document."""
    seq = doc_ids.shape[1]
    last = torch.arange(block_n - 1, seq + block_n - 1, block_n, device=doc_ids.device).clamp(
        max=seq - 1)
    last_docs = doc_ids[:, last].contiguous()
    return torch.searchsorted(doc_ids, last_docs, right=True).to(torch.int32).contiguous()


def forward(q, k, v, causal: bool, sm_scale: float, doc_ids=None):
    """doc_ids: None, or (batch, seq) int32 non-decreasing (then seq_q == seq_k)."""
    B, H, SQ, D = q.shape
    KVH, SK = k.shape[1], k.shape[2]
    o = torch.empty_like(q)
    lse = torch.empty((B, H, SQ), device=q.device, dtype=torch.float32)
    BD = max(16, triton.next_power_of_2(D))
    BM, BN, warps, stages = _blocks(BD, backward=False)
    docs = doc_ids is not None
    kv_lo = _key_starts(doc_ids, BM, BN) if docs else lse  # any tensor: unread without DOCS
    grid = (triton.cdiv(SQ, BM), B * H)
    _fwd_kernel[grid](q, k, v, o, lse, doc_ids if docs else lse, kv_lo, sm_scale * LOG2E,
                      *_strides(q), *_strides(k), *_strides(v), *_strides(o), H, H // KVH, SQ,
                      SK, D, grid[0], CAUSAL=causal, DOCS=docs, UPCAST=INTERPRET, BLOCK_M=BM,
                      BLOCK_N=BN, BLOCK_D=BD, num_warps=warps, num_stages=stages)
    return o, lse


def backward(do, q, k, v, o, lse, causal: bool, sm_scale: float, doc_ids=None):
    B, H, SQ, D = q.shape
    KVH, SK = k.shape[1], k.shape[2]
    do = do.contiguous()
    # rowsum(dO * O): memory-bound and tiny next to the rest, torch does it well enough.
    delta = (do.float() * o.float()).sum(-1)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    BD = max(16, triton.next_power_of_2(D))
    BM, BN, warps, stages = _blocks(BD, backward=True)
    docs = doc_ids is not None
    common = dict(CAUSAL=causal, DOCS=docs, UPCAST=INTERPRET, BLOCK_M=BM, BLOCK_N=BN,
                  BLOCK_D=BD, num_warps=warps, num_stages=stages)
    strides = (*_strides(q), *_strides(k), *_strides(v))
    doc = doc_ids if docs else lse
    q_hi = _query_ends(doc_ids, BN) if docs else lse
    kv_lo = _key_starts(doc_ids, BM, BN) if docs else lse
    n_blocks, m_blocks = triton.cdiv(SK, BN), triton.cdiv(SQ, BM)
    _bwd_dkdv_kernel[(n_blocks, B * KVH)](
        q, k, v, do, lse, delta, dk, dv, doc, q_hi, sm_scale * LOG2E, sm_scale, *strides,
        KVH, H // KVH, SQ, SK, D, n_blocks, **common)
    _bwd_dq_kernel[(m_blocks, B * H)](
        q, k, v, do, lse, delta, dq, doc, kv_lo, sm_scale * LOG2E, sm_scale, *strides,
        H, H // KVH, SQ, SK, D, m_blocks, **common)
    return dq, dk, dv
