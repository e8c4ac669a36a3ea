"""The affine codec's launchers: ``encode_affine`` / ``decode_affine`` (token or channel axis) and
``encode_affine_mixed`` / ``decode_affine_mixed`` (a bit width per head, ``MixedAffineLayout``) check their
inputs, launch the kernels of ``kvlab.affine.triton`` and read back the checks' flags. The oracle is
``kvlab.affine.reference.AffineCodec`` (not imported here); tests in ``tests/ops/test_affine.py``.
"""

from __future__ import annotations

import torch

from .. import _checks as C
from ..launch import CodecLaunch, launch_settings
from ..layout import AFFINE_BITS as PACK_BITS, packed_bytes
from .triton import AXES, CHANNEL_PACK_TILE, CHANNEL_UNPACK_TILE, FLAG_NONFINITE, FLAG_OVERFLOW, MAX_TILE_ELEMENTS, PACK_NUM_WARPS, PACK_TILE, TILE_ELEMENTS, UNPACK_NUM_WARPS, affine_pack_channel_kernel, affine_pack_mixed_kernel, affine_pack_token_kernel, affine_unpack_channel_kernel, affine_unpack_mixed_kernel, affine_unpack_token_kernel

__all__ = [
    "MixedAffineLayout",
    "affine_code_bytes",
    "encode_affine",
    "encode_affine_mixed",
    "decode_affine",
    "decode_affine_mixed",
]


# ----------------------------------------------------------------------------- launchers


