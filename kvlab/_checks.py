"""Input checks shared by the reference codecs and the kernel launchers, and the launchers' integer helpers.

Every check raises ``TypeError`` or ``ValueError`` naming the argument and what is allowed.
"""

from __future__ import annotations

import math
import numbers
import weakref

import torch

from ._kernels.tables import interpreted

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP16_MAX = 65504.0


# Host-side integer helpers: a launcher's own cost counts when a call lasts ~0.1 ms (``triton.cdiv`` and
# ``triton.next_power_of_2`` are JIT functions, ~10 us a call from Python).
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def fit_fp16(q32: torch.Tensor):
    """``(q16, f)``: ``q32 / f`` in fp16 and the power of two ``f`` (1.0 when ``q32`` fits) that keeps it finite (one
    host sync). A kernel that reads ``q16`` multiplies its scores by ``f``."""
    peak = float(q32.abs().amax()) if q32.numel() else 0.0
    if not math.isfinite(peak):
        raise ValueError("q * scale overflows float32 (after the rotation); use a smaller q or scale")
    f = 2.0 ** max(0, math.ceil(math.log2(peak / 2.0**15))) if peak > 2.0**15 else 1.0
    return (q32 / f).to(torch.float16).contiguous(), f


def check_int(name: str, value, allowed=None, minimum=None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if allowed is not None and value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_bool(name: str, value, optional: bool = False) -> bool | None:
    """A bool; with ``optional=True`` also None (meaning "choose for me")."""
    if optional and value is None:
        return None
    if not isinstance(value, bool):
        allowed = "a bool or None" if optional else "a bool"
        raise TypeError(f"{name} must be {allowed}, got {type(value).__name__}")
    return value


def check_scale(name: str, value) -> float:
    """A positive finite real number (a Python or numpy scalar), as a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a positive finite float, got {type(value).__name__}")
    value = float(value)
    if not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive finite float, got {value!r}")
    return value


def check_choice(name: str, value, allowed) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")
    return value


def check_tensor(name: str, x, dtypes=None, ndim_min=None, last_dim=None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.device.type == "meta":
        raise ValueError(f"{name} is on the meta device, which holds shapes but no data: load the model's weights "
                         "onto a CPU or GPU before running it")
    if dtypes is not None and x.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {str(x.dtype).replace('torch.', '')}")
    if ndim_min is not None and x.dim() < ndim_min:
        raise ValueError(f"{name} must have at least {ndim_min} dimensions, got shape {tuple(x.shape)}")
    if last_dim is not None and (x.dim() == 0 or x.shape[-1] != last_dim):
        raise ValueError(f"{name} must have last dimension {last_dim}, got shape {tuple(x.shape)}")
    return x


def check_states(name: str, x) -> torch.Tensor:
    """A cache update's ``key_states`` / ``value_states``: a tensor of a dtype the caches store (a float64 model's
    keys are refused with the remedy)."""
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must have dtype in (float16, bfloat16, float32), got {str(x.dtype).replace('torch.', '')}: "
                        f"kvlab's caches hold the keys and values of a float16, bfloat16 or float32 model "
                        f"(e.g. model.to(torch.float32))")
    return check_tensor(name, x, FLOAT_DTYPES)


def check_model_dtype(model) -> None:
    """``model``'s floating weights are float16, bfloat16 or float32, the dtypes kvlab's caches hold."""
    weight = next((p for p in model.parameters() if p.is_floating_point()), None)
    if weight is not None and weight.dtype not in FLOAT_DTYPES:
        raise TypeError(f"model must run in float16, bfloat16 or float32 (the dtypes kvlab's caches hold), its "
                        f"weights are {str(weight.dtype).replace('torch.', '')} (e.g. model.to(torch.float32))")


def check_finite(name: str, x: torch.Tensor) -> None:
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} holds NaN or Inf values; only finite values are allowed")


def check_same_device(**tensors) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"tensors must be on one device, got {listing}")


def check_kernel_device(name: str, x: torch.Tensor) -> None:
    """A Triton launch needs ``x`` on a CUDA device, or any device under ``TRITON_INTERPRET=1``."""
    if x.device.type != "cuda" and not interpreted():
        raise ValueError(
            f"{name} is on {x.device}, but kvlab's Triton kernels run on CUDA devices; move the tensors to "
            "CUDA, or set TRITON_INTERPRET=1 before triton is imported to run them on the CPU "
            "(the reference codecs, e.g. kvlab.MSECodec, encode on any device)"
        )


def vocabulary(model) -> int | None:
    """The number of rows of ``model``'s input embeddings, its vocabulary (None for a model without one)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return getattr(embeddings, "num_embeddings", None)


