"""Fused kernels: the small operators between the matrix products, each group done in one kernel.

A CUDA graph (``model_runner.py``) takes the CPU out of a decode step, but not the kernels: the GPU still
runs them one after the other, and each costs a few microseconds however little it does (starting it,
waiting for the one before it to finish, reading its inputs from memory and writing its output back).
At batch 1 most of a layer's kernels do almost nothing: the matrix products read the weights, and the
rest (a cast, a multiplication, a concatenation) touch a few kilobytes. Counted from the code, in
bfloat16, a layer of the decode step launched 28 kernels (30 from two rows on), and the whole step 844:

    RMSNorm, twice             x.float(), F.rms_norm, .to(bfloat16), weight *       4 + 4
    the residual additions     x + attention(...), x + mlp(...)                     1 + 1
    rotary embedding of q, k   .float(), 4 x mul, sub, add, cat, .to(bfloat16)      9
    the K/V write              (k.contiguous(), v.contiguous() from two rows on)    1 (+2)
    SwiGLU                     F.silu(gate), * up                                   2
    matrix products, attention qkv, o, gate_up, down; decode + merge              4 + 2

Three kernels here, four launches a layer, take the place of those 22 small ones (24 from two rows on;
float32 skips the casts: 16):

* ``add_rms_norm``: the residual addition and the next RMSNorm, ``norm(residual + x)``, in one pass over
  the row, which also hands back the new residual stream. The layer then carries its stream beside its
  output (``DecoderLayer``): the addition that ends one block is the start of the next block's norm.
* ``silu_and_mul``: SwiGLU's ``silu(gate) * up`` from the stacked product's output, in one pass.
* ``rotary_and_write_kv``: one program per token rotates its query heads into ``q`` and its key heads,
  with its value heads, straight into the token's cache slot (none for slot -1: a padding row).

A layer is then 10 kernels: the norms (2), the four products, rotary and the K/V write (1), attention
(2: ``triton_attention.py``'s decode and merge) and SwiGLU (1); the step is 305. The matrix products and
attention are as before: what fusion removes is launches and round trips through memory, not arithmetic.

Each kernel sits beside its PyTorch reference, which is exactly the code the model ran before (the
same operators in the same order: on a CPU the numbers do not change by a bit). Each entry point picks
the kernel where ``attention.use_triton`` picks the attention kernels (on CUDA, or ``LLM_ATTENTION=triton``)
and the reference elsewhere; the tests run the kernels on a CPU under ``TRITON_INTERPRET=1`` against the
references. The kernels round where PyTorch rounds: a bfloat16 sum is rounded to bfloat16 before its norm,
the norm before its weight, ``silu(gate)`` before its product; the statistics and the rotation are float32.
Nothing depends on the step's values, and every size is a constant of the model: a kernel compiles once,
at the warm-up, and is captured in the graph like any other.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .attention import AttentionMetadata, use_triton, write_kv

# --- RMSNorm, and the residual addition before it ----------------------------------------------------------


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight``: the statistics in float32 even for a bfloat16 model, as Hugging Face
    does; F.rms_norm is that formula in one operator (five otherwise), and the weight multiplies after the cast
    back, as Hugging Face's does."""
    # x: [T, hidden]; weight: [hidden] -> [T, hidden]
    return weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` joins the residual stream, then the stream is normalized: (norm(residual + x), residual + x)."""
    # x, residual: [T, hidden] -> ([T, hidden], [T, hidden])
    residual = residual + x
    return rms_norm_reference(residual, weight, eps), residual


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, out_ptr, residual_out_ptr, weight_ptr, eps, stride_x, stride_r,
                     SIZE: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """One program per row: (the residual added, stored,) the mean of squares, the scaled row, the weight."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)  # the whole row in one tile: SIZE (the hidden size) padded to a power of two
    mask = offs < SIZE
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (residual.to(tl.float32) + x.to(tl.float32)).to(x.dtype)  # rounded to the model's dtype, as PyTorch's +
        tl.store(residual_out_ptr + row * SIZE + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / SIZE + eps)  # the padding lanes are 0: they add nothing
    normed = (x32 * rstd).to(x.dtype)  # cast back before the weight, as the reference does
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * SIZE + offs, (normed.to(tl.float32) * weight.to(tl.float32)).to(x.dtype), mask=mask)


def _rms_norm_triton(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    # x, residual: [T, hidden] (rows of unit stride); weight: [hidden] -> out (and the new residual): [T, hidden]
    x = x.contiguous()  # a no-op on CUDA (products write contiguous rows); a copy of a CPU product's transposed view
    residual = None if residual is None else residual.contiguous()
    rows, size = x.shape
    out = torch.empty_like(x)
    residual_out = None if residual is None else torch.empty_like(x)
    if rows:
        _rms_norm_kernel[(rows,)](x, residual, out, residual_out, weight, eps, x.stride(0),
                                  0 if residual is None else residual.stride(0), SIZE=size,
                                  BLOCK=triton.next_power_of_2(size), HAS_RESIDUAL=residual is not None)
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row: the first layer's input norm (nothing added yet) and the final norm. One kernel on
    CUDA, the reference elsewhere."""
    # x: [T, hidden]; weight: [hidden] -> [T, hidden]
    if use_triton(x.device):
        return _rms_norm_triton(x, None, weight, eps)[0]
    return rms_norm_reference(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + x), residual + x): a block's output joins the residual stream and the next block's norm
    reads it, in one kernel on CUDA (the reference elsewhere)."""
    # x, residual: [T, hidden]; weight: [hidden] -> ([T, hidden], [T, hidden])
    if use_triton(x.device):
        return _rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_reference(x, residual, weight, eps)


# --- SwiGLU's silu(gate) * up ------------------------------------------------------------------------------


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, gate and up the two halves of the stacked product's output."""
    # gate_up: [T, 2 * intermediate] -> [T, intermediate]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


SILU_BLOCK = 1024  # features per program


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_in, SIZE: tl.constexpr, BLOCK: tl.constexpr):
    """One program per (row, block of BLOCK features): out = silu(gate) * up, silu(g) = g / (1 + exp(-g))."""
    row, block = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    mask = offs < SIZE
    gate = tl.load(gate_up_ptr + row * stride_in + offs, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + SIZE + offs, mask=mask, other=0.0)  # up: the second half
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # rounded before the product, as F.silu's output is
    tl.store(out_ptr + row * SIZE + offs, (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation and product, ``silu(gate) * up``: one kernel on CUDA (the reference elsewhere)."""
    # gate_up: [T, 2 * intermediate] -> [T, intermediate]
    if not use_triton(gate_up.device):
        return silu_and_mul_reference(gate_up)
    gate_up = gate_up.contiguous()  # a no-op on CUDA
    rows, size = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, size, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(size, SILU_BLOCK))](gate_up, out, gate_up.stride(0), SIZE=size,
                                                                    BLOCK=SILU_BLOCK)
    return out


# --- rotary embedding of q and k, and the K/V write ----------------------------------------------------------


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head's vector by its position's angles, in Hugging Face Llama's "rotate half"
    layout: dimension i is paired with dimension i + D/2, not with its neighbour."""
    # x: [T, heads, D]; cos, sin: [T, 1, D / 2]
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x.dtype)


def rotary_and_write_kv_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                                  v_cache: torch.Tensor, meta: AttentionMetadata, num_heads: int) -> torch.Tensor:
    """Rotate the queries and the keys, store the keys and the values in their cache slots (``write_kv``: none
    for slot -1), and return the queries."""
    # qkv: [T, H + 2 Hkv, D], the heads of q, then k, then v; cos, sin: [T, 1, D / 2]; caches: [N, S, Hkv, D]
    num_kv_heads = k_cache.shape[2]
    rotated = num_heads + num_kv_heads  # the query heads, then the key heads
    q, k = apply_rotary(qkv[:, :rotated], cos, sin).split([num_heads, num_kv_heads], dim=1)
    v = qkv[:, rotated:]  # [T, Hkv, D]: values are not rotated
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping, meta.kv_writes)
    return q  # [T, H, D]


@triton.jit
def _rotate(ptr, heads, in_rows, offs, in_half, cos, sin, HEAD_DIM: tl.constexpr):
    """The two halves of the heads ``heads`` of one token at ``ptr`` ([rows, D/2] each, float32), rotated."""
    mask = in_rows[:, None] & in_half[None, :]
    first = ptr + heads[:, None] * HEAD_DIM + offs[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HEAD_DIM // 2, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _rotary_and_write_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                                stride_qkv, stride_cos, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                                HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
                                HALF_PAD: tl.constexpr):
    """One program per token. Its row of the qkv product holds H query heads, then Hkv key heads, then Hkv value
    heads, of D numbers each; every head is handled as two halves of D/2 (the rotation pairs i with i + D/2)."""
    token = tl.program_id(0).to(tl.int64)
    half = HEAD_DIM // 2
    offs = tl.arange(0, HALF_PAD)
    in_half = offs < half  # D/2 padded to a power of two: 40 (D = 80) -> 64
    cos = tl.load(cos_ptr + token * stride_cos + offs, mask=in_half, other=0.0)[None, :]  # [1, D/2] float32
    sin = tl.load(sin_ptr + token * stride_cos + offs, mask=in_half, other=0.0)[None, :]
    row = qkv_ptr + token * stride_qkv

    # The query heads, rotated into q: [T, H, D].
    heads = tl.arange(0, HEADS_PAD)
    in_heads = heads < NUM_HEADS
    q1, q2 = _rotate(row, heads, in_heads, offs, in_half, cos, sin, HEAD_DIM)
    q_mask = in_heads[:, None] & in_half[None, :]
    q_row = q_ptr + token * (NUM_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + offs[None, :]
    tl.store(q_row, q1.to(q_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q_row + half, q2.to(q_ptr.dtype.element_ty), mask=q_mask)

    # The key heads rotated, the value heads as they are, into the token's slot of the pools ([N * S, Hkv, D]
    # seen flat): nothing at all for slot -1, a padding row.
    slot = tl.load(slot_mapping_ptr + token)  # int64: slot * Hkv * D can pass 2**31 in a large pool
    if slot >= 0:
        kv_heads = tl.arange(0, KV_HEADS_PAD)
        in_kv = kv_heads < NUM_KV_HEADS
        # A name of its own: Triton types a variable once, and the query heads' mask has another shape.
        kv_mask = in_kv[:, None] & in_half[None, :]
        dst = slot * (NUM_KV_HEADS * HEAD_DIM) + kv_heads[:, None] * HEAD_DIM + offs[None, :]
        k1, k2 = _rotate(row + NUM_HEADS * HEAD_DIM, kv_heads, in_kv, offs, in_half, cos, sin, HEAD_DIM)
        tl.store(k_cache_ptr + dst, k1.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(k_cache_ptr + dst + half, k2.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
        v = row + (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM + kv_heads[:, None] * HEAD_DIM + offs[None, :]
        tl.store(v_cache_ptr + dst, tl.load(v, mask=kv_mask), mask=kv_mask)
        tl.store(v_cache_ptr + dst + half, tl.load(v + half, mask=kv_mask), mask=kv_mask)


def rotary_and_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, meta: AttentionMetadata, num_heads: int) -> torch.Tensor:
    """Rotary embedding of the queries and keys, and the keys and values stored in their cache slots: one kernel
    on CUDA (the reference elsewhere). Returns the rotated queries; attention then reads the keys from the cache.
    """
    # qkv: [T, H + 2 Hkv, D]; cos, sin: [T, 1, D / 2] float32; caches: [N, S, Hkv, D] (contiguous) -> q: [T, H, D]
    if not use_triton(qkv.device):
        return rotary_and_write_kv_reference(qkv, cos, sin, k_cache, v_cache, meta, num_heads)
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and cos.stride(-1) == sin.stride(-1) == 1
    assert cos.stride(0) == sin.stride(0)
    qkv = qkv.contiguous()  # a no-op on CUDA
    num_tokens, _, head_dim = qkv.shape
    num_kv_heads = k_cache.shape[2]
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens:
        _rotary_and_write_kv_kernel[(num_tokens,)](
            qkv, cos, sin, q, k_cache, v_cache, meta.slot_mapping, qkv.stride(0), cos.stride(0),
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
            HEADS_PAD=triton.next_power_of_2(num_heads), KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
            HALF_PAD=triton.next_power_of_2(head_dim // 2))
    return q
