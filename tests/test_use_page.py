"""The code of the page "Use kvlab with your model" (book/use.md) runs as shown.

Every ```python block of the page runs in order in one namespace, on the CPU, with a small random Llama
(SmolLM2's tokenizer and head dimension, 2 layers) standing in for the model that ``kvlab.load_model``
returns: the lines are the page's, only the weights are smaller.
"""

import re
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvlab
import kvlab.hf.model as M

PAGE = Path(__file__).resolve().parent.parent / "book" / "use.md"

pytestmark = pytest.mark.usefixtures("one_thread")


def page_code() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", PAGE.read_text(), re.S | re.M)


def test_use_page_code_runs(monkeypatch, tmp_path):
    _, tokenizer = M.load_model()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=4096)
    small = LlamaForCausalLM(cfg).eval()
    monkeypatch.setattr(kvlab, "load_model", lambda device="cpu", **kw: (small.to(device), tokenizer))
    monkeypatch.chdir(tmp_path)  # the page saves a file
    blocks = page_code()
    assert len(blocks) >= 6 and "kvlab.load_model(" in blocks[0]
    ns: dict = {}
    for source in blocks:
        exec(compile(source, str(PAGE), "exec"), ns)
    # what the page says the lines do
    assert ns["out"].path == "fused" and ns["out"].sequences.shape[1] == ns["ids"].shape[1] + 32
    assert set(ns["results"]) == {"fp16", "mse k4v4", "kivi k4v4"}
    assert ns["results"]["fp16"].bits_per_element == 16 and ns["results"]["mse k4v4"].bits_per_element == 4.25
    assert ns["cache"].key_stats is ns["stats"]
    assert ns["t_cache"].transform is ns["kv"] and ns["t_cache"].get_seq_length() > 0
    assert (tmp_path / "transform-3.5.pt").is_file()
    assert abs(ns["kv3"].bits_per_element() - ns["kv"].bits_per_element() + 0.5) < 0.1  # the global codec at 3.0 bits
    assert ns["out_fused"].path == "fused" and ns["kv_fused"].bits_per_element() <= 3.5
