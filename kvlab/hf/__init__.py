"""transformers integration: ``formats`` (``KVFormat``), ``cache`` (``KVCache``, a transformers ``Cache`` that
stores K/V as codes and decodes them for attention) with its per-codec ``stores``, ``paged`` (``PagedKVCache``
and the ``"kvlab"`` attention implementation, which reads the codes with ``decode_attention``), ``generation``
(``generate``), ``model`` (the loaders of SmolLM2-135M and Gemma 3 270M, ``corpus``, ``perplexity``) and
``decode_view`` (every scored query attends as a decode step would). These modules import transformers;
``kvlab`` loads them on first use."""

import transformers as _transformers
from packaging.version import Version as _Version

# Models take their cache as ``cache=`` since transformers 5.24 (``past_key_values=`` before): with an older
# transformers every forward would run without kvlab's cache, silently.
MIN_TRANSFORMERS = "5.24"
if _Version(_transformers.__version__).release < _Version(MIN_TRANSFORMERS).release:
    raise ImportError(f"kvlab's transformers integration needs transformers >= {MIN_TRANSFORMERS} (models take the "
                      f"cache as cache=), found {_transformers.__version__}: pip install 'transformers>={MIN_TRANSFORMERS}'")

_MODULES = ("cache", "decode_view", "formats", "generation", "model", "paged", "stores")


def __getattr__(name):  # submodules on first use (some import transformers)
    import importlib

    if name in _MODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
