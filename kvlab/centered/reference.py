"""Pure-torch reference of the centred MSE codec for keys: the oracle ``kvlab.centered`` must reproduce.

What
    A key ``k`` of head ``h`` at position ``n`` is shifted by a per-channel mean and divided by a
    per-channel scale, both calibrated once per layer and head on held-out text
    (``kvlab.calibration``), and the result is stored with the rotated Lloyd-Max codec
    (``kvlab.MSECodec``)::

        m = mean_rows(n)[h]                     (the mean at position n, fp32)
        z = (k - m) * inv_scale[h]              (fp32, each operation rounded on its own)
        code = MSECodec.encode(z)               (indices | fp16 norm: the slot of ``kvlab.layout``)
        k_hat = MSECodec.decode(code) * scale[h] + m

    With ``rope`` (a ``kvlab.calibration.RoPE``) ``mean`` is the keys' mean before RoPE and
    ``mean_rows(n) = rope.apply(mean, n)``, computed in float64 on the CPU and rounded to fp32 (the
    same numbers on every device); without, ``mean_rows(n) = mean``. ``inv_scale = 1 / scale`` is
    computed once, in fp32, so encoding multiplies (no division per element) and a kernel reproduces
    ``z`` bit for bit.

Why it works for keys
    The keys of a trained model have a large mean per channel (in SmolLM2 more than half of the key
    energy): the MSE codec's error scales with the vector's norm, so it spends its bits on a
    direction that is the same for every token. Attention does not need that direction at all: the
    softmax over tokens is invariant to adding a per-query constant to every score, and
    ``q . (k - mean) = q . k - q . mean`` differs from ``q . k`` by exactly such a constant. A decoder
    that attends over centred keys only (every key of the sequence centred) may drop ``mean`` and use
    ``q . (scale * z_hat)``; ``decode`` adds it back so the result is the key itself. With ``rope`` the
    mean turns with the position and ``q . RoPE_n(mean)`` differs per token: a decoder adds it, one
    more 64-term dot product per token (the query against the rotated mean, from a table of
    ``cos``/``sin`` per position shared by all heads and layers).

Layout
    Unchanged: a code is ``MSECodec(dim, bits).encode(z)``, ``packed_bytes(dim, bits)`` index bytes then
    the fp16 norm, and a layer's keys and values share the paged slot ``MSESlot`` of ``kvlab.layout``.
    ``mean`` and ``scale`` (``[num_heads, dim]`` per layer) are constants of the model, like the rotation.
"""

from __future__ import annotations

import hashlib

import torch

from .. import _checks as C
from ..params import CenteredParams
from ..mse.reference import MSECodec

__all__ = ["CenteredMSECodec", "stats_fingerprint"]


def stats_fingerprint(mean: torch.Tensor, scale: torch.Tensor, rope=None) -> str:
    """SHA-256 (hex, 12 characters) of the float32 ``mean`` and ``scale`` and of ``rope`` (its ``inv_freq`` and
    ``scaling``, or none): equal for equal statistics, different for any other calibration."""
    h = hashlib.sha256()
    for t in (mean, scale):
        t = t.detach().to("cpu", torch.float32).contiguous()
        h.update(str(tuple(t.shape)).encode())
        h.update(t.numpy().tobytes())
    if rope is not None:
        h.update(b"rope")
        h.update(rope.inv_freq.detach().to("cpu", torch.float64).contiguous().numpy().tobytes())
        h.update(repr(float(rope.scaling)).encode())
    return h.hexdigest()[:12]


