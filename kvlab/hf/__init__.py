"""transformers integration: ``cache`` (``KVCache``, a transformers ``Cache`` that stores K/V as codes),
``generation`` (``PagedKVCache``, the ``"kvlab"`` attention implementation and ``generate``), ``model``
(the SmolLM2-135M loader, ``corpus``, ``perplexity``) and ``decode_view`` (every scored query attends as a
decode step would). These modules import transformers; ``kvlab`` loads them on first use."""

_MODULES = ("cache", "decode_view", "generation", "model")


def __getattr__(name):  # submodules on first use (some import transformers)
    import importlib

    if name in _MODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