def affine_code_bytes(dim: int, bits: int, group_size: int, axis: str = "token") -> int:
    """Bytes of one affine code: one vector (token axis) or ``group_size`` vectors (channel axis)."""
    if axis == "token":
        return packed_bytes(dim, bits) + 4 * (dim // group_size)
    return group_size * packed_bytes(dim, bits) + 4 * dim


def _check_codec(bits, group_size, axis) -> None:
    C.check_int("bits", bits, PACK_BITS)
    C.check_int("group_size", group_size, minimum=8)
    if group_size % 8:
        raise ValueError(f"group_size must be a multiple of 8, got {group_size}")
    C.check_choice("axis", axis, AXES)


def _check_dim(dim: int, group_size: int, axis: str, what: str) -> None:
    if axis == "token" and dim % group_size:
        raise ValueError(f"{what} ({dim}) must be a multiple of group_size={group_size}")
    if axis == "channel" and dim % 8:
        raise ValueError(f"{what} ({dim}) must be a multiple of 8")


def _check_out_dtype(out_dtype) -> None:
    if out_dtype not in C.FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be one of (float16, bfloat16, float32), got {out_dtype}")


def _tiny_groups(x: torch.Tensor, bits: int, group_size: int, axis: str) -> torch.Tensor:
    """Whether some nonzero group's fp16 scale and zero both underflow to 0 (a 0-d bool tensor; the reference's
    arithmetic: ``(hi - lo) / levels`` and ``lo`` in fp32, rounded to fp16)."""
    x = x.float()
    if axis == "token":
        g = x.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    else:
        g = x.reshape(*x.shape[:-2], x.shape[-2] // group_size, group_size, x.shape[-1]).transpose(-1, -2)
    lo, hi = g.amin(-1), g.amax(-1)
    return C.tiny_groups(((hi - lo) / ((1 << bits) - 1)).to(torch.float16), lo.to(torch.float16), g.abs().amax(-1))


def _raise_flags(flags: torch.Tensor, tiny: torch.Tensor) -> None:
    """The one host sync of a checked encode: read the per-program flags and the tiny-group flag."""
    flag, small = torch.stack([flags.max().to(torch.int64), tiny.to(torch.int64)]).tolist() if flags.numel() else (0, 0)
    if flag & FLAG_NONFINITE.value:
        raise ValueError("x holds NaN or Inf values; only finite values can be encoded")
    if flag & FLAG_OVERFLOW.value:
        raise ValueError("x has groups whose range or minimum overflows fp16 (|value| up to 65504)")
    if small:
        raise ValueError(C.tiny_groups_message("x"))


def _rows_per_tile(block: int | None, row_elements: int, tile: int = TILE_ELEMENTS) -> int:
    """Rows (vectors, or codes on the channel axis) per program: ``block``, or the default tile."""
    if block is not None and block * row_elements > MAX_TILE_ELEMENTS:
        raise ValueError(
            f"launch.block_rows={block} gives {block * row_elements} elements per program, more than {MAX_TILE_ELEMENTS}: "
            f"compiled, a program holds its tile in registers (and such a kernel takes minutes to compile); "
            f"use launch.block_rows <= {max(1, MAX_TILE_ELEMENTS // row_elements)}")
    return block if block is not None else max(1, min(128, tile // row_elements))


def encode_token_spec(x: torch.Tensor, codes: torch.Tensor, bits: int, group_size: int, *, check: bool = False,
                    flags: torch.Tensor | None = None, block_rows: int | None = None, num_warps: int | None = None):
    """The launch of ``affine_pack_token_kernel`` (a ``kvlab._kernels.replay`` spec): rows of ``x`` ``[n_rows, dim]``
    (columns contiguous) encoded into the rows of ``codes`` ``[n_rows, code_bytes]`` uint8 (bytes contiguous, rows
    any stride); ``flags``: int32, one per program, written when ``check`` (allocated when None)."""
    n_rows, dim = x.shape
    code_bytes = affine_code_bytes(dim, bits, group_size, "token")
    block_gs = C.next_power_of_2(group_size)
    block_g = C.next_power_of_2(dim // group_size)
    block_rows = _rows_per_tile(block_rows, block_g * block_gs, PACK_TILE)
    grid = (C.cdiv(n_rows, block_rows),)
    if flags is None:
        flags = torch.empty(grid[0] if check else 1, dtype=torch.int32, device=x.device)
    args = dict(
        x=x, codes=codes, flags=flags, n_rows=n_rows, stride_x=x.stride(0), stride_c=codes.stride(0),
        BITS=bits, GROUP_SIZE=group_size, NUM_GROUPS=dim // group_size,
        BLOCK_ROWS=block_rows, BLOCK_GS=block_gs, BLOCK_G=block_g, CHECK=check,
        # codes rows of code_bytes 4-byte aligned (a multiple of 4 when a group's code is)
        WORDS=(bits == 3 and group_size % 32 == 0 and block_gs == group_size and code_bytes % 4 == 0
               and codes.stride(0) % 4 == 0 and codes.data_ptr() % 4 == 0),
    )  # fmt: skip
    return affine_pack_token_kernel, grid, args, dict(num_warps=num_warps or PACK_NUM_WARPS, enable_fp_fusion=False)


def encode_affine(
    x: torch.Tensor,
    bits: int,
    group_size: int,
    axis: str = "token",
    *,
    check: bool = True,
    launch: CodecLaunch | None = None,
) -> torch.Tensor:
    """Encode ``x`` exactly as ``AffineCodec(bits, group_size, axis).encode(x)``.

    ``axis="token"``: x ``[..., dim]`` -> uint8 ``[..., code_bytes]``; ``axis="channel"``: x
    ``[..., tokens, dim]`` -> uint8 ``[..., tokens / group_size, code_bytes]``
    (``code_bytes = affine_code_bytes(dim, bits, group_size, axis)``). A non-contiguous x is copied
    to a contiguous one first. ``check=True`` raises ``ValueError`` for NaN/Inf input, fp16-overflowing
    groups or nonzero groups whose fp16 scale and zero both underflow to 0 (one host sync after the launch); ``check=False`` never syncs and leaves such codes undefined.
    ``launch`` (``kvlab.CodecLaunch``): ``block_rows``, vectors (token axis) or codes (channel axis) per
    program, a power of two, at most 65536 elements per program, and ``num_warps`` (default: about 1024 elements per program on the
    token axis, 8 vectors of 128; on the channel axis 2 codes of 32 x 128 at 2 and 3 bits, 1 at 4 and
    8; one warp; the fastest on an H200).
    """
    _check_codec(bits, group_size, axis)
    C.check_bool("check", check)
    block_rows, num_warps = launch_settings(launch, "encode_affine")
    C.check_tensor("x", x, C.FLOAT_DTYPES, ndim_min=1 if axis == "token" else 2)
    C.check_kernel_device("x", x)
    dim = x.shape[-1]
    _check_dim(dim, group_size, axis, "x's last dimension")
    if axis == "channel" and x.shape[-2] % group_size:
        raise ValueError(
            f"x's token dimension ({x.shape[-2]}) must be a multiple of group_size={group_size} for axis='channel'"
        )
    x = x.contiguous()
    code_bytes = affine_code_bytes(dim, bits, group_size, axis)
    block_gs = C.next_power_of_2(group_size)

    if axis == "token":
        codes = torch.empty(*x.shape[:-1], code_bytes, dtype=torch.uint8, device=x.device)
        n_rows = x.numel() // dim if dim else 0
        if n_rows == 0:
            return codes
        fn, grid, args, options = encode_token_spec(x.view(n_rows, dim), codes.view(n_rows, code_bytes), bits, group_size,
                                                  check=check, block_rows=block_rows, num_warps=num_warps)
        fn[grid](**args, **options)
        flags = args["flags"]
    else:
        tokens = x.shape[-2]
        codes = torch.empty(*x.shape[:-2], tokens // group_size, code_bytes, dtype=torch.uint8, device=x.device)
        n_codes = x.numel() // (group_size * dim) if dim else 0
        if n_codes == 0:
            return codes
        block_d = C.next_power_of_2(dim)
        block_codes = _rows_per_tile(block_rows, block_gs * block_d, CHANNEL_PACK_TILE[bits])
        grid = (C.cdiv(n_codes, block_codes),)
        flags = torch.empty(grid[0] if check else 1, dtype=torch.int32, device=x.device)
        affine_pack_channel_kernel[grid](
            x, codes, flags,
            n_codes,
            BITS=bits, GROUP_SIZE=group_size, DIM=dim,
            BLOCK_CODES=block_codes, BLOCK_GS=block_gs, BLOCK_D=block_d, CHECK=check,
            num_warps=num_warps or PACK_NUM_WARPS, enable_fp_fusion=False,
        )  # fmt: skip
    if check:
        _raise_flags(flags, _tiny_groups(x, bits, group_size, axis))
    return codes


def decode_affine(
    codes: torch.Tensor,
    bits: int,
    group_size: int,
    axis: str,
    dim: int,
    out_dtype: torch.dtype = torch.float16,
    *,
    launch: CodecLaunch | None = None,
) -> torch.Tensor:
    """Decode ``encode_affine`` codes: ``q * scale + zero`` in fp32 (as ``AffineCodec.decode``), cast to out_dtype.

    uint8 ``[..., code_bytes]`` -> ``[..., dim]`` (token axis) or ``[..., tokens, dim]`` (channel axis,
    ``tokens = codes.shape[-2] * group_size``; a 1-d code decodes to ``[group_size, dim]``).
    """
    _check_codec(bits, group_size, axis)
    block_rows, num_warps = launch_settings(launch, "decode_affine")
    C.check_int("dim", dim, minimum=1)
    _check_dim(dim, group_size, axis, "dim")
    _check_out_dtype(out_dtype)
    code_bytes = affine_code_bytes(dim, bits, group_size, axis)
    C.check_tensor("codes", codes, (torch.uint8,), ndim_min=1, last_dim=code_bytes)
    C.check_kernel_device("codes", codes)
    codes = codes.contiguous()
    block_gs = C.next_power_of_2(group_size)

    if axis == "token":
        out = torch.empty(*codes.shape[:-1], dim, dtype=out_dtype, device=codes.device)
        n_rows = codes.numel() // code_bytes
        if n_rows == 0:
            return out
        block_g = C.next_power_of_2(dim // group_size)
        block_rows = _rows_per_tile(block_rows, block_g * block_gs)
        affine_unpack_token_kernel[(C.cdiv(n_rows, block_rows),)](
            codes, out,
            n_rows, code_bytes, dim,
            BITS=bits, GROUP_SIZE=group_size, NUM_GROUPS=dim // group_size,
            BLOCK_ROWS=block_rows, BLOCK_GS=block_gs, BLOCK_G=block_g,
            num_warps=num_warps or UNPACK_NUM_WARPS,
        )  # fmt: skip
        return out
    lead = codes.shape[:-1]
    tokens = (lead[-1] if lead else 1) * group_size
    out = torch.empty(*lead[:-1], tokens, dim, dtype=out_dtype, device=codes.device)
    n_codes = codes.numel() // code_bytes
    if n_codes == 0:
        return out
    block_d = C.next_power_of_2(dim)
    block_codes = _rows_per_tile(block_rows, block_gs * block_d, CHANNEL_UNPACK_TILE)
    affine_unpack_channel_kernel[(C.cdiv(n_codes, block_codes),)](
        codes, out,
        n_codes,
        BITS=bits, GROUP_SIZE=group_size, DIM=dim,
        BLOCK_CODES=block_codes, BLOCK_GS=block_gs, BLOCK_D=block_d,
        num_warps=num_warps or UNPACK_NUM_WARPS,
    )  # fmt: skip
    return out


class MixedAffineLayout:
    """A token's K (or V) codes of all heads with a bit width per head (see ``kvlab.layout``).

    Head ``h`` uses ``bit_alloc[h]`` bits and the token-axis affine code of ``AffineCodec(bit_alloc[h],
    group_size)``: ``head_bytes[h]`` bytes at ``head_offsets[h]`` of the token's row of
    ``bytes_per_token`` bytes. Nothing is padded: ``bytes_per_token == sum(head_bytes)``.
    """

    def __init__(self, bit_alloc, dim: int, group_size: int):
        if isinstance(bit_alloc, torch.Tensor):
            bit_alloc = bit_alloc.tolist()
        if not isinstance(bit_alloc, (list, tuple)):
            raise TypeError(f"bit_alloc must be a list of ints (bits per head), got {type(bit_alloc).__name__}")
        if not bit_alloc:
            raise ValueError("bit_alloc must have one entry per head, got an empty list")
        for h, b in enumerate(bit_alloc):
            if isinstance(b, bool) or not isinstance(b, int):
                raise TypeError(f"bit_alloc[{h}] must be an int, got {type(b).__name__}")
            if b not in PACK_BITS:
                raise ValueError(f"bit_alloc entries must be in {PACK_BITS}, got bit_alloc[{h}] = {b}")
        C.check_int("dim", dim, minimum=1)
        C.check_int("group_size", group_size, minimum=8)
        if group_size % 8:
            raise ValueError(f"group_size must be a multiple of 8, got {group_size}")
        _check_dim(dim, group_size, "token", "dim")
        self.bit_alloc = tuple(bit_alloc)
        self.dim, self.group_size = dim, group_size
        self.num_heads = len(self.bit_alloc)
        self.head_bytes = tuple(affine_code_bytes(dim, b, group_size) for b in self.bit_alloc)
        offsets, total = [], 0
        for n in self.head_bytes:
            offsets.append(total)
            total += n
        self.head_offsets = tuple(offsets)
        self.bytes_per_token = total
        # the largest power of two (<= 16) dividing every head offset: lets the kernels vectorise
        self.align = 16
        while any(o % self.align for o in self.head_offsets):
            self.align //= 2
        self._tables: dict = {}

    @property
    def fp16_bytes_per_token(self) -> int:
        """The same heads stored as fp16."""
        return 2 * self.num_heads * self.dim

    @property
    def padded_bytes_per_token(self) -> int:
        """Bytes if every head were padded to the widest head's code."""
        return self.num_heads * max(self.head_bytes)

    def tables(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(head_bits int32, head_offsets int64)`` on ``device``, built once per device."""
        key = str(torch.device(device))
        if key not in self._tables:
            self._tables[key] = (
                torch.tensor(self.bit_alloc, dtype=torch.int32, device=device),
                torch.tensor(self.head_offsets, dtype=torch.int64, device=device),
            )
        return self._tables[key]

    def __repr__(self) -> str:
        return (
            f"MixedAffineLayout(bit_alloc={list(self.bit_alloc)}, dim={self.dim}, group_size={self.group_size}; "
            f"bytes_per_token={self.bytes_per_token})"
        )


def _check_layout(layout) -> None:
    if not isinstance(layout, MixedAffineLayout):
        raise TypeError(f"layout must be a MixedAffineLayout, got {type(layout).__name__}")


def encode_affine_mixed(
    x: torch.Tensor,
    layout: MixedAffineLayout,
    *,
    check: bool = True,
    launch: CodecLaunch | None = None,
) -> torch.Tensor:
    """Encode a layer's K (or V) ``[..., num_heads, dim]`` with per-head bits -> uint8 ``[..., bytes_per_token]``.

    One launch for all heads. Head h's bytes equal
    ``AffineCodec(layout.bit_alloc[h], layout.group_size).encode(x[..., h, :])``.
    x's last dimension must be contiguous (else it is copied); other strides are used as they are.
    """
    _check_layout(layout)
    C.check_bool("check", check)
    block_rows, num_warps = launch_settings(launch, "encode_affine_mixed")
    C.check_tensor("x", x, C.FLOAT_DTYPES, ndim_min=2)
    C.check_kernel_device("x", x)
    if x.shape[-2] != layout.num_heads:
        raise ValueError(
            f"bit_alloc has {layout.num_heads} entries but x has {x.shape[-2]} heads (shape {tuple(x.shape)}, "
            "expected [..., num_heads, dim])"
        )
    if x.shape[-1] != layout.dim:
        raise ValueError(f"x must have last dimension {layout.dim} (the layout's dim), got shape {tuple(x.shape)}")
    lead = x.shape[:-2]
    x3 = x.reshape(-1, layout.num_heads, layout.dim)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    codes = torch.empty(*lead, layout.bytes_per_token, dtype=torch.uint8, device=x.device)
    n_tokens = x3.shape[0]
    if n_tokens == 0:
        return codes
    head_bits, head_offsets = layout.tables(x.device)
    block_gs, block_g = C.next_power_of_2(layout.group_size), C.next_power_of_2(layout.dim // layout.group_size)
    block_rows = _rows_per_tile(block_rows, block_g * block_gs, PACK_TILE)
    n_programs = C.cdiv(n_tokens, block_rows) * layout.num_heads
    flags = torch.empty(n_programs if check else 1, dtype=torch.int32, device=x.device)
    affine_pack_mixed_kernel[(n_programs,)](
        x3, codes, head_bits, head_offsets, flags,
        n_tokens, layout.num_heads, x3.stride(0), x3.stride(1), layout.bytes_per_token,
        GROUP_SIZE=layout.group_size, NUM_GROUPS=layout.dim // layout.group_size,
        BLOCK_ROWS=block_rows, BLOCK_GS=block_gs, BLOCK_G=block_g, ALIGN=layout.align, CHECK=check,
        num_warps=num_warps or PACK_NUM_WARPS, enable_fp_fusion=False,
    )  # fmt: skip
    if check:
        tiny = torch.stack([_tiny_groups(x3[:, h], b, layout.group_size, "token")
                            for h, b in enumerate(layout.bit_alloc)]).any()
        _raise_flags(flags, tiny)
    return codes


def decode_affine_mixed(
    codes: torch.Tensor,
    layout: MixedAffineLayout,
    out_dtype: torch.dtype = torch.float16,
    *,
    launch: CodecLaunch | None = None,
) -> torch.Tensor:
    """Decode ``encode_affine_mixed`` codes ``[..., bytes_per_token]`` -> ``[..., num_heads, dim]`` (one launch)."""
    _check_layout(layout)
    block_rows, num_warps = launch_settings(launch, "decode_affine_mixed")
    _check_out_dtype(out_dtype)
    C.check_tensor("codes", codes, (torch.uint8,), ndim_min=1, last_dim=layout.bytes_per_token)
    C.check_kernel_device("codes", codes)
    codes = codes.contiguous()
    out = torch.empty(*codes.shape[:-1], layout.num_heads, layout.dim, dtype=out_dtype, device=codes.device)
    n_tokens = codes.numel() // layout.bytes_per_token
    if n_tokens == 0:
        return out
    head_bits, head_offsets = layout.tables(codes.device)
    block_gs, block_g = C.next_power_of_2(layout.group_size), C.next_power_of_2(layout.dim // layout.group_size)
    block_rows = _rows_per_tile(block_rows, block_g * block_gs)
    n_programs = C.cdiv(n_tokens, block_rows) * layout.num_heads
    affine_unpack_mixed_kernel[(n_programs,)](
        codes, out, head_bits, head_offsets,
        n_tokens, layout.num_heads, layout.bytes_per_token, layout.num_heads * layout.dim, layout.dim,
        GROUP_SIZE=layout.group_size, NUM_GROUPS=layout.dim // layout.group_size,
        BLOCK_ROWS=block_rows, BLOCK_GS=block_gs, BLOCK_G=block_g, ALIGN=layout.align,
        num_warps=num_warps or UNPACK_NUM_WARPS,
    )  # fmt: skip
    return out