class CenteredMSECodec(CenteredParams):
    """MSE codec of ``(x - mean) / scale`` for vectors ``[..., num_heads, dim]``, one mean and scale per head.

    ``mean``, ``scale``: float tensors ``[num_heads, dim]`` (scale finite and > 0); ``bits``,
    ``rotation``, ``seed`` as for ``MSECodec``, which is ``self.mse``. ``encode(x) -> uint8 [...,
    num_heads, nbytes]``; ``decode(codes, space)``: ``"model"`` gives the key, ``"centered"`` the
    centred key ``(x_hat - mean)``, i.e. without the mean (what attention needs, see the module
    docstring), ``"rotated"`` the MSE codec's rotated, normalised-space vector ``z_hat @ R``.
    ``rope``: ``None`` (the same mean at every position) or a ``kvlab.calibration.RoPE`` (``mean`` is
    before RoPE; ``encode`` and ``decode(space="model")`` then need the tokens' ``positions``).
    ``stats_fingerprint`` (``stats_fingerprint(mean, scale, rope)``) names the statistics; ``self.mse``
    carries it as ``centered_stats``, so a paged cache that ``kvlab.centered.store_centered_mse`` writes records it
    and a checked read with other statistics (``load_centered_mse``, ``decode_attention``,
    ``prefill_attention``) or as plain MSE codes is an error (``kvlab._checks.check_reader``).
    """

    def __init__(self, dim: int, bits: int, mean: torch.Tensor, scale: torch.Tensor, rotation: str = "haar",
                 seed: int = 0, rope=None):
        self.mse = MSECodec(dim, bits, rotation=rotation, seed=seed)
        C.check_tensor("mean", mean, C.FLOAT_DTYPES)
        C.check_tensor("scale", scale, C.FLOAT_DTYPES)
        if mean.dim() != 2 or mean.shape[-1] != dim:
            raise ValueError(f"mean must have shape [num_heads, {dim}], got {tuple(mean.shape)}")
        if scale.shape != mean.shape:
            raise ValueError(f"scale must have the shape of mean {tuple(mean.shape)}, got {tuple(scale.shape)}")
        C.check_finite("mean", mean)
        if not bool((torch.isfinite(scale) & (scale > 0)).all()):
            raise ValueError("scale must be finite and > 0 everywhere")
        self.dim, self.bits, self.num_heads = dim, bits, mean.shape[0]
        self.mean = mean.detach().to("cpu", torch.float32).contiguous()
        self.scale = scale.detach().to("cpu", torch.float32).contiguous()
        self.inv_scale = (1.0 / self.scale).contiguous()  # fp32, once
        if not bool(torch.isfinite(self.inv_scale).all()):
            raise ValueError(f"scale must be large enough for 1 / scale to be finite in float32 (about 2.9e-39 or more), got "
                             f"{float(self.scale.min()):.3g}")
        if rope is not None and (getattr(rope, "dim", None) != dim or not callable(getattr(rope, "apply", None))):
            raise ValueError(f"rope must be None or a kvlab.calibration.RoPE of {dim} channels, got {rope!r}")
        self.rope = rope
        self.nbytes = self.mse.nbytes
        # the codes are those of z, which only these statistics turn back into keys: the MSE codec that writes
        # them carries their fingerprint, so a cache it writes knows it (kvlab._checks.codec_identity)
        self.stats_fingerprint = stats_fingerprint(self.mean, self.scale, rope)
        self.mse.centered_stats = self.stats_fingerprint

    @property
    def bits_per_element(self) -> float:
        return self.mse.bits_per_element

    def __repr__(self) -> str:
        return (f"CenteredMSECodec(dim={self.dim}, bits={self.bits}, num_heads={self.num_heads}, "
                f"rotation={self.mse.rotation_kind!r}, seed={self.mse.seed}, rope={self.rope is not None})")

    def _check_heads(self, name: str, t: torch.Tensor, last: int) -> None:
        if t.dim() < 2 or t.shape[-2] != self.num_heads or t.shape[-1] != last:
            raise ValueError(f"{name} must have shape [..., {self.num_heads}, {last}] (heads, then "
                             f"{'elements' if name == 'x' else 'code bytes'}), got {tuple(t.shape)}")

    def mean_rows(self, positions: torch.Tensor | None, lead: tuple = ()) -> torch.Tensor:
        """The mean at ``positions`` (int, shape ``lead``): fp32 ``[*lead, num_heads, dim]`` on the CPU
        (``mean`` itself, ``[num_heads, dim]``, without ``rope``)."""
        if self.rope is None:
            return self.mean
        if not isinstance(positions, torch.Tensor) or positions.dtype not in (torch.int32, torch.int64):
            raise TypeError("positions must be an int tensor (the tokens' positions) for a codec with rope, "
                            f"got {type(positions).__name__}")
        if tuple(positions.shape) != tuple(lead):
            raise ValueError(f"positions must have shape {tuple(lead)} (x's shape without heads and dim), "
                             f"got {tuple(positions.shape)}")
        return self.rope.apply(self.mean.double(), positions[..., None]).float()

    def normalize(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``z = (x - mean_rows(positions)) * inv_scale`` in fp32 (what the MSE codec encodes)."""
        C.check_tensor("x", x, C.FLOAT_DTYPES)
        self._check_heads("x", x, self.dim)
        mean = self.mean_rows(positions, tuple(x.shape[:-2])).to(x.device)
        return (x.float() - mean) * self.inv_scale.to(x.device)

    def encode(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., num_heads, dim]`` -> uint8 ``[..., num_heads, nbytes]`` (``positions [...]`` with ``rope``)."""
        C.check_tensor("x", x, C.FLOAT_DTYPES)
        C.check_finite("x", x)
        return self.mse.encode(self.normalize(x, positions))

    def decode(self, codes: torch.Tensor, space: str = "model", positions: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 ``[..., num_heads, nbytes]`` -> float32 ``[..., num_heads, dim]`` (``positions`` with ``rope``
        and ``space="model"``)."""
        C.check_tensor("codes", codes, (torch.uint8,))
        self._check_heads("codes", codes, self.nbytes)
        C.check_choice("space", space, ("model", "centered", "rotated"))
        if space == "rotated":
            return self.mse.decode(codes, "rotated")
        z = self.mse.decode(codes, "model")
        centered = z * self.scale.to(codes.device)
        if space == "centered":
            return centered
        return centered + self.mean_rows(positions, tuple(codes.shape[:-2])).to(codes.device)
