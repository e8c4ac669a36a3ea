"""The transform codec's parameters: one calibrated linear transform and per-component codebooks.

What
    A layer's keys (or values) of one token, ``[heads, head_dim]``, are flattened to ``heads * head_dim``
    numbers and split into ``groups`` consecutive vectors of ``dim`` numbers (``groups = 1``: all heads
    jointly; ``groups = heads``: one vector per head). Group ``g`` of a token is coded as

        y = (x - mean[g]) @ forward[g]                      # [dim]: the calibrated transform
        s = rms(y) rounded to fp16 (gain=True), else 1      # the token's gain
        code[c] = #{j : y[c] / s > boundaries[g, c, j]}      # nearest centroid of component c
        y_hat[c] = codebooks[g, c, code[c]] * s
        x_hat = mean[g] + y_hat @ inverse[g]

    ``forward`` folds whatever the calibration chose (an importance weighting, the eigenvectors of the
    weighted covariance); ``inverse`` undoes it. Component ``c`` of group ``g`` has ``bits[g, c]`` bits
    (0 to 8; 0: one centroid, no bits stored) and the ``2**bits[g, c]`` ascending centroids
    ``codebooks[g, c, :2**bits[g, c]]``.

Slot layout
    One group of one token is ``[codes | gain]``: the codes as one little-endian bit stream, component
    ``c`` at bit ``offsets[g, c] = bits[g, 0] + ... + bits[g, c-1]``, in ``ceil(sum(bits[g]) / 8)``
    bytes (unused high bits zero), then the gain as fp16, little-endian (2 bytes; absent with
    ``gain=False``). A token's row is its groups' slots back to back in group order, ``row_bytes`` in
    all; ``group_offsets[g]`` is the byte where group ``g`` starts.

Bits per element
    ``(sum(bits) + 16 * groups * gain) / (groups * dim)``: codes and gains. ``mean``, ``forward``,
    ``inverse`` and ``codebooks`` are calibrated once per model and are not per-token storage
    (``constants`` counts them).
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field

import torch

from .. import _checks as C

__all__ = ["MAX_BITS", "TransformCodec", "TransformKV", "check_gains"]

MAX_BITS = 8
FP16_MIN_NORMAL = 6.103515625e-05
GAIN_BYTES = 2
INVERSE_TOLERANCE = 1e-3  # calibrated transforms undo each other to about 1e-6 in float32
FILE_FORMAT = "kvlab.transform.TransformKV 2"  # what TransformKV.save writes: with a checksum of its contents


@dataclass(frozen=True, eq=False)
class TransformCodec:
    """Calibrated parameters of one layer's keys or values (see the module docstring).

    ``mean [groups, dim]``, ``forward [groups, dim, dim]``, ``inverse [groups, dim, dim]`` and
    ``codebooks [groups, dim, 2**max_bits]`` are float32; ``bits [groups, dim]`` is an integer tensor
    with values in ``[0, 8]``. Entries of ``codebooks`` past ``2**bits[g, c]`` are ignored.
    """

    mean: torch.Tensor
    forward: torch.Tensor
    inverse: torch.Tensor
    bits: torch.Tensor
    codebooks: torch.Tensor
    gain: bool = True
    boundaries: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self):
        C.check_tensor("mean", self.mean, (torch.float32,))
        if self.mean.dim() != 2 or self.mean.shape[0] < 1 or self.mean.shape[1] < 1:
            raise ValueError(f"mean must be [groups, dim] with groups, dim >= 1, got shape {tuple(self.mean.shape)}")
        groups, dim = self.mean.shape
        for name in ("forward", "inverse"):
            t = C.check_tensor(name, getattr(self, name), (torch.float32,))
            if tuple(t.shape) != (groups, dim, dim):
                raise ValueError(f"{name} must be [groups, dim, dim] = {[groups, dim, dim]}, got shape {tuple(t.shape)}")
        C.check_tensor("bits", self.bits, (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64))
        if tuple(self.bits.shape) != (groups, dim):
            raise ValueError(f"bits must be [groups, dim] = {[groups, dim]}, got shape {tuple(self.bits.shape)}")
        if bool((self.bits < 0).any()) or bool((self.bits > MAX_BITS).any()):
            raise ValueError(f"bits must be in [0, {MAX_BITS}], got values from {int(self.bits.min())} to {int(self.bits.max())}")
        object.__setattr__(self, "_max_bits", int(self.bits.max()))
        C.check_tensor("codebooks", self.codebooks, (torch.float32,))
        levels = 1 << self.max_bits
        if self.codebooks.dim() != 3 or tuple(self.codebooks.shape[:2]) != (groups, dim) or self.codebooks.shape[2] < levels:
            raise ValueError(f"codebooks must be [groups, dim, >= 2**max(bits)] = {[groups, dim, levels]}, "
                             f"got shape {tuple(self.codebooks.shape)}")
        C.check_bool("gain", self.gain)
        for name in ("mean", "forward", "inverse"):
            C.check_finite(name, getattr(self, name))
        used = torch.arange(self.codebooks.shape[2]) < (1 << self.bits.long().cpu()).unsqueeze(-1)
        book = self.codebooks.detach().cpu()
        if not bool(torch.isfinite(book[used]).all()):
            raise ValueError("codebooks holds NaN or Inf among the 2**bits centroids of a component")
        if bool((book[..., 1:] < book[..., :-1])[used[..., 1:]].any()):
            raise ValueError("codebooks must be ascending within the 2**bits centroids of each component")
        # boundaries[g, c, j]: midpoint of centroids j and j + 1 for j < 2**bits - 1, +inf past them
        mid = (self.codebooks[..., 1:levels] + self.codebooks[..., : levels - 1]) * 0.5 if levels > 1 else \
            self.codebooks[..., :0]
        inner = torch.arange(levels - 1, device=mid.device) < ((1 << self.bits.long()) - 1).to(mid.device).unsqueeze(-1)
        object.__setattr__(self, "boundaries", torch.where(inner, mid, torch.full_like(mid, math.inf)).contiguous())
        object.__setattr__(self, "codebooks", self.codebooks[..., :levels].contiguous())
        # sizes of the slot layout, read once: a decode step replayed from a CUDA graph must not sync to read them
        object.__setattr__(self, "_group_bits", tuple(int(b) for b in self.bits.long().sum(1).cpu()))

    # ------------------------------------------------------------------ sizes and the slot layout

    @property
    def groups(self) -> int:
        return self.mean.shape[0]

    @property
    def dim(self) -> int:
        return self.mean.shape[1]

    @property
    def max_bits(self) -> int:
        return self._max_bits

    @property
    def device(self) -> torch.device:
        return self.mean.device

    @property
    def group_bits(self) -> list[int]:
        """Code bits of each group (the gain not included)."""
        return list(self._group_bits)

    @property
    def group_bytes(self) -> list[int]:
        return [C.cdiv(b, 8) + GAIN_BYTES * self.gain for b in self.group_bits]

    @property
    def group_offsets(self) -> list[int]:
        out, at = [], 0
        for b in self.group_bytes:
            out.append(at)
            at += b
        return out

    @property
    def row_bytes(self) -> int:
        return sum(self.group_bytes)

    @property
    def offsets(self) -> torch.Tensor:
        """``[groups, dim]`` int64: the bit where component ``c`` of group ``g`` starts in its group's stream."""
        b = self.bits.long()
        return torch.cumsum(b, 1) - b

    @property
    def bits_per_element(self) -> float:
        return (sum(self.group_bits) + 16 * self.groups * self.gain) / (self.groups * self.dim)

    @property
    def constants(self) -> int:
        """Calibrated numbers the codec keeps (mean, both transforms, the used centroids)."""
        return self.mean.numel() + self.forward.numel() + self.inverse.numel() + int((1 << self.bits.long()).sum())

    def to(self, device) -> "TransformCodec":
        return TransformCodec(self.mean.to(device), self.forward.to(device), self.inverse.to(device),
                              self.bits.to(device), self.codebooks.to(device), self.gain)

    # ------------------------------------------------------------------ saving

    def state_dict(self) -> dict:
        return {"mean": self.mean.cpu(), "forward": self.forward.cpu(), "inverse": self.inverse.cpu(),
                "bits": self.bits.to(torch.uint8).cpu(), "codebooks": self.codebooks.cpu(), "gain": self.gain}

    @classmethod
    def from_state_dict(cls, state: dict, device="cpu") -> "TransformCodec":
        """The codec of ``state_dict()``, checked: tensors where tensors belong, ``gain`` a bool, and ``inverse``
        undoing ``forward`` (``forward[g] @ inverse[g]`` within ``INVERSE_TOLERANCE`` of the identity)."""
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict from TransformCodec.state_dict(), got {type(state).__name__}")
        missing = {"mean", "forward", "inverse", "bits", "codebooks", "gain"} - set(state)
        if missing:
            raise ValueError(f"state lacks {sorted(missing)}; it must come from TransformCodec.state_dict()")
        for name in ("mean", "forward", "inverse", "bits", "codebooks"):
            if not isinstance(state[name], torch.Tensor):
                raise TypeError(f"state[{name!r}] must be a tensor, got {type(state[name]).__name__}")
        C.check_bool("gain", state["gain"])
        codec = cls(state["mean"].to(device), state["forward"].to(device), state["inverse"].to(device),
                    state["bits"].to(device), state["codebooks"].to(device), state["gain"])
        codec.check_inverse()
        return codec

    def check_inverse(self) -> None:
        """``inverse`` must undo ``forward``: every entry of ``forward[g] @ inverse[g] - I`` within
        ``INVERSE_TOLERANCE`` (float64); a damaged or edited transform is an error, not a worse decode."""
        eye = torch.eye(self.dim, dtype=torch.float64, device=self.forward.device)
        product = self.forward.double() @ self.inverse.double()
        deviation = float((product - eye).abs().amax()) if product.numel() else 0.0
        if not deviation <= INVERSE_TOLERANCE:
            raise ValueError(f"inverse does not undo forward: forward @ inverse differs from the identity by "
                             f"{deviation:.3g} (at most {INVERSE_TOLERANCE:g}); the codec is damaged or not from "
                             "kvlab.transform.calibration.calibrate")

    def save(self, path: str | os.PathLike) -> None:
        torch.save(self.state_dict(), path)

    @classmethod
    def load(cls, path: str | os.PathLike, device="cpu") -> "TransformCodec":
        return cls.from_state_dict(torch.load(path, map_location="cpu", weights_only=True), device)


