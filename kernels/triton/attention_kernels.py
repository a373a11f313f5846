"""Flash attention in Triton, forward and backward.

q: (batch, heads, seq_q, head_dim); k, v: (batch, kv_heads, seq_k, head_dim), heads a multiple of
kv_heads (grouped-query). Any strides with the head dimension contiguous: the (batch, seq, heads,
head_dim) projections the model makes, transposed, are read in place (no copies). Causal masking
is top-left aligned, as torch SDPA's `is_causal`. Any sequence length; head_dim up to 128
(non-powers of two such as 80 and 96 are padded inside the kernel). Scores, softmax statistics
and accumulators are fp32; the log-sum-exp of every row is kept for the backward pass, which
recomputes the probabilities block by block instead of storing them.

Each inner loop runs in two parts: the blocks that need no mask (wholly below the causal diagonal
and inside the sequence) without building one, then the edge blocks with it. Batch and head
offsets are 64-bit: a tensor past 2^31 elements is addressed correctly.

With document ids (packed sequences, `doc_ids` non-decreasing along the sequence) a query sees
only keys of its own document; a query block starts at the first key block holding its first
document and a key block stops at the last query of its last document, so blocks that share no
document are never visited (at 2k tokens of 8 documents, 1/8 of the causal work).

Backward: a small kernel for delta = rowsum(dO * O), then one kernel owning a block of keys (dK,
dV: for grouped-query heads it walks every query head of its group, so no atomics are needed) and
one owning a block of queries (dQ).

Block sizes are autotuned on GPUs (configs per architecture, sm_80 and sm_90, keyed on head dim,
lengths and causality); with document ids, and under TRITON_INTERPRET=1 (CPU), fixed sizes.
Under the interpreter the tiles are upcast to fp32 right after loading: its bf16 arithmetic is
not faithful.
"""
import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read once: @triton.jit reads it too
LOG2E = 1.4426950408889634
# (BLOCK_M, BLOCK_N) under the interpreter; tests set others (BLOCK_M != BLOCK_N among them)
INTERPRET_BLOCKS = (16, 16)


