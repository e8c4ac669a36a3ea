# Baseline for benchmarks/bench_codecs.py: a public mixed-precision affine cache with one global
# scale per head (computed with host syncs), a Python loop over heads and per-block scales in its
# kernels. Kept verbatim apart from this header and its demo, which is dropped.

"""
True Triton 4-bit KV Cache Kernel
----------------------------------
Properly packs two 4-bit values per byte.
Actual memory usage matches theoretical compression.

Comparison vs naive implementation:
  Naive:  stores 4-bit values in uint8 → 1 byte per value
  This:   packs 2 values per byte      → 0.5 bytes per value
  Gain:   2x actual memory reduction for 4-bit heads
"""

import torch
import triton
import triton.language as tl


# ── 4-bit Pack Kernel ─────────────────────────────────
@triton.jit
def pack_4bit_kernel(
    x_ptr,        # input  [N] float16
    q_ptr,        # output [N//2] uint8 — two 4-bit values packed per byte
    scale_ptr,    # output [1] float32
    zp_ptr,       # output [1] float32
    N,            # total input elements (must be even)
    BLOCK: tl.constexpr,
):
    pid      = tl.program_id(0)
    offs_out = pid * BLOCK + tl.arange(0, BLOCK)   # output byte indices
    offs_in0 = offs_out * 2                         # even input elements
    offs_in1 = offs_out * 2 + 1                     # odd input elements
    mask     = offs_out < N // 2

    x0 = tl.load(x_ptr + offs_in0, mask=mask, other=0.0).to(tl.float32)
    x1 = tl.load(x_ptr + offs_in1, mask=mask, other=0.0).to(tl.float32)

    # compute scale from full range
    x_min = tl.minimum(tl.min(x0, axis=0), tl.min(x1, axis=0))
    x_max = tl.maximum(tl.max(x0, axis=0), tl.max(x1, axis=0))
    scale  = (x_max - x_min) / 15.0
    scale  = tl.where(scale < 1e-8, 1e-8, scale)
    zp     = x_min

    # quantize to 4-bit range [0, 15]
    q0 = ((x0 - zp) / scale + 0.5).to(tl.int32)
    q1 = ((x1 - zp) / scale + 0.5).to(tl.int32)
    q0 = tl.where(q0 < 0, 0, tl.where(q0 > 15, 15, q0))
    q1 = tl.where(q1 < 0, 0, tl.where(q1 > 15, 15, q1))

    # pack: low nibble = q0, high nibble = q1
    packed = (q0 & 0xF) | ((q1 & 0xF) << 4)
    tl.store(q_ptr + offs_out, packed.to(tl.int8), mask=mask)

    if pid == 0:
        tl.store(scale_ptr, scale)
        tl.store(zp_ptr,    zp)


# ── 4-bit Unpack Kernel ───────────────────────────────
@triton.jit
def unpack_4bit_kernel(
    q_ptr,        # input  [N//2] int8 packed
    scale_ptr,    # input  [1] float32
    zp_ptr,       # input  [1] float32
    out_ptr,      # output [N] float16
    N,
    BLOCK: tl.constexpr,
):
    pid      = tl.program_id(0)
    offs_in  = pid * BLOCK + tl.arange(0, BLOCK)
    offs_out0 = offs_in * 2
    offs_out1 = offs_in * 2 + 1
    mask     = offs_in < N // 2

    packed = tl.load(q_ptr + offs_in, mask=mask, other=0).to(tl.int32)
    scale  = tl.load(scale_ptr).to(tl.float32)
    zp     = tl.load(zp_ptr).to(tl.float32)

    # unpack nibbles
    q0 = (packed & 0xF).to(tl.float32)
    q1 = ((packed >> 4) & 0xF).to(tl.float32)

    x0 = q0 * scale + zp
    x1 = q1 * scale + zp

    tl.store(out_ptr + offs_out0, x0.to(tl.float16), mask=mask)
    tl.store(out_ptr + offs_out1, x1.to(tl.float16), mask=mask)


# ── 8-bit Kernels (same as before, kept for completeness) ──
@triton.jit
def pack_8bit_kernel(
    x_ptr, q_ptr, scale_ptr, zp_ptr,
    N, BLOCK: tl.constexpr,
):
    pid  = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N

    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x_min = tl.min(x, axis=0)
    x_max = tl.max(x, axis=0)
    scale = (x_max - x_min) / 255.0
    scale = tl.where(scale < 1e-8, 1e-8, scale)
    zp    = x_min

    q = ((x - zp) / scale + 0.5).to(tl.int32)
    q = tl.where(q < 0, 0, tl.where(q > 255, 255, q))
    tl.store(q_ptr + offs, q.to(tl.int8), mask=mask)

    if pid == 0:
        tl.store(scale_ptr, scale)
        tl.store(zp_ptr,    zp)