@dataclass(frozen=True, eq=False)
class TransformKV:
    """A model's calibrated transform codecs: one ``TransformCodec`` per layer for keys and for values.

    ``rope`` is ``None`` when the key codecs code keys as the cache receives them (after RoPE); a
    ``kvlab.RoPE`` when they code keys before RoPE: the cache undoes RoPE at the token's position before
    encoding and applies it again after decoding (``RoPE.undo`` / ``RoPE.apply``). ``sink`` and ``residual``
    are the unquantized first and most recent tokens the calibration assumed (a cache may choose its own).
    """

    keys: tuple
    values: tuple
    rope: object = None
    sink: int = 0
    residual: int = 0

    def __post_init__(self):
        object.__setattr__(self, "keys", tuple(self.keys))
        object.__setattr__(self, "values", tuple(self.values))
        if not self.keys or len(self.keys) != len(self.values):
            raise ValueError(f"keys and values must hold one TransformCodec per layer each, got {len(self.keys)} "
                             f"and {len(self.values)}")
        for name, codecs in (("keys", self.keys), ("values", self.values)):
            for i, c in enumerate(codecs):
                if not isinstance(c, TransformCodec):
                    raise TypeError(f"{name}[{i}] must be a TransformCodec, got {type(c).__name__}")
        C.check_int("sink", self.sink, minimum=0)
        C.check_int("residual", self.residual, minimum=0)
        if self.rope is not None:
            from ..calibration import RoPE  # a small dataclass, no kernel

            if not isinstance(self.rope, RoPE):
                raise TypeError(f"rope must be None or a kvlab.RoPE, got {type(self.rope).__name__}")

    @property
    def layers(self) -> int:
        return len(self.keys)

    def bits_per_element(self) -> float:
        """Codes and gains per element, averaged over layers and over K and V (sink and window not included)."""
        per = [c.bits_per_element * c.groups * c.dim for c in (*self.keys, *self.values)]
        return sum(per) / sum(c.groups * c.dim for c in (*self.keys, *self.values))

    def constants(self) -> int:
        return sum(c.constants for c in (*self.keys, *self.values))

    def to(self, device) -> "TransformKV":
        return TransformKV(tuple(c.to(device) for c in self.keys), tuple(c.to(device) for c in self.values),
                           self.rope, self.sink, self.residual)

    def state_dict(self) -> dict:
        """What ``save`` writes: the codecs' states, RoPE, sink and residual, the file format and a SHA-256 checksum
        of all of it (``checksum``)."""
        state = {"format": FILE_FORMAT,
                 "keys": [c.state_dict() for c in self.keys], "values": [c.state_dict() for c in self.values],
                 "rope": None if self.rope is None else {"inv_freq": self.rope.inv_freq.cpu(),
                                                         "scaling": float(self.rope.scaling)},
                 "sink": self.sink, "residual": self.residual}
        state["checksum"] = _checksum(state)
        return state

    def save(self, path: str | os.PathLike) -> None:
        """Write the codecs to ``path`` (``torch.save`` of tensors and plain values, with a checksum); ``load`` reads
        them back and refuses a file whose contents were changed."""
        torch.save(self.state_dict(), path)

    @classmethod
    def load(cls, path: str | os.PathLike, device="cpu") -> "TransformKV":
        """The codecs ``save`` wrote to ``path``, on ``device``. Only tensors and plain values are read (no code runs);
        a file that ``save`` did not write, whose checksum does not match its contents, or whose codecs are not
        valid (an ``inverse`` that does not undo its ``forward``, widths beyond 8 bits, ``gain`` not a bool) is a
        ``ValueError`` naming the file and what is wrong."""
        device = C.check_device("device", device)
        where = f"{os.fspath(path)} is not a file of kvlab.transform.TransformKV.save"
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise
        except Exception as exc:  # not a file torch.save wrote with tensors and plain values only
            raise ValueError(f"{where} ({type(exc).__name__}: it holds something other than tensors and plain "
                             "values, or is not a torch.save file)") from None
        if not isinstance(state, dict) or not {"keys", "values", "rope", "sink", "residual"} <= set(state):
            raise ValueError(f"{where} (it lacks the keys, values, rope, sink and residual that save writes)")
        if state.get("format") != FILE_FORMAT or "checksum" not in state:
            raise ValueError(f"{where} in this version's format {FILE_FORMAT!r} with a checksum (format: "
                             f"{state.get('format')!r}): calibrate again and save")
        try:
            checksum = _checksum(state)
        except (TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"{where} (a malformed structure: {exc})") from None
        if checksum != state["checksum"]:
            raise ValueError(f"{os.fspath(path)}: its checksum does not match its contents, so it was changed after "
                             "TransformKV.save wrote it (damaged or edited): calibrate again")
        try:
            rope = None
            if state["rope"] is not None:
                from ..calibration import RoPE

                rope = RoPE(state["rope"]["inv_freq"], state["rope"]["scaling"])
            codecs = {}
            for part in ("keys", "values"):
                codecs[part] = []
                for i, s in enumerate(state[part]):
                    try:
                        codecs[part].append(TransformCodec.from_state_dict(s, device))
                    except (TypeError, ValueError) as exc:
                        raise ValueError(f"{part}[{i}]: {exc}") from None
            for name in ("sink", "residual"):
                if isinstance(state[name], bool) or not isinstance(state[name], int):
                    raise ValueError(f"{name} must be an int, got {type(state[name]).__name__}")
            return cls(tuple(codecs["keys"]), tuple(codecs["values"]), rope, state["sink"], state["residual"])
        except (TypeError, ValueError, KeyError) as exc:
            raise ValueError(f"{os.fspath(path)} holds an invalid calibration: {exc}") from None


