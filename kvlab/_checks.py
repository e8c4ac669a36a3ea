"""Input checks shared by the reference codecs and the kernel launchers, and the launchers' integer helpers.

Every check raises ``TypeError`` or ``ValueError`` naming the argument and what is allowed.
"""

from __future__ import annotations

import os

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP16_MAX = 65504.0


# Host-side integer helpers: a launcher's own cost counts when a call lasts ~0.1 ms (``triton.cdiv`` and
# ``triton.next_power_of_2`` are JIT functions, ~10 us a call from Python).
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def check_int(name: str, value, allowed=None, minimum=None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if allowed is not None and value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_choice(name: str, value, allowed) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")
    return value


def check_tensor(name: str, x, dtypes=None, ndim_min=None, last_dim=None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if dtypes is not None and x.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {str(x.dtype).replace('torch.', '')}")
    if ndim_min is not None and x.dim() < ndim_min:
        raise ValueError(f"{name} must have at least {ndim_min} dimensions, got shape {tuple(x.shape)}")
    if last_dim is not None and (x.dim() == 0 or x.shape[-1] != last_dim):
        raise ValueError(f"{name} must have last dimension {last_dim}, got shape {tuple(x.shape)}")
    return x


def check_finite(name: str, x: torch.Tensor) -> None:
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} holds NaN or Inf values; only finite values can be encoded")


def check_same_device(**tensors) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"tensors must be on one device, got {listing}")


def check_kernel_device(name: str, x: torch.Tensor) -> None:
    """A Triton launch needs ``x`` on a CUDA device, or any device under ``TRITON_INTERPRET=1``."""
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise ValueError(
            f"{name} is on {x.device}, but kvlab's Triton kernels run on CUDA devices; move the tensors to "
            "CUDA, or set TRITON_INTERPRET=1 before triton is imported to run them on the CPU "
            "(kvlab.reference encodes on any device)"
        )


def check_slot_mapping(slot_mapping, num_tokens: int, num_slots: int, device, values: bool = True) -> None:
    """dtype, shape and device of ``slot_mapping``; with ``values`` also its range (one host sync)."""
    check_tensor("slot_mapping", slot_mapping, (torch.int32, torch.int64))
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            f"slot_mapping must have shape ({num_tokens},) (one slot per token), got {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.device != device:
        raise ValueError(f"slot_mapping must be on {device}, got {slot_mapping.device}")
    if values and num_tokens and bool(((slot_mapping < -1) | (slot_mapping >= num_slots)).any()):
        raise ValueError(
            f"slot_mapping values must be -1 (skip) or in [0, {num_slots}) for a cache of {num_slots} slots"
        )