@triton.jit
def unpack_8bit_kernel(
    q_ptr, scale_ptr, zp_ptr, out_ptr,
    N, BLOCK: tl.constexpr,
):
    pid  = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N

    q     = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.float32)
    scale = tl.load(scale_ptr).to(tl.float32)
    zp    = tl.load(zp_ptr).to(tl.float32)

    x = q * scale + zp
    tl.store(out_ptr + offs, x.to(tl.float16), mask=mask)


# ── Python Wrappers ───────────────────────────────────
BLOCK_SIZE = 1024

def quantize_head_triton(x: torch.Tensor, bits: int):
    """
    Quantize [seq, head_dim] tensor with globally computed scale.
    4-bit: returns packed tensor of size N//2 (true 4-bit storage)
    8-bit: returns tensor of size N
    """
    x = x.contiguous().to(torch.float16)
    N = x.numel()
    assert N % 2 == 0

    # compute scale globally in Python — fixes per-block scale bug
    x_f32  = x.float()
    x_min  = x_f32.min()
    x_max  = x_f32.max()

    if bits == 4:
        qmax  = 15.0
        scale = (x_max - x_min).clamp(min=1e-8) / qmax
        zp    = x_min
        # quantize in PyTorch, pack in Triton
        q_f   = ((x_f32 - zp) / scale).round().clamp(0, qmax)
        q_u8  = q_f.to(torch.uint8).view(-1)
        # pack pairs: q_u8[2i] in low nibble, q_u8[2i+1] in high nibble
        q_packed = (q_u8[0::2] & 0xF) | ((q_u8[1::2] & 0xF) << 4)
        q = q_packed.to(torch.int8)

    elif bits == 8:
        qmax  = 255.0
        scale = (x_max - x_min).clamp(min=1e-8) / qmax
        zp    = x_min
        q_f   = ((x_f32 - zp) / scale).round().clamp(0, qmax)
        q     = q_f.to(torch.uint8).view(-1).to(torch.int8)
    else:
        raise ValueError(f"Unsupported bits: {bits}")

    scale_t = scale.to(torch.float32).reshape(1)
    zp_t    = zp.to(torch.float32).reshape(1)
    return q, scale_t, zp_t


def dequantize_head_triton(q, scale, zp, bits, original_shape):
    """Dequantize using PyTorch — avoids int8 sign bit issues in Triton."""
    scale_f = scale.float().item()
    zp_f    = zp.float().item()

    if bits == 4:
        # unpack nibbles in PyTorch
        q_u8  = q.view(torch.uint8)  # treat as unsigned
        lo    = (q_u8 & 0xF).float()
        hi    = ((q_u8 >> 4) & 0xF).float()
        # interleave: lo[i], hi[i], lo[i+1], hi[i+1]...
        unpacked = torch.stack([lo, hi], dim=1).reshape(-1)
        out = (unpacked * scale_f + zp_f).to(torch.float16)
    elif bits == 8:
        q_u8 = q.view(torch.uint8).float()
        out  = (q_u8 * scale_f + zp_f).to(torch.float16)
    else:
        raise ValueError(f"Unsupported bits: {bits}")

    return out.view(original_shape)


# ── True Mixed Precision Cache ────────────────────────
class MixedPrecisionKVCacheTriton:
    """
    True mixed-precision KV cache using Triton kernels.
    4-bit heads use N//2 bytes (real bit-packing).
    8-bit heads use N bytes.
    """
    def __init__(self, bit_alloc: list):
        self.bit_alloc = bit_alloc
        self.k_cache   = []
        self.v_cache   = []

    def store(self, k: torch.Tensor, v: torch.Tensor):
        self.k_cache = []
        self.v_cache = []
        for h in range(k.shape[1]):
            bits   = self.bit_alloc[h]
            k_head = k[0, h]
            v_head = v[0, h]
            kq, ks, kz = quantize_head_triton(k_head, bits)
            vq, vs, vz = quantize_head_triton(v_head, bits)
            self.k_cache.append((kq, ks, kz, k_head.shape, bits))
            self.v_cache.append((vq, vs, vz, v_head.shape, bits))

    def retrieve(self):
        ks = [dequantize_head_triton(q,s,z,b,sh)
              for q,s,z,sh,b in self.k_cache]
        vs = [dequantize_head_triton(q,s,z,b,sh)
              for q,s,z,sh,b in self.v_cache]
        k  = torch.stack(ks, dim=0).unsqueeze(0)
        v  = torch.stack(vs, dim=0).unsqueeze(0)
        return k, v

    def memory_bytes(self):
        """Actual GPU memory — 4-bit truly packed as N//2 bytes."""
        total = 0
        for (q, s, z, sh, bits) in self.k_cache + self.v_cache:
            total += q.numel() + 8  # q is already N//2 for 4-bit
        return total

    def real_gpu_bytes(self):
        """Same as memory_bytes — Triton is truly packed."""
        return self.memory_bytes()