@triton.jit
def _dot(a, b):
    """tl.dot, in IEEE fp32 for fp32 tiles: on GPUs its default for fp32 inputs is TF32 (10-bit
    mantissas, errors ~1e-3), which an fp32 run has not asked for. 16-bit tiles are unchanged."""
    if a.dtype == tl.float32:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _fwd_blocks(acc, l_i, m_i, q, k_ptr, v_ptr, doc_q, doc_ptr, offs_m, offs_n, offs_d, mask_d,
                s_ks, s_vs, SK, qk_scale, lo, hi,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOCS: tl.constexpr,
                UPCAST: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key blocks [lo, hi) of one query block; MASKED: the edge blocks (causal diagonal,
    sequence end), else blocks every query of the block sees whole."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        mask_n = cols < SK
        if MASKED:
            kt_mask = mask_n[None, :] & mask_d[:, None]
            v_mask = mask_n[:, None] & mask_d[None, :]
        else:
            kt_mask = mask_d[:, None]
            v_mask = mask_d[None, :]
        kt = tl.load(k_ptr + cols[None, :] * s_ks + offs_d[:, None], mask=kt_mask, other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
        s = _dot(q, kt) * qk_scale  # base-2 logits, (M, N)
        if MASKED:
            valid = mask_n[None, :]
            if CAUSAL:
                valid = valid & (cols[None, :] <= offs_m[:, None])
            s = tl.where(valid, s, float("-inf"))
        if DOCS:
            doc_k = tl.load(doc_ptr + cols, mask=mask_n, other=-2)
            s = tl.where(doc_q[:, None] == doc_k[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if DOCS:  # a row may see no key of this block yet (its document starts later): keep
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # exp2(-inf - -inf) from NaN
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + cols[:, None] * s_vs + offs_d[None, :], mask=v_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, DOC, KV_LO, qk_scale,
                s_qb, s_qh, s_qs, s_kb, s_kh, s_ks, s_vb, s_vh, s_vs, s_ob, s_oh, s_os,
                H, GROUP, SQ, SK, HEAD_DIM, NUM_M,
                CAUSAL: tl.constexpr, DOCS: tl.constexpr, UPCAST: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
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
    k_ptr = K + b * s_kb + kvh * s_kh
    v_ptr = V + b * s_vb + kvh * s_vh
    doc_ptr = DOC + b * SK

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = SK
    full = (SK // BLOCK_N) * BLOCK_N  # blocks before this one are inside the sequence
    if CAUSAL:
        hi = tl.minimum(SK, (pid_m + 1) * BLOCK_M)
        full = (tl.minimum(SK, pid_m * BLOCK_M) // BLOCK_N) * BLOCK_N  # below the diagonal
    lo = 0
    doc_q = offs_m
    if DOCS:  # key blocks before the first document of this query block are skipped
        lo = tl.load(KV_LO + b * NUM_M + pid_m)
        doc_q = tl.load(DOC + b * SQ + offs_m, mask=mask_m, other=-1)
    full = tl.maximum(full, lo)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_ptr, v_ptr, doc_q, doc_ptr, offs_m, offs_n,
                                offs_d, mask_d, s_ks, s_vs, SK, qk_scale, lo, full,
                                False, CAUSAL, DOCS, UPCAST, BLOCK_N)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_ptr, v_ptr, doc_q, doc_ptr, offs_m, offs_n,
                                offs_d, mask_d, s_ks, s_vs, SK, qk_scale, full, hi,
                                True, CAUSAL, DOCS, UPCAST, BLOCK_N)
    if DOCS:  # rows past the sequence's end saw no key (their document id matches none)
        l_i = tl.where(mask_m, l_i, 1.0)
    acc = acc / l_i[:, None]
    tl.store(LSE + pid_bh * SQ + offs_m, m_i + tl.log2(l_i), mask=mask_m)  # base 2
    tl.store(O + b * s_ob + h * s_oh + offs_m[:, None] * s_os + offs_d[None, :],
             acc.to(O.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


@triton.jit
def _delta_kernel(O, DO, DELTA, s_ob, s_oh, s_os, s_db, s_dh, s_ds, H, SQ, HEAD_DIM,
                  BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """delta = rowsum(dO * O) in fp32, one block of rows of one head."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < SQ
    mask = mask_m[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(O + b * s_ob + h * s_oh + offs_m[:, None] * s_os + offs_d[None, :], mask=mask,
                other=0.0).to(tl.float32)
    do = tl.load(DO + b * s_db + h * s_dh + offs_m[:, None] * s_ds + offs_d[None, :], mask=mask,
                 other=0.0).to(tl.float32)
    tl.store(DELTA + pid_bh * SQ + offs_m, tl.sum(o * do, 1), mask=mask_m)


@triton.jit
def _load_row_tiles(a_ptr, s_a, b_ptr, s_b, offs, mask_rows, offs_d, mask_d,
                    MASKED: tl.constexpr, UPCAST: tl.constexpr):
    """Two (rows, head_dim) tiles at the same rows (q and dO, or k and v); MASKED: rows past the
    sequence read as zeros."""
    if MASKED:
        mask = mask_rows[:, None] & mask_d[None, :]
    else:
        mask = mask_d[None, :]
    a = tl.load(a_ptr + offs[:, None] * s_a + offs_d[None, :], mask=mask, other=0.0)
    b = tl.load(b_ptr + offs[:, None] * s_b + offs_d[None, :], mask=mask, other=0.0)
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return a, b


@triton.jit
def _probabilities(q, k, lse, qk_scale, offs_m, offs_n, mask_m, mask_n, doc_q, doc_k,
                   MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOCS: tl.constexpr):
    """The softmax probabilities of a (queries, keys) block again, from the forward's
    log-sum-exp, zero where the masks (edges, causality, documents) hide a key."""
    p = tl.exp2(_dot(q, tl.trans(k)) * qk_scale - lse[:, None])  # (M, N)
    if MASKED:
        valid = mask_m[:, None] & mask_n[None, :]
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None])
        p = tl.where(valid, p, 0.0)
    if DOCS:
        p = tl.where(doc_q[:, None] == doc_k[None, :], p, 0.0)
    return p


@triton.jit
def _dkdv_blocks(dk, dv, k, v, doc_k, q_ptr, do_ptr, lse_ptr, delta_ptr, doc_ptr, offs_m0,
                 offs_n, offs_d, mask_n, mask_d, s_qs, s_ds, SQ, qk_scale, lo, hi,
                 MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOCS: tl.constexpr,
                 UPCAST: tl.constexpr, BLOCK_M: tl.constexpr):
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_m0
        mask_m = offs_m < SQ
        q, do = _load_row_tiles(q_ptr, s_qs, do_ptr, s_ds, offs_m, mask_m, offs_d, mask_d,
                                MASKED, UPCAST)
        lse = tl.load(lse_ptr + offs_m, mask=mask_m, other=0.0)
        delta = tl.load(delta_ptr + offs_m, mask=mask_m, other=0.0)
        doc_q = offs_m
        if DOCS:
            doc_q = tl.load(doc_ptr + offs_m, mask=mask_m, other=-1)
        p = _probabilities(q, k, lse, qk_scale, offs_m, offs_n, mask_m, mask_n, doc_q, doc_k,
                           MASKED, CAUSAL, DOCS)
        dv += _dot(tl.trans(p.to(do.dtype)), do)
        dp = _dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dk += _dot(tl.trans(ds.to(q.dtype)), q)
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DOC, Q_HI, qk_scale, sm_scale,
                     s_qb, s_qh, s_qs, s_kb, s_kh, s_ks, s_vb, s_vh, s_vs, s_db, s_dh, s_ds,
                     s_dkb, s_dkh, s_dks, s_dvb, s_dvh, s_dvs,
                     KVH, GROUP, SQ, SK, HEAD_DIM, NUM_N,
                     CAUSAL: tl.constexpr, DOCS: tl.constexpr, UPCAST: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One block of keys of one kv head, every query head of its group."""
    pid_n = tl.program_id(0)
    pid_bkv = tl.program_id(1).to(tl.int64)
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
    doc_k = offs_n
    if DOCS:  # queries past the last document of this key block see none of these keys
        hi = tl.load(Q_HI + b * NUM_N + pid_n)
        doc_k = tl.load(DOC + b * SK + offs_n, mask=mask_n, other=-2)
    # query blocks that see every key of this block whole: past the diagonal's last key (causal),
    # inside the query range, and this key block inside the sequence
    full_lo = lo
    if CAUSAL:
        full_lo = tl.cdiv((pid_n + 1) * BLOCK_N - 1, BLOCK_M) * BLOCK_M
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.maximum(full_lo, (hi // BLOCK_M) * BLOCK_M)
    if (pid_n + 1) * BLOCK_N > SK:  # the key block's tail is outside the sequence: mask it all
        full_lo = hi
        full_hi = hi
    for g in range(0, GROUP):
        h = kvh * GROUP + g
        row = (b * KVH * GROUP + h) * SQ
        q_ptr = Q + b * s_qb + h * s_qh
        do_ptr = DO + b * s_db + h * s_dh
        dk, dv = _dkdv_blocks(dk, dv, k, v, doc_k, q_ptr, do_ptr, LSE + row, DELTA + row,
                              DOC + b * SQ, offs_m0, offs_n, offs_d, mask_n, mask_d, s_qs, s_ds,
                              SQ, qk_scale, lo, full_lo, True, CAUSAL, DOCS, UPCAST, BLOCK_M)
        dk, dv = _dkdv_blocks(dk, dv, k, v, doc_k, q_ptr, do_ptr, LSE + row, DELTA + row,
                              DOC + b * SQ, offs_m0, offs_n, offs_d, mask_n, mask_d, s_qs, s_ds,
                              SQ, qk_scale, full_lo, full_hi, False, CAUSAL, DOCS, UPCAST,
                              BLOCK_M)
        dk, dv = _dkdv_blocks(dk, dv, k, v, doc_k, q_ptr, do_ptr, LSE + row, DELTA + row,
                              DOC + b * SQ, offs_m0, offs_n, offs_d, mask_n, mask_d, s_qs, s_ds,
                              SQ, qk_scale, full_hi, hi, True, CAUSAL, DOCS, UPCAST, BLOCK_M)
    tl.store(DK + b * s_dkb + kvh * s_dkh + offs_n[:, None] * s_dks + offs_d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + b * s_dvb + kvh * s_dvh + offs_n[:, None] * s_dvs + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_blocks(dq, q, do, lse, delta, doc_q, k_ptr, v_ptr, doc_ptr, offs_m, offs_n0, offs_d,
               mask_m, mask_d, s_ks, s_vs, SK, qk_scale, lo, hi,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOCS: tl.constexpr,
               UPCAST: tl.constexpr, BLOCK_N: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        mask_n = offs_n < SK
        k, v = _load_row_tiles(k_ptr, s_ks, v_ptr, s_vs, offs_n, mask_n, offs_d, mask_d,
                               MASKED, UPCAST)
        doc_k = offs_n
        if DOCS:
            doc_k = tl.load(doc_ptr + offs_n, mask=mask_n, other=-2)
        p = _probabilities(q, k, lse, qk_scale, offs_m, offs_n, mask_m, mask_n, doc_q, doc_k,
                           MASKED, CAUSAL, DOCS)
        dp = _dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k)
    return dq


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, DOC, KV_LO, qk_scale, sm_scale,
                   s_qb, s_qh, s_qs, s_kb, s_kh, s_ks, s_vb, s_vh, s_vs, s_db, s_dh, s_ds,
                   s_dqb, s_dqh, s_dqs,
                   H, GROUP, SQ, SK, HEAD_DIM, NUM_M,
                   CAUSAL: tl.constexpr, DOCS: tl.constexpr, UPCAST: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One block of queries of one head."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    kvh = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < SQ
    mask_d = offs_d < HEAD_DIM
    q_mask = mask_m[:, None] & mask_d[None, :]
    q = tl.load(Q + b * s_qb + h * s_qh + offs_m[:, None] * s_qs + offs_d[None, :], mask=q_mask,
                other=0.0)
    do = tl.load(DO + b * s_db + h * s_dh + offs_m[:, None] * s_ds + offs_d[None, :],
                 mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(LSE + pid_bh * SQ + offs_m, mask=mask_m, other=0.0)
    delta = tl.load(DELTA + pid_bh * SQ + offs_m, mask=mask_m, other=0.0)
    k_ptr = K + b * s_kb + kvh * s_kh
    v_ptr = V + b * s_vb + kvh * s_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = SK
    full = (SK // BLOCK_N) * BLOCK_N
    if CAUSAL:
        hi = tl.minimum(SK, (pid_m + 1) * BLOCK_M)
        full = (tl.minimum(SK, pid_m * BLOCK_M) // BLOCK_N) * BLOCK_N
    lo = 0
    doc_q = offs_m
    if DOCS:
        lo = tl.load(KV_LO + b * NUM_M + pid_m)
        doc_q = tl.load(DOC + b * SQ + offs_m, mask=mask_m, other=-1)
    full = tl.maximum(full, lo)
    dq = _dq_blocks(dq, q, do, lse, delta, doc_q, k_ptr, v_ptr, DOC + b * SK, offs_m, offs_n0,
                    offs_d, mask_m, mask_d, s_ks, s_vs, SK, qk_scale, lo, full,
                    False, CAUSAL, DOCS, UPCAST, BLOCK_N)
    dq = _dq_blocks(dq, q, do, lse, delta, doc_q, k_ptr, v_ptr, DOC + b * SK, offs_m, offs_n0,
                    offs_d, mask_m, mask_d, s_ks, s_vs, SK, qk_scale, full, hi,
                    True, CAUSAL, DOCS, UPCAST, BLOCK_N)
    tl.store(DQ + b * s_dqb + h * s_dqh + offs_m[:, None] * s_dqs + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)


# -- block sizes ---------------------------------------------------------------------------------
def _config_list(backward: bool):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) tried by the autotuner: sm_90 has the shared
    memory for 128-wide tiles at more stages; sm_80 (and others) smaller."""
    major = torch.cuda.get_device_capability()[0] if torch.cuda.is_available() else 8
    if backward:
        tiles = [(64, 64, 4, 2), (64, 128, 8, 2), (128, 64, 8, 2), (32, 64, 4, 3),
                 (64, 32, 4, 3)]
        if major >= 9:
            tiles += [(128, 128, 8, 2), (64, 64, 4, 3)]
    else:
        tiles = [(128, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 4)]
        if major >= 9:
            tiles += [(128, 128, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
            for m, n, w, s in tiles]


_TUNED = {}
KEY = ["SQ", "SK", "HEAD_DIM", "GROUP", "CAUSAL"]  # what the best tiles depend on


def _tuned(kernel, backward: bool):
    name = kernel.fn.__name__
    if name not in _TUNED:
        _TUNED[name] = triton.autotune(configs=_config_list(backward), key=KEY)(kernel)
    return _TUNED[name]


def _fixed_blocks(head_dim_block: int, backward: bool):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) where block sizes must be known before the launch
    (document ids: the block ranges are computed on the host) and under the interpreter (small
    blocks: its cost is per program and op, and they exercise the multi-block and edge paths)."""
    if INTERPRET:
        return (*INTERPRET_BLOCKS, 1, 1)
    if backward:
        return 64, 64, 4 if head_dim_block <= 64 else 8, 2
    return 128, 64, 4 if head_dim_block <= 64 else 8, 3


def _launch(kernel, grid_of, args, backward: bool, docs: bool, head_dim_block: int, **meta):
    """The kernel autotuned (GPU, no document ids) or at fixed blocks; grid_of(BLOCK_M, BLOCK_N).
    Returns the (BLOCK_M, BLOCK_N) used where fixed (None when autotuned)."""
    if INTERPRET or docs:
        bm, bn, warps, stages = _fixed_blocks(head_dim_block, backward)
        kernel[grid_of(bm, bn)](*args, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
                                num_stages=stages, **meta)
        return
    _tuned(kernel, backward)[lambda m: grid_of(m["BLOCK_M"], m["BLOCK_N"])](*args, **meta)


def _strides(t):
    return t.stride(0), t.stride(1), t.stride(2)


def head_dim_contiguous(t):
    """Read in place when the head dimension is contiguous; else one copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


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


def _doc_blocks(doc_ids, head_dim_block: int, backward: bool):
    bm, bn, _, _ = _fixed_blocks(head_dim_block, backward)
    return _key_starts(doc_ids, bm, bn), _query_ends(doc_ids, bn)


def forward(q, k, v, causal: bool, sm_scale: float, doc_ids=None):
    """doc_ids: None, or (batch, seq) int32 non-decreasing (then seq_q == seq_k)."""
    B, H, SQ, D = q.shape
    KVH, SK = k.shape[1], k.shape[2]
    o = torch.empty_like(q)  # q's layout: a transposed (b, s, h, d) view stays one
    lse = torch.empty((B, H, SQ), device=q.device, dtype=torch.float32)
    BD = max(16, triton.next_power_of_2(D))
    docs = doc_ids is not None
    kv_lo = _doc_blocks(doc_ids, BD, False)[0] if docs else lse  # unread without DOCS
    num_m = kv_lo.shape[1] if docs else 0
    args = (q, k, v, o, lse, doc_ids if docs else lse, kv_lo, sm_scale * LOG2E,
            *_strides(q), *_strides(k), *_strides(v), *_strides(o), H, H // KVH, SQ, SK, D,
            num_m)
    _launch(_fwd_kernel, lambda bm, bn: (triton.cdiv(SQ, bm), B * H), args, False, docs, BD,
            CAUSAL=causal, DOCS=docs, UPCAST=INTERPRET, BLOCK_D=BD)
    return o, lse


def backward(do, q, k, v, o, lse, causal: bool, sm_scale: float, doc_ids=None):
    B, H, SQ, D = q.shape
    KVH, SK = k.shape[1], k.shape[2]
    do = head_dim_contiguous(do)
    BD = max(16, triton.next_power_of_2(D))
    delta = torch.empty_like(lse)
    rows = 64 if not INTERPRET else 16
    _delta_kernel[(triton.cdiv(SQ, rows), B * H)](o, do, delta, *_strides(o), *_strides(do), H,
                                                   SQ, D, BLOCK_M=rows, BLOCK_D=BD)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    docs = doc_ids is not None
    doc = doc_ids if docs else lse
    kv_lo, q_hi = _doc_blocks(doc_ids, BD, True) if docs else (lse, lse)
    num_m, num_n = (kv_lo.shape[1], q_hi.shape[1]) if docs else (0, 0)
    meta = dict(CAUSAL=causal, DOCS=docs, UPCAST=INTERPRET, BLOCK_D=BD)
    strides = (*_strides(q), *_strides(k), *_strides(v), *_strides(do))
    _launch(_bwd_dkdv_kernel, lambda bm, bn: (triton.cdiv(SK, bn), B * KVH),
            (q, k, v, do, lse, delta, dk, dv, doc, q_hi, sm_scale * LOG2E, sm_scale, *strides,
             *_strides(dk), *_strides(dv), KVH, H // KVH, SQ, SK, D, num_n), True, docs, BD,
            **meta)
    _launch(_bwd_dq_kernel, lambda bm, bn: (triton.cdiv(SQ, bm), B * H),
            (q, k, v, do, lse, delta, dq, doc, kv_lo, sm_scale * LOG2E, sm_scale, *strides,
             *_strides(dq), H, H // KVH, SQ, SK, D, num_m), True, docs, BD, **meta)
    return dq, dk, dv
