"""What the pages measure with: ``metrics`` (codec error, synthetic vectors), ``analysis`` (real K/V
captured from a model), ``simulated`` (a cache of decoded vectors for codecs kvlab does not store),
``qjl`` (the inner-product codec of page 05), ``formats`` (the formats measured on the second model) and
``fingerprint`` (the identity of recorded results)."""

_MODULES = ("analysis", "fingerprint", "formats", "metrics", "qjl", "simulated")


def __getattr__(name):  # submodules on first use (some import transformers)
    import importlib

    if name in _MODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