def check_token_ids(name: str, ids: torch.Tensor, vocab: int | None) -> None:
    """Every id of ``ids`` in ``[0, vocab)`` (one host sync; nothing to check without a vocabulary or ids)."""
    if vocab is not None and ids.numel():
        low, high = (int(t) for t in torch.aminmax(ids))
        if low < 0 or high >= vocab:
            raise ValueError(f"{name} must be token ids in [0, {vocab}) (the model's vocabulary), got range [{low}, {high}]")


def check_token_id(name: str, token, vocab: int | None) -> None:
    """One token id: an int in ``[0, vocab)``."""
    check_int(name, token, minimum=0)
    if vocab is not None and token >= vocab:
        raise ValueError(f"{name} must be a token id in [0, {vocab}) (the model's vocabulary), got {token}")


def check_device(name: str, device) -> torch.device:
    """A device this machine's torch can allocate on (``None``: the CPU)."""
    try:
        device = torch.device("cpu" if device is None else device)
        torch.empty(0, device=device)
    except (RuntimeError, TypeError, AssertionError) as exc:
        raise ValueError(f"{name} must be a torch device this machine has, got {device!r} ({exc})") from None
    return device


def check_backend_device(backend: str, device: torch.device) -> None:
    """``backend="triton"`` needs a CUDA device, or Triton's interpreter (``TRITON_INTERPRET=1``) elsewhere."""
    if backend == "triton" and device.type != "cuda" and not interpreted():
        raise ValueError(
            f"backend='triton' runs kvlab's Triton kernels, which need a CUDA device (this cache is on {device}), or "
            "TRITON_INTERPRET=1 set before triton is imported (Triton's interpreter, for tests); backend='auto' "
            "stores with the pure-torch codecs here, the same bytes"
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


# ----------------------------------------------------------------------------- the ends of fp16's range

FP16_TINY = 2.0**-14  # fp16's smallest normal number: a smaller stored scale loses its precision, then becomes 0


def check_fp16_scales(name: str, scales: torch.Tensor, what: str = "norm") -> None:
    """Stored fp16 scales: each must be 0 or in ``[FP16_TINY, FP16_MAX]`` (one host sync).

    Both ends of the range are errors alike: above it a scale would be ``inf``, below it it would lose
    its digits and, for the tiniest inputs, decode to zeros.
    """
    finite = torch.isfinite(scales)
    flags = torch.stack([(~finite).any(), (finite & (scales > FP16_MAX)).any(),
                         ((scales > 0) & (scales < FP16_TINY)).any()]).tolist()
    if flags[0]:
        raise ValueError(f"{name} holds NaN or Inf values (or vectors whose {what} overflows fp32); "
                         "only finite values can be encoded")
    if flags[1]:
        raise ValueError(f"{name} has vectors with {what} above {FP16_MAX:g} (after norm correction: norm / |c|); "
                         "it is stored in fp16")
    if flags[2]:
        raise ValueError(f"{name} has nonzero vectors with {what} below {FP16_TINY:.6g} (fp16's smallest normal "
                         f"number); a stored {what} must be 0 or in [{FP16_TINY:.6g}, {FP16_MAX:g}]: scale the input up")


def tiny_groups_message(name: str) -> str:
    return (f"{name} has groups of nonzero values whose fp16 scale and zero both underflow to 0 (values of "
            f"magnitude below about {2.0**-25:.3g}), so they would decode to zeros; a group's scale and zero "
            f"must round to a nonzero fp16 number (up to {FP16_MAX:g}) unless all its values are 0: scale the input up")


def tiny_groups(scale16: torch.Tensor, zero16: torch.Tensor, peak: torch.Tensor) -> torch.Tensor:
    """Affine groups (``peak``: largest ``|value|``) that are not all zero but whose fp16 scale and zero are both 0."""
    return ((peak > 0) & (scale16 == 0) & (zero16 == 0)).any()


def check_tiny_groups(name: str, scale16: torch.Tensor, zero16: torch.Tensor, peak: torch.Tensor) -> None:
    """The lower end of fp16's range for affine metadata, an error as overflow is: a nonzero group whose scale and
    zero both underflow to 0 would decode to zeros (subnormal scales are kept: they decode to the right values)."""
    if bool(tiny_groups(scale16, zero16, peak)):
        raise ValueError(tiny_groups_message(name))


def store_flags(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool ``[3]`` (no sync): ``x`` holds NaN/Inf; finite values beyond ``dtype``'s range; nonzero vectors (along
    the last dimension) whose largest ``|value|`` is below ``dtype``'s smallest normal number, where ``x``'s dtype
    has normal numbers there (cast to ``dtype`` they would lose their digits, the tiniest become zeros)."""
    if x.numel() == 0:
        return torch.zeros(3, dtype=torch.bool, device=x.device)
    peak = x.detach().abs().amax(-1).float()  # per vector
    finite = torch.isfinite(peak)
    flags = [(~finite).any(), (finite & (peak > torch.finfo(dtype).max)).any()]
    tiny = torch.finfo(dtype).tiny
    if x.dtype.is_floating_point and torch.finfo(x.dtype).tiny < tiny:
        flags.append(((peak > 0) & (peak < tiny)).any())
    else:
        flags.append(torch.zeros((), dtype=torch.bool, device=x.device))
    return torch.stack(flags)


def raise_store_flags(name: str, x: torch.Tensor, flags, dtype: torch.dtype, where: str, remedy: str = "") -> None:
    """The error ``store_flags`` (as a list of bools) stands for, if any: both ends of ``dtype``'s range alike."""
    nonfinite, high, low = flags
    dname, info = str(dtype).replace("torch.", ""), torch.finfo(dtype)
    allowed = (f"a stored vector must be 0 or have its largest |value| in [{info.tiny:.6g}, {info.max:g}] "
               f"({dname}'s normal range, {where})")
    if nonfinite:
        raise ValueError(f"{name} holds NaN or Inf values; only finite values can be stored")
    if high:
        peak = float(x.detach().abs().amax())
        raise ValueError(f"{name} holds values up to {peak:g}, beyond {dname}'s range (|x| <= {info.max:g}) of "
                         f"{where}; {allowed}{remedy}")
    if low:
        raise ValueError(f"{name} has nonzero vectors whose values are all below {info.tiny:.6g} in magnitude: in "
                         f"{dname} they would lose their digits or become zeros; {allowed}: scale the input up{remedy}")


def check_store(name: str, x: torch.Tensor, dtype: torch.dtype, where: str, remedy: str = "") -> None:
    """``x`` can be stored as ``dtype`` without turning into ``inf`` or into zeros (one host sync)."""
    raise_store_flags(name, x, store_flags(x, dtype).tolist(), dtype, where, remedy)


# ----------------------------------------------------------------------------- integer arguments


def check_codes(name: str, codes, bits: int) -> torch.Tensor:
    """Integer codes, each in ``[0, 2**bits)`` (one host sync)."""
    check_tensor(name, codes, (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64))
    if codes.dim() < 1:
        raise ValueError(f"{name} must have at least 1 dimension, got shape {tuple(codes.shape)}")
    if codes.numel() and bool(((codes < 0) | (codes >= (1 << bits))).any()):
        raise ValueError(f"{name} values must be integers in [0, {1 << bits}) for bits={bits}, "
                         f"got range [{int(codes.min())}, {int(codes.max())}]")
    return codes


# ----------------------------------------------------------------------------- who wrote a cache

# A paged cache is a plain uint8 tensor. The launchers that write codes into it record the identity of the
# key and value codecs that wrote it (per storage, per view: ``_same_cache``); a checked read with codecs of another identity
# (other bits in a slot of the same size, another rotation or seed) is an error instead of wrong numbers.
# A write of codes whose codecs are not known (``kvlab.mse.reference.store_slots``) forgets the record.
_WRITERS: dict = {}


def codec_identity(codec):
    """What a decoder must agree on: ``codec.identity()`` of a codec's parameters (``kvlab.params``: the kind of
    codec, its dim, bits, rotation and seed, and for centred keys the fingerprint of their statistics); None:
    unknown. A centred codec and its inner MSE codec have the same identity."""
    return None if codec is None else codec.identity()


def _describe(identity) -> str:
    if identity is None:
        return "unknown"
    if identity[0] == "centered":
        return f"centered({_describe(identity[1])}, statistics {identity[2]})"
    if identity[0] == "affine":
        return f"affine(bits={identity[1]}, group_size={identity[2]}, axis={identity[3]!r})"
    _, dim, bits, rotation, seed, correction = identity
    return f"mse(dim={dim}, bits={bits}, rotation={rotation!r}, seed={seed}, norm_correction={correction})"


def _hint(written, given) -> str:
    """Why two identities differ, where it is not plain to see."""
    if written[0] == given[0] == "centered" and written[1] == given[1]:
        return " (the same codec with other calibration statistics: mean, scale or RoPE differ)"
    if (written[0] == "centered") != (given[0] == "centered"):
        return (" (centred keys are read with the CenteredMSECodec that wrote them: load_centered_mse, or "
                "decode_attention / prefill_attention with it as key_codec)")
    return ""


def _storage_key(cache: torch.Tensor):
    return (str(cache.device), cache.untyped_storage().data_ptr())


def _view(cache: torch.Tensor):
    """The bytes a view spans, ``[start, end)``, and its strides in bytes."""
    size = cache.element_size()
    start = cache.data_ptr()
    end = start + size + sum((n - 1) * s * size for n, s in zip(cache.shape, cache.stride())) if cache.numel() else start
    return start, end, tuple(s * size for s in cache.stride())


def _same_cache(a, b) -> bool:
    """Whether two views of one storage are one cache: the same strides in their common last dimensions, and the
    span of one within the other's (a slice of a cache's blocks; not another layer of one buffer, which lies beside
    it or interleaved with it)."""
    (a0, a1, sa), (b0, b1, sb) = a, b
    k = min(len(sa), len(sb))
    if sa[len(sa) - k:] != sb[len(sb) - k:]:
        return False
    return (a0 <= b0 and b1 <= a1) or (b0 <= a0 and a1 <= b1)


def _writers_of(cache: torch.Tensor) -> list:
    """The live records of views of ``cache``'s storage that are one cache with it (dead ones are dropped)."""
    key = _storage_key(cache)
    records = [r for r in _WRITERS.get(key, []) if r[0]() is not None]  # a freed tensor's storage may be reused
    _WRITERS[key] = records
    view = _view(cache)
    return [r for r in records if _same_cache(view, r[1])]


def record_writer(cache: torch.Tensor, key_codec, value_codec) -> None:
    """Remember that ``key_codec`` / ``value_codec`` wrote ``cache`` (None: forget who did)."""
    key, view = _storage_key(cache), _view(cache)
    related = _writers_of(cache)
    _WRITERS[key] = [r for r in _WRITERS[key] if r not in related]
    if key_codec is None:
        return
    base = cache if cache._base is None else cache._base  # a view written into lives no longer than its base
    _WRITERS[key].append((weakref.ref(base), view, codec_identity(key_codec), codec_identity(value_codec)))


def check_reader(cache: torch.Tensor, key_codec=None, value_codec=None, *, names=("key_codec", "value_codec")) -> None:
    """Raise if ``cache`` was last written with codecs other than the given ones (None: not read); ``names``: the
    caller's names of the two arguments."""
    for _, _, key_id, value_id in _writers_of(cache):
        _check_identities(names, key_codec, value_codec, key_id, value_id)


def _check_identities(names, key_codec, value_codec, key_id, value_id) -> None:
    for name, codec, written in ((names[0], key_codec, key_id), (names[1], value_codec, value_id)):
        if codec is None:
            continue
        given = codec_identity(codec)
        if given != written:
            raise ValueError(f"{name} must be the codec that wrote this cache, {_describe(written)}; "
                             f"got {_describe(given)}{_hint(written, given) if written and given else ''}")
