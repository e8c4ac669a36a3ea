"""Committed results measured with kvlab's codecs were measured with the codecs as they are now."""

import json
from pathlib import Path

import pytest

from kvlab.study.fingerprint import codec_fingerprint, transform_fingerprint

RESULTS = Path(__file__).resolve().parent.parent / "results"
# results a page compares its live measurements with: they must carry the fingerprint of the codecs they used
CODEC_RESULTS = ["keys_at_three_bits.json", "formats_perplexity.json", "formats_perplexity_gemma3_270m.json", "perplexity_h200.json"]


@pytest.mark.parametrize("name", CODEC_RESULTS)
def test_committed_results_match_the_codecs(name):
    data = json.loads((RESULTS / name).read_text())
    assert "codec_fingerprint" in data, f"results/{name} does not record the codecs it was measured with"
    assert data["codec_fingerprint"] == codec_fingerprint(), (
        f"results/{name} was measured with codecs that wrote other bytes: measure it again "
        f"(its 'command' field says how)")


def test_fingerprint_is_stable():
    assert codec_fingerprint() == codec_fingerprint()


def test_transform_results_match_the_codec():
    """results/transform_codec.json was measured with the transform codec's calibration and encoding as they are."""
    data = json.loads((RESULTS / "transform_codec.json").read_text())
    assert data["codec_fingerprint"] == transform_fingerprint(), (
        "results/transform_codec.json was measured with another calibration or encoding of the transform codec: "
        "measure it again (its 'command' field says how)")


def test_second_model_results_match_the_transform_codec():
    """results/formats_perplexity_gemma3_270m.json holds transform codec rows: measured with the codec as it is."""
    data = json.loads((RESULTS / "formats_perplexity_gemma3_270m.json").read_text())
    assert data["transform_fingerprint"] == transform_fingerprint(), (
        "results/formats_perplexity_gemma3_270m.json was measured with another transform codec: measure it again "
        "(its 'command' field says how)")


def test_second_model_results_measured_the_formats_as_defined():
    """results/formats_perplexity_gemma3_270m.json measured the formats of kvlab.study.formats, each built as it is now
    (page 16 checks its live run against it)."""
    from kvlab.study import formats

    data = json.loads((RESULTS / "formats_perplexity_gemma3_270m.json").read_text())
    defined = {name: formats.describe(name) for name in formats.NAMES}
    assert data["formats"] == defined, (
        "results/formats_perplexity_gemma3_270m.json measured other formats than kvlab.study.formats defines: measure "
        "it again (its 'command' field says how)")


def test_second_model_caches_refuse_unknown_formats():
    from kvlab.study import formats

    with pytest.raises(ValueError, match=r"names must be among \['fp16', .*got \['MSE k5v5'\]"):
        formats.caches(None, None, None, ["fp16", "MSE k5v5"])
