"""``KVFormat``: how a ``KVCache`` stores keys and values (codec, bits, axis, group, rotation), and its bits per
element (``kvlab.hf.cache`` holds the caches that store them)."""

from __future__ import annotations

from dataclasses import dataclass

from .. import _checks as C
from ..layout import AFFINE_BITS, MSE_BITS, NORM_BYTES, packed_bytes
from ..rotation import KINDS as ROTATIONS, MAX_DIM, check_seed

__all__ = ["CODECS", "KEY_AXES", "KVFormat", "MSE_CODECS"]

CODECS = ("fp16", "affine", "mse", "centered", "transform")
MSE_CODECS = ("mse", "centered")  # the paged MSE slot
KEY_AXES = ("token", "channel")


def _check_bits(name: str, bits, allowed, per_head: bool):
    """An int in ``allowed``, or (``per_head``) a non-empty list/tuple of such ints -> int or tuple."""
    if isinstance(bits, (list, tuple)):
        if not per_head:
            raise ValueError(f"{name} can be a list of bits per head only for codec='affine' on the token axis")
        if not bits:
            raise ValueError(f"{name} must not be an empty list")
        for h, b in enumerate(bits):
            C.check_int(f"{name}[{h}]", b, allowed)
        return tuple(bits)
    if bits is None:
        raise TypeError(f"{name} must be an int (or a list of ints per head), got None")
    return C.check_int(name, bits, allowed)