def _checksum(state: dict) -> str:
    """SHA-256 (hex) of a ``TransformKV`` state without its checksum: every tensor's dtype, shape and bytes and
    every plain value, in a fixed order."""
    h = hashlib.sha256()

    def add(value) -> None:
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            h.update(f"tensor {t.dtype} {tuple(t.shape)};".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(value, dict):
            h.update(f"dict {len(value)};".encode())
            for key in sorted(value):
                h.update(f"{key!r}:".encode())
                add(value[key])
        elif isinstance(value, (list, tuple)):
            h.update(f"list {len(value)};".encode())
            for item in value:
                add(item)
        elif value is None or isinstance(value, (bool, int, float, str)):
            h.update(f"{type(value).__name__} {value!r};".encode())
        else:
            raise TypeError(f"a {type(value).__name__} where tensors and plain values belong")

    add({k: v for k, v in state.items() if k != "checksum"})
    return h.hexdigest()


def check_gains(codec: TransformCodec, y: torch.Tensor, name: str = "x") -> None:
    """Every group's gain (the RMS of its transformed values) must be a finite fp16 number, and a nonzero
    group's gain a normal one (one host sync)."""
    if not codec.gain:
        return
    rms = (y.double().square().sum(-1) / codec.dim).sqrt()
    if not bool((rms.float().to(torch.float16).isfinite()).all()):
        raise ValueError(f"{name} has a group whose gain (the RMS of its transformed values, {float(rms.max()):.4g}) "
                         "exceeds fp16's 65504")
    if bool(((rms > 0) & (rms.float().to(torch.float16).float() < FP16_MIN_NORMAL)).any()):
        raise ValueError(f"{name} has a nonzero group whose gain is below fp16's smallest normal number 6.1e-05")