@dataclass(frozen=True, init=False)
class KVFormat:
    """How one layer stores its keys and values (see the module docstring).

    ``KVFormat("fp16")``; ``KVFormat("affine", 4)`` (k4v4, per-token, groups of 32 channels);
    ``KVFormat("affine", 2, key_axis="channel")`` (KIVI); ``KVFormat("affine", [8, 4, 4], 4)`` (mixed
    key bits per head); ``KVFormat("mse", 4, 3, rotation="hadamard")`` (k4v3);
    ``KVFormat("centered", 3, 2)`` (centred 3-bit keys, 2-bit values; needs ``KVCache(key_stats=...)``).
    """

    codec: str
    key_bits: int | tuple[int, ...]
    value_bits: int | tuple[int, ...]
    key_axis: str
    group_size: int
    rotation: str
    seed: int

    def __init__(self, codec: str = "fp16", key_bits=None, value_bits=None, *, key_axis: str = "token",
                 group_size: int = 32, rotation: str = "haar", seed: int = 0):
        C.check_choice("codec", codec, CODECS)
        C.check_choice("key_axis", key_axis, KEY_AXES)
        C.check_int("group_size", group_size, minimum=8)
        if group_size % 8:
            raise ValueError(f"group_size must be a multiple of 8, got {group_size}")
        C.check_choice("rotation", rotation, ROTATIONS)
        check_seed(seed)
        if codec == "transform":  # the bits are the calibrated codecs' (KVCache(transform=...))
            for name, bits in (("key_bits", key_bits), ("value_bits", value_bits)):
                if bits is not None:
                    raise ValueError(f"{name} must be None for codec='transform' (the calibrated codecs set the bits), "
                                     f"got {bits!r}")
            if key_axis != "token":
                raise ValueError("key_axis='channel' needs codec='affine'")
        elif codec == "fp16":
            for name, bits in (("key_bits", key_bits), ("value_bits", value_bits)):
                if bits not in (None, 16):
                    raise ValueError(f"{name} must be None or 16 for codec='fp16', got {bits!r}")
            key_bits = value_bits = 16
            if key_axis != "token":
                raise ValueError("key_axis='channel' needs codec='affine'")
        else:
            value_bits = key_bits if value_bits is None else value_bits
            allowed = AFFINE_BITS if codec == "affine" else MSE_BITS
            key_bits = _check_bits("key_bits", key_bits, allowed, codec == "affine" and key_axis == "token")
            value_bits = _check_bits("value_bits", value_bits, allowed, codec == "affine")
            if codec in MSE_CODECS and key_axis != "token":
                raise ValueError("key_axis='channel' needs codec='affine'")
        for name, value in (("codec", codec), ("key_bits", key_bits), ("value_bits", value_bits),
                            ("key_axis", key_axis), ("group_size", group_size), ("rotation", rotation),
                            ("seed", seed)):
            object.__setattr__(self, name, value)

    @property
    def mixed(self) -> bool:
        """Whether keys or values have a bit width per head."""
        return isinstance(self.key_bits, tuple) or isinstance(self.value_bits, tuple)

    def check(self, num_heads: int, head_dim: int) -> None:
        """Raise ValueError if this format cannot store ``num_heads`` heads of ``head_dim`` elements."""
        C.check_int("num_heads", num_heads, minimum=1)
        C.check_int("head_dim", head_dim, minimum=1)
        for name, bits in (("key_bits", self.key_bits), ("value_bits", self.value_bits)):
            if isinstance(bits, tuple) and len(bits) != num_heads:
                raise ValueError(f"{name} has {len(bits)} entries (bits per head) but the model has {num_heads} KV heads")
        if self.codec == "affine":
            # values are always grouped along channels (and keys too unless key_axis='channel')
            if head_dim % self.group_size:
                raise ValueError(f"group_size ({self.group_size}) must divide head_dim ({head_dim}) for codec='affine'")
        if self.codec in MSE_CODECS:
            C.check_int("head_dim", head_dim, minimum=3)
            if head_dim > MAX_DIM:
                raise ValueError(f"head_dim must be in [3, {MAX_DIM}] for codec={self.codec!r} (a dense rotation), got {head_dim}")
            if self.rotation == "hadamard" and head_dim & (head_dim - 1):
                raise ValueError(f"rotation='hadamard' needs a power-of-two head_dim, got {head_dim}")

    def _part_bits(self, bits, head_dim: int, channel: bool) -> float:
        if self.codec == "fp16":
            return 16.0
        if self.codec == "transform":
            raise ValueError("the bits of KVFormat('transform') are those of its calibrated codecs: "
                             "KVCache(..., transform=...).bits_per_element or TransformKV.bits_per_element()")
        if self.codec in MSE_CODECS:
            return 8.0 * (packed_bytes(head_dim, bits) + NORM_BYTES) / head_dim
        g = self.group_size
        if channel:  # one code: g rows of packed indices, then a scale and a zero per channel
            return 8.0 * (g * packed_bytes(head_dim, bits) + 4 * head_dim) / (g * head_dim)
        per_head = bits if isinstance(bits, tuple) else (bits,)
        code = [packed_bytes(head_dim, b) + 4 * (head_dim // g) for b in per_head]
        return 8.0 * sum(code) / (len(code) * head_dim)

    def key_bits_per_element(self, head_dim: int) -> float:
        """Bits a quantized key element costs, metadata included."""
        C.check_int("head_dim", head_dim, minimum=1)
        return self._part_bits(self.key_bits, head_dim, self.key_axis == "channel")

    def value_bits_per_element(self, head_dim: int) -> float:
        C.check_int("head_dim", head_dim, minimum=1)
        return self._part_bits(self.value_bits, head_dim, False)

    def bits_per_element(self, head_dim: int) -> float:
        """Mean of key and value bits per element (they hold the same number of elements)."""
        return 0.5 * (self.key_bits_per_element(head_dim) + self.value_bits_per_element(head_dim))

    @property
    def label(self) -> str:
        """A short name, e.g. ``affine k4v4``, ``affine k2v2 channel-keys``, ``mse k4v3 hadamard``."""
        if self.codec in ("fp16", "transform"):
            return self.codec

        def b(bits):
            return "[" + ",".join(map(str, bits)) + "]" if isinstance(bits, tuple) else str(bits)

        text = f"{self.codec} k{b(self.key_bits)}v{b(self.value_bits)}"
        if self.codec == "affine":
            text += " channel-keys" if self.key_axis == "channel" else ""
            text += f" g{self.group_size}" if self.group_size != 32 else ""
        else:
            text += f" {self.rotation}"
        return text

    def __repr__(self) -> str:
        if self.codec in ("fp16", "transform"):
            return f"KVFormat({self.codec!r})"
        extra = f", key_axis={self.key_axis!r}" if self.key_axis != "token" else ""
        if self.codec in MSE_CODECS:
            extra += f", rotation={self.rotation!r}" + (f", seed={self.seed}" if self.seed else "")
        return f"KVFormat({self.codec!r}, {self.key_bits!r}, {self.value_bits!r}{extra}, group_size={self.group_size})"

