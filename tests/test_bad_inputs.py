"""Bad and edge inputs at kvlab's public entry points: each is a clear error (naming the argument and what
is allowed) or a correct result, and every call that fails leaves the cache, the sweep folder and
results.csv as they were.

Classes: sweep results (glued nan/inf, one table per folder, concurrent writers, stopping, bad options),
the cache's 16-bit parts (range, integer inputs), atomic cache updates, reading a cache with other codecs,
decode attention (large scores, unchecked out-of-range tables), low-level helpers (codes, sizes,
dimensions, shapes, layer indices), both ends of fp16's range for stored scales; centred keys read with
other calibration statistics, both ends of the cache's 16-bit parts, SimulatedCache (states, layer
indices, fp16 parts, atomic updates, parts), sweep inputs that crashed, hung or failed after every run
(malformed or non-UTF-8 notebooks, huge grids, outputs that are folders, unreadable tables, a stop
that waited for the runs in flight, the locale), perplexity's ids, window and cache factory.
"""

import csv
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

import kvlab
from kvlab import sweep as S
from kvlab.sweep import api as SA, executors as SX, run as SR
from kvlab.hf.cache import KVCache, KVFormat
from kvlab.attention.reference import decode_attention_reference
from kvlab.mse.reference import load_slots, store_slots

NOTEBOOK = Path(__file__).parent / "data" / "sweep_point.ipynb"
DIM, HEADS = 64, 2
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # kernel calls: CUDA tensors, or CPU ones under the interpreter


# ----------------------------------------------------------------------------- helpers


def snapshot(obj, depth=0):
    """Everything a KVCache layer holds, deep: tensors cloned, lists copied, kvlab's part objects opened."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", obj.dtype, tuple(obj.shape), obj.detach().clone())
    if isinstance(obj, (list, tuple)):
        return [snapshot(x, depth + 1) for x in obj]
    if depth < 3 and type(obj).__module__ == "kvlab.hf.cache":
        return {k: snapshot(v, depth + 1) for k, v in vars(obj).items()}
    return obj


def same(a, b) -> bool:
    if isinstance(a, tuple) and a and a[0] == "tensor":
        return isinstance(b, tuple) and a[:3] == b[:3] and torch.equal(a[3], b[3])
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a is b or a == b


def assert_fails_unchanged(cache, call, error, match):
    """``call()`` raises ``error`` matching ``match`` and leaves every layer of ``cache`` exactly as it was."""
    before = [snapshot(layer) for layer in cache.layers]
    lengths = [layer.get_seq_length() for layer in cache.layers]
    with pytest.raises(error, match=match):
        call()
    assert [layer.get_seq_length() for layer in cache.layers] == lengths
    for b, layer in zip(before, cache.layers):
        assert same(b, snapshot(layer))


def small_cache(fmt, layers=1, **options):
    options.setdefault("backend", "reference")
    return KVCache(fmt, num_layers=layers, num_kv_heads=HEADS, head_dim=DIM, **options)


def states(tokens=3, scale=1.0, batch=1, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, HEADS, tokens, DIM, generator=g) * scale
    v = torch.randn(batch, HEADS, tokens, DIM, generator=g) * scale
    return k.to(dtype), v.to(dtype)


def folder_state(path: Path) -> dict:
    """Every file under ``path`` and its bytes."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def paged(kb=4, vb=3, blocks=4, block_size=16):
    layout = kvlab.MSESlot(DIM, kb, vb)
    return torch.zeros(blocks, block_size, HEADS, layout.slot_bytes, dtype=torch.uint8, device=DEVICE)


# ----------------------------------------------------------------------------- sweep results


@pytest.mark.parametrize("text, expected", [
    ("nan", math.nan), ("inf", math.inf), ("-inf", -math.inf), ("np.float64(nan)", math.nan),
    ("np.float32(-inf)", -math.inf), ("tensor(nan)", math.nan), ("tensor(inf)", math.inf),
])
def test_glued_nan_and_inf_are_values(text, expected):
    value = S.decode_glued(text)
    assert isinstance(value, float)
    assert (math.isnan(value) and math.isnan(expected)) or value == expected


def _table(directory):
    with open(directory / "results.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def _rows(values, glued=None):
    return [{"a": a, **({"x": glued} if glued is not None else {}), "status": "ok", "duration_s": 0.1, "error": "",
             "notebook": f"a={a}.ipynb"} for a in values]


def test_glued_nan_is_written_as_nan_not_empty(tmp_path):
    SA._write_csv(tmp_path / "results.csv", ["a", "x", *S.STATUS_COLUMNS], _rows([1], math.nan) + _rows([2]), ["a"])
    rows = _table(tmp_path)
    assert rows[0]["x"] == "nan" and rows[1]["x"] == ""  # "not glued" stays distinguishable


def test_two_sweeps_into_one_folder_keep_both_tables_rows(tmp_path):
    columns = ["a", "x", *S.STATUS_COLUMNS]
    SA._write_csv(tmp_path / "results.csv", columns, _rows([1, 2], 1.5), ["a"])
    SA._write_csv(tmp_path / "results.csv", columns, _rows([3, 2], 2.5), ["a"])
    rows = _table(tmp_path)
    assert [(r["a"], r["x"]) for r in rows] == [("1", "1.5"), ("2", "2.5"), ("3", "2.5")]  # 2 replaced in place


def test_concurrent_table_writers_neither_crash_nor_lose_rows(tmp_path):
    columns = ["a", *S.STATUS_COLUMNS]
    errors = []

    def writer(values):
        try:
            for v in values:
                SA._write_csv(tmp_path / "results.csv", columns, _rows([v]), ["a"])
        except BaseException as exc:  # noqa: BLE001  reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(range(i, 40, 4),)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(int(r["a"]) for r in _table(tmp_path)) == list(range(40))
    assert not list(tmp_path.glob("*.partial"))


def test_a_sweep_over_other_parameters_is_refused_and_changes_nothing(tmp_path, capsys):
    directory = tmp_path / "out" / "sweep_point"
    directory.mkdir(parents=True)
    SA._write_csv(directory / "results.csv", ["b", *S.STATUS_COLUMNS], [{"b": 1, "status": "ok", "duration_s": 0.1,
                                                                          "error": "", "notebook": ""}], ["b"])
    before = folder_state(tmp_path)
    assert S.main([str(NOTEBOOK), "-p", "a", "1", "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    assert "holds runs over the parameters (b)" in capsys.readouterr().err
    assert folder_state(tmp_path) == before


def test_out_that_is_a_file_is_exit_2(tmp_path, capsys):
    out = tmp_path / "out"
    out.write_text("not a folder")
    assert S.main([str(NOTEBOOK), "-p", "a", "1", "--out", str(out), "--no-progress"]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert out.read_text() == "not a folder" and sorted(os.listdir(tmp_path)) == ["out"]


def test_malformed_dask_address_is_exit_2(tmp_path, capsys):
    pytest.importorskip("distributed")
    out = tmp_path / "out"
    code = S.main([str(NOTEBOOK), "-p", "a", "1", "--out", str(out), "--no-progress", "--executor", "dask",
                   "--address", "not an address"])
    assert code == 2
    assert "--address not an address: cannot reach a Dask scheduler" in capsys.readouterr().err
    assert not out.exists()


def test_a_stopped_run_ends_papermill_and_its_kernel(tmp_path):
    # stands for papermill: a process that starts a "kernel" in a session of its own, then waits
    pid_file = tmp_path / "kernel.pid"
    script = ("import subprocess, sys, time\n"
              "k = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
              f"open({str(pid_file)!r}, 'w').write(str(k.pid))\n"
              "time.sleep(60)\n")
    SR.ABORT.clear()
    result = {}

    def run():
        try:
            SR._papermill([sys.executable, "-c", script], dict(os.environ), tmp_path / "log.txt")
        except KeyboardInterrupt:
            result["interrupted"] = True

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 20
    while not (pid_file.is_file() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    kernel = int(pid_file.read_text())
    SR.ABORT.set()
    thread.join(30)
    SR.ABORT.clear()
    assert result == {"interrupted": True}
    assert not running(kernel)


def running(pid: int) -> bool:
    """Whether ``pid`` runs (a killed process not yet reaped by its new parent is a zombie: not running)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        if state in ("Z", "X"):
            return False
        time.sleep(0.05)
    return True


def test_an_interrupted_run_leaves_no_temporary_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def interrupted(cmd, env, log):
        raise KeyboardInterrupt

    monkeypatch.setattr(SR, "_papermill", interrupted)
    task = S.Task("sweep_point.ipynb", NOTEBOOK.read_text(), {"a": 1}, {"TRITON_INTERPRET": "1"})
    with pytest.raises(KeyboardInterrupt):
        S.execute(task)
    assert not list(tmp_path.glob("kvlab-sweep-*"))


def test_a_cell_timeout_is_reported_as_a_timeout(monkeypatch):
    nb = json.loads(NOTEBOOK.read_text())
    code = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"][-1]
    nb["cells"][code]["outputs"] = [{"output_type": "error", "ename": "KeyboardInterrupt", "evalue": "",
                                     "traceback": []}]

    def timed_out(cmd, env, log):
        Path(cmd[4]).write_text(json.dumps(nb))
        return subprocess.CompletedProcess(cmd, 1, stdout="nbclient.exceptions.CellTimeoutError: A cell timed out\n")

    monkeypatch.setattr(SR, "_papermill", timed_out)
    outcome = S.execute(S.Task("sweep_point.ipynb", NOTEBOOK.read_text(), {"a": 1}, {"TRITON_INTERPRET": "1"}, 5))
    assert not outcome.ok
    assert "timed out: it ran longer than --execution-timeout 5 s" in outcome.error
    assert "KeyboardInterrupt" not in outcome.error


# ----------------------------------------------------------------------------- the cache's 16-bit parts


@pytest.mark.parametrize("fmt, options", [
    (KVFormat("fp16"), {}),
    (KVFormat("affine", 4), {"residual": 4}),  # the residual window
    (KVFormat("mse", 4), {}),  # the tail the codec reads
    (KVFormat("mse", 4), {"sink": 2}),
])
def test_values_beyond_fp16_are_an_error_not_inf(fmt, options):
    cache = small_cache(fmt, **options)
    cache.update(*states(2), 0)
    k, v = states(2)
    k[0, 0, 0, 0] = 1e5  # finite, beyond fp16
    assert_fails_unchanged(cache, lambda: cache.update(k, v, 0), ValueError,
                           r"key_states holds values up to 100000, beyond float16's range \(\|x\| <= 65504\)")


def test_values_beyond_fp16_fit_a_float32_cache():
    cache = small_cache(KVFormat("fp16"), dtype=torch.float32, prefill="stored")
    k, v = states(2)
    k[0, 0, 0, 0] = 1e5
    out_k, out_v = cache.update(k, v, 0)
    assert torch.equal(out_k, k) and torch.equal(out_v, v)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool, torch.float64])
def test_non_float_states_are_a_type_error(dtype):
    cache = small_cache(KVFormat("affine", 4))
    k, v = states(2)
    assert_fails_unchanged(cache, lambda: cache.update((k * 10).to(dtype), (v * 10).to(dtype), 0), TypeError,
                           r"key_states must have dtype in \(float16, bfloat16, float32\)")


def test_nan_states_are_an_error():
    cache = small_cache(KVFormat("fp16"))
    k, v = states(2)
    v[0, 1, 1, 3] = math.nan
    assert_fails_unchanged(cache, lambda: cache.update(k, v, 0), ValueError, "value_states holds NaN or Inf")


# ----------------------------------------------------------------------------- atomic updates


@pytest.mark.parametrize("fmt, options", [
    (KVFormat("mse", 3, 2), {}),
    (KVFormat("mse", 4), {"residual": 1}),
    (KVFormat("affine", 4), {"dtype": torch.float32}),
    (KVFormat("affine", 2, key_axis="channel", group_size=8), {"dtype": torch.float32}),
])
def test_a_failed_update_leaves_the_cache_as_it_was(fmt, options):
    cache = small_cache(fmt, layers=2, **options)
    for layer in range(2):
        cache.update(*states(8 if fmt.key_axis == "channel" else 3), layer)
    k, v = states(8 if fmt.key_axis == "channel" else 3, seed=1)
    if fmt.codec == "mse":
        k[0, 1, 0] = 60000.0  # every element fits fp16, the vector's norm does not
        match = "norm above 65504"
    else:
        k[0, 1, 0, :] = 1e-9  # a group of tiny values: its scale and zero would underflow fp16 to 0
        k[0, 1, :, :8] = 1e-9
        match = "scale and zero both underflow to 0"
    assert_fails_unchanged(cache, lambda: cache.update(k, v, 1), ValueError, match)
    # and the cache goes on: the same update without the bad token works, lengths add up
    good_k, good_v = states(8 if fmt.key_axis == "channel" else 3, seed=1)
    cache.update(good_k, good_v, 1)
    assert cache.layers[1].get_seq_length() == cache.layers[0].get_seq_length() + good_k.shape[2]


def test_a_failed_first_update_leaves_the_layer_uninitialized():
    cache = small_cache(KVFormat("mse", 4))
    k, v = states(2)
    k[0, 0, 1] = 60000.0
    assert_fails_unchanged(cache, lambda: cache.update(k, v, 0), ValueError, "norm above 65504")
    assert not cache.layers[0].is_initialized
    cache.update(*states(2), 0)
    assert cache.get_seq_length() == 2


# ----------------------------------------------------------------------------- shapes and layer indices


@pytest.mark.parametrize("shape, match", [
    ((1, HEADS + 1, 2, DIM), r"key_states must be \[1, 2, tokens, 64\]"),
    ((1, HEADS, 2, DIM // 2), r"key_states must be \[1, 2, tokens, 64\]"),
    ((2, HEADS, 2, DIM), r"key_states must be \[1, 2, tokens, 64\] \(the batch of the layer's first update"),
    ((HEADS, 2, DIM), r"key_states must be \[batch, 2, tokens, 64\]"),
])
def test_changed_shapes_mid_cache_are_named(shape, match):
    cache = small_cache(KVFormat("affine", 4))
    cache.update(*states(2), 0)
    x = torch.randn(shape)
    assert_fails_unchanged(cache, lambda: cache.update(x, x.clone(), 0), ValueError, match)


def test_value_shape_must_match_key_shape():
    cache = small_cache(KVFormat("mse", 4))
    k, _ = states(2)
    _, v = states(3)
    assert_fails_unchanged(cache, lambda: cache.update(k, v, 0), ValueError, "value_states must have the shape of key_states")


@pytest.mark.parametrize("layer_idx, error, match", [
    (2, ValueError, r"layer_idx must be in \[0, 2\)"),
    (-1, ValueError, r"layer_idx must be in \[0, 2\)"),
    (1.0, TypeError, "layer_idx must be an int"),
])
def test_layer_index_out_of_range(layer_idx, error, match):
    cache = small_cache(KVFormat("fp16"), layers=2)
    cache.update(*states(2), 0)
    assert_fails_unchanged(cache, lambda: cache.update(*states(2), layer_idx), error, match)


# ----------------------------------------------------------------------------- a cache read with other codecs


def _written_cache(kc, vc, tokens=5):
    cache = paged(kc.bits, vc.bits)
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(tokens, HEADS, DIM, generator=g), torch.randn(tokens, HEADS, DIM, generator=g)
    slots = torch.arange(tokens, device=DEVICE)
    kvlab.store_mse(k.to(DEVICE), v.to(DEVICE), slots, cache, kc, vc)
    return cache, slots


@pytest.mark.parametrize("reader, part, match", [
    (kvlab.MSECodec(DIM, 3), "key", "codec must be the codec that wrote this cache, mse\\(dim=64, bits=4"),
    (kvlab.MSECodec(DIM, 4, seed=1), "key", "got mse\\(dim=64, bits=4, rotation='haar', seed=1"),
    (kvlab.MSECodec(DIM, 4), "value", "codec must be the codec that wrote this cache, mse\\(dim=64, bits=3"),
])
def test_reading_with_another_codec_is_an_error(reader, part, match):
    # keys 4 bits, values 3 bits: the same slot size as keys 3, values 4
    cache, slots = _written_cache(kvlab.MSECodec(DIM, 4), kvlab.MSECodec(DIM, 3))
    before = cache.clone()
    with pytest.raises(ValueError, match=match) as failure:
        kvlab.load_mse(cache, slots, reader, part=part, space="model")
    assert str(failure.value).startswith("codec must be the codec that wrote this cache")  # load_mse's argument
    assert torch.equal(cache, before)


def test_reading_with_the_writing_codecs_is_correct():
    kc, vc = kvlab.MSECodec(DIM, 4), kvlab.MSECodec(DIM, 3)
    cache, slots = _written_cache(kc, vc)
    got = kvlab.load_mse(cache, slots, kvlab.MSECodec(DIM, 4), part="key", space="model", out_dtype=torch.float32)
    k_codes, _ = load_slots(cache, slots, kvlab.MSESlot(DIM, 4, 3))
    assert torch.allclose(got, kc.decode(k_codes), rtol=1e-5, atol=1e-6)


def test_decode_attention_with_another_seed_is_an_error():
    kc, vc = kvlab.MSECodec(DIM, 4), kvlab.MSECodec(DIM, 3)
    cache, _ = _written_cache(kc, vc)
    q = torch.randn(1, HEADS, DIM).half().to(DEVICE)
    table, lens = torch.tensor([[0]], dtype=torch.int32, device=DEVICE), torch.tensor([5], device=DEVICE)
    with pytest.raises(ValueError, match="value_codec must be the codec that wrote this cache"):
        kvlab.decode_attention(q, cache, table, lens, kc, kvlab.MSECodec(DIM, 3, seed=7))


def test_views_of_one_buffer_keep_their_own_writers():
    """Caches that are views of one allocation (one per layer) each remember the codecs that wrote them."""
    layout = kvlab.MSESlot(DIM, 4, 4)
    buffer = torch.zeros(2, 3, 4, HEADS, layout.slot_bytes, dtype=torch.uint8, device=DEVICE)
    a, b = kvlab.MSECodec(DIM, 4, seed=0), kvlab.MSECodec(DIM, 4, seed=1)
    x, slots = torch.randn(4, HEADS, DIM).to(DEVICE), torch.arange(4, device=DEVICE)
    kvlab.store_mse(x, x, slots, buffer[1], a, a)
    kvlab.store_mse(x, x, slots, buffer[0], b, b)
    with pytest.raises(ValueError, match=r"got mse\(dim=64, bits=4, rotation='haar', seed=1"):
        kvlab.load_mse(buffer[1], slots, b, part="key", space="model")
    kvlab.load_mse(buffer[1], slots, a, part="key", space="model")
    kvlab.load_mse(buffer[0], slots, b, part="key", space="model")


def test_codes_written_by_the_reference_are_not_vouched_for():
    cache, slots = _written_cache(kvlab.MSECodec(DIM, 4), kvlab.MSECodec(DIM, 3))
    other_k, other_v = kvlab.MSECodec(DIM, 3), kvlab.MSECodec(DIM, 4)  # same slot size
    x = torch.randn(5, HEADS, DIM).to(DEVICE)
    store_slots(cache, slots, other_k.encode(x), other_v.encode(x), kvlab.MSESlot(DIM, 3, 4))
    got = kvlab.load_mse(cache, slots, other_k, part="key", space="model", out_dtype=torch.float32)
    assert torch.allclose(got, other_k.decode(other_k.encode(x)), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- decode attention


def _decode_setup(tokens=20, kind="mse"):
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(tokens, HEADS, DIM, generator=g), torch.randn(tokens, HEADS, DIM, generator=g)
    k, v, slots = k.to(DEVICE), v.to(DEVICE), torch.arange(tokens, device=DEVICE)
    if kind == "mse":
        kc, vc = kvlab.MSECodec(DIM, 4), kvlab.MSECodec(DIM, 4)
        cache = paged(4, 4, blocks=2)
        kvlab.store_mse(k, v, slots, cache, kc, vc)
    else:
        kc = vc = kvlab.AffineCodec(4, 32)
        cache = torch.zeros(2, 16, HEADS, kvlab.layout.AffineSlot(DIM, 4, 4, 32).slot_bytes, dtype=torch.uint8, device=DEVICE)
        kvlab.affine.store_affine(k, v, slots, cache, kc, vc)
    table, lens = torch.tensor([[0, 1]], dtype=torch.int32, device=DEVICE), torch.tensor([tokens], device=DEVICE)
    return cache, kc, vc, table, lens


@pytest.mark.parametrize("kind", ["mse", "affine"])
@pytest.mark.parametrize("scale, magnitude", [(1e4, 1.0), (None, 5000.0)])
def test_decode_with_large_scores_is_finite_and_right(kind, scale, magnitude):
    cache, kc, vc, table, lens = _decode_setup(kind=kind)
    q = (torch.randn(1, HEADS, DIM, generator=torch.Generator().manual_seed(9)) * magnitude).half().to(DEVICE)
    out = kvlab.decode_attention(q, cache, table, lens, kc, vc, scale=scale)
    ref = decode_attention_reference(q, cache, table, lens, kc, vc, scale=scale)
    assert torch.isfinite(out).all()
    assert float((out.float() - ref).norm() / ref.norm()) < 5e-3


@pytest.mark.parametrize("table, lens", [
    ([[0, 1000]], [20]), ([[-3, 1]], [20]), ([[0, 1]], [10**6]), ([[0, 1]], [-5]),
])
def test_unchecked_decode_never_reads_outside_the_cache(table, lens):
    cache, kc, vc, _, _ = _decode_setup()
    q = torch.randn(1, HEADS, DIM).half().to(DEVICE)
    out = kvlab.decode_attention(q, cache, torch.tensor(table, dtype=torch.int32, device=DEVICE),
                                 torch.tensor(lens, device=DEVICE), kc, vc, check=False)
    assert out.shape == q.shape  # garbage in, numbers out: no read outside the cache


@pytest.mark.parametrize("table, lens, match", [
    ([[0, 1000]], [20], r"block_table entries of used blocks must be in \[0, 2\)"),
    ([[0, 1]], [10**6], r"seq_lens must be <= max_blocks \* block_size = 32"),
    ([[0, 1]], [0], "seq_lens must be >= 1"),
])
def test_checked_decode_names_the_bad_argument(table, lens, match):
    cache, kc, vc, _, _ = _decode_setup()
    with pytest.raises(ValueError, match=match):
        kvlab.decode_attention(torch.randn(1, HEADS, DIM).half().to(DEVICE), cache,
                               torch.tensor(table, dtype=torch.int32, device=DEVICE), torch.tensor(lens, device=DEVICE),
                               kc, vc)


# ----------------------------------------------------------------------------- low-level helpers


@pytest.mark.parametrize("idx, bits, error, match", [
    (torch.tensor([1, 16, 2]), 4, ValueError, r"idx values must be integers in \[0, 16\) for bits=4"),
    (torch.tensor([1, -1, 2]), 4, ValueError, r"idx values must be integers in \[0, 16\)"),
    (torch.tensor([1, 4]), 2, ValueError, r"idx values must be integers in \[0, 4\)"),
    (torch.tensor([1.0, 2.0]), 4, TypeError, "idx must have dtype in"),
    (torch.tensor(3), 4, ValueError, "idx must have at least 1 dimension"),
    ([1, 2], 4, TypeError, "idx must be a torch.Tensor"),
    (torch.tensor([1, 2]), 5, ValueError, r"bits must be one of \(2, 3, 4, 8\)"),
])
def test_pack_indices_refuses_what_it_cannot_represent(idx, bits, error, match):
    with pytest.raises(error, match=match):
        kvlab.packing.pack_indices(idx, bits)


@pytest.mark.parametrize("packed, n, error, match", [
    (torch.zeros(3, dtype=torch.uint8), 4, ValueError, r"packed's last dimension must be packed_bytes\(n=4, bits=4\) = 2"),
    (torch.zeros(2, dtype=torch.uint8), -1, ValueError, "n must be >= 0"),
    (torch.zeros(2, dtype=torch.uint8), 2.5, TypeError, "n must be an int"),
    (torch.zeros(2, dtype=torch.int32), 4, TypeError, "packed must have dtype in"),
])
def test_unpack_indices_refuses_mismatched_lengths(packed, n, error, match):
    with pytest.raises(error, match=match):
        kvlab.packing.unpack_indices(packed, 4, n)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_pack_unpack_round_trip_at_the_edges(bits):
    idx = torch.tensor([0, (1 << bits) - 1, 1, (1 << bits) - 2, 0])
    assert torch.equal(kvlab.packing.unpack_indices(kvlab.packing.pack_indices(idx, bits), bits, 5), idx)
    assert kvlab.packing.unpack_indices(kvlab.packing.pack_indices(idx[:0], bits), bits, 0).shape == (0,)


@pytest.mark.parametrize("dim, bits, match", [
    (-1, 4, "dim must be an int >= 0"), (2.5, 4, "dim must be an int >= 0"), (4, 0, r"bits must be an int in \[1, 8\]"),
    (4, 9, r"bits must be an int in \[1, 8\]"), (4, 4.0, r"bits must be an int in \[1, 8\]"),
])
def test_packed_bytes_sizes(dim, bits, match):
    with pytest.raises(ValueError, match=match):
        kvlab.layout.packed_bytes(dim, bits)


@pytest.mark.parametrize("args, error, match", [
    ((0, 4, 4), ValueError, "dim must be an int >= 1"), ((64.0, 4, 4), TypeError, "dim must be an int, got float"),
    ((True, 4, 4), TypeError, "dim must be an int, got bool"), ((64, 4.0, 4), TypeError, "key_bits must be an int"),
    ((64, 8, 4), ValueError, "key_bits must be 2, 3 or 4"), ((64, 4, 1), ValueError, "value_bits must be 2, 3 or 4"),
])
def test_mse_slot_sizes(args, error, match):
    with pytest.raises(error, match=match):
        kvlab.MSESlot(*args)


@pytest.mark.parametrize("make, match", [
    (lambda: kvlab.lloyd_max(4, 10**12), r"dim must be in \[3, 16777216\]"),
    (lambda: kvlab.MSECodec(10**7, 4), r"dim must be in \[3, 8192\]"),
    (lambda: kvlab.rotation.rotation_matrix("haar", 10**6), r"dim must be in \[3, 8192\]"),
    (lambda: KVCache(KVFormat("mse", 4), num_layers=1, num_kv_heads=1, head_dim=10**6), r"head_dim must be in \[3, 8192\]"),
])
def test_absurd_dimensions_fail_at_once(make, match):
    start = time.monotonic()
    with pytest.raises(ValueError, match=match):
        make()
    assert time.monotonic() - start < 0.5


# ----------------------------------------------------------------------------- both ends of fp16's range


@pytest.mark.parametrize("factor, match", [(1e-6, "below 6.10352e-05"), (1e4, "above 65504")])
def test_mse_scales_outside_fp16_are_errors_at_both_ends(factor, match):
    x = torch.randn(3, DIM) * factor
    with pytest.raises(ValueError, match=match):
        kvlab.MSECodec(DIM, 4).encode(x)


def test_mse_zero_and_smallest_normal_vectors_encode():
    codec = kvlab.MSECodec(DIM, 4)
    x = torch.zeros(2, DIM)
    x[1] = torch.randn(DIM) / torch.randn(DIM).norm() * 1e-3  # norm 1e-3: a normal fp16 scale
    y = codec.decode(codec.encode(x))
    assert torch.equal(y[0], torch.zeros(DIM))
    assert float((y[1] - x[1]).norm() / x[1].norm()) < 0.2  # the codec's error, not 1.0


@pytest.mark.parametrize("axis", ["token", "channel"])
def test_affine_groups_decoding_to_zeros_are_errors_reference_and_kernel_alike(axis):
    x = torch.randn(32, DIM).to(DEVICE)
    x[:, :32] *= 1e-9  # token axis: every row's first group; channel axis: channels 0-31 of the token group
    codec = kvlab.AffineCodec(4, 32, axis)
    with pytest.raises(ValueError, match="scale and zero both underflow to 0"):
        codec.encode(x)
    with pytest.raises(ValueError, match="scale and zero both underflow to 0"):
        kvlab.encode_affine(x, 4, 32, axis)
    # zeros are exact, and a subnormal scale (range 3e-6) decodes to the right values
    zeros = torch.zeros(32, DIM, device=DEVICE)
    assert torch.equal(kvlab.encode_affine(zeros, 4, 32, axis), codec.encode(zeros))
    small = (torch.rand(32, DIM) * 3e-6).to(DEVICE)
    codes = kvlab.encode_affine(small, 4, 32, axis)
    assert torch.equal(codes, codec.encode(small))
    assert float((codec.decode(codes, DIM) - small).norm() / small.norm()) < 0.2  # not zeros (error 1.0)


def test_mixed_affine_groups_decoding_to_zeros_are_errors():
    layout = kvlab.affine.MixedAffineLayout([4, 8], DIM, 32)
    x = torch.randn(3, 2, DIM).to(DEVICE)
    x[1, 1, 32:] = 1e-9
    with pytest.raises(ValueError, match="scale and zero both underflow to 0"):
        kvlab.affine.encode_affine_mixed(x, layout)


def test_store_mse_tiny_vectors_are_an_error_and_the_cache_is_unchanged():
    kc, vc = kvlab.MSECodec(DIM, 4), kvlab.MSECodec(DIM, 3)
    cache, slots = _written_cache(kc, vc)
    before = cache.clone()
    k = torch.randn(5, HEADS, DIM)
    k[2, 1] *= 1e-7
    with pytest.raises(ValueError, match="key has nonzero vectors with norm below 6.10352e-05"):
        kvlab.store_mse(k.to(DEVICE), torch.randn(5, HEADS, DIM).to(DEVICE), slots, cache, kc, vc)
    assert torch.equal(cache, before)  # the slots written before the check are put back


# ----------------------------------------------------------------------------- centred keys read with other statistics


def _stats(seed, rope=False):
    g = torch.Generator().manual_seed(seed)
    mean, scale = torch.randn(HEADS, DIM, generator=g), torch.rand(HEADS, DIM, generator=g) + 0.5
    r = kvlab.RoPE(1e4 ** -(torch.arange(0, DIM, 2, dtype=torch.float64) / DIM)) if rope else None
    return mean, scale, r


def _centered(seed=0, rope=False):
    mean, scale, r = _stats(seed, rope)
    return kvlab.CenteredMSECodec(DIM, 4, mean, scale, rope=r)


def _centered_cache(tokens=5):
    kc, vc = _centered(), kvlab.MSECodec(DIM, 4)
    g = torch.Generator().manual_seed(4)
    k = torch.randn(tokens, HEADS, DIM, generator=g) + kc.mean
    v = torch.randn(tokens, HEADS, DIM, generator=g)
    cache, slots = paged(4, 4, blocks=1), torch.arange(tokens, device=DEVICE)
    kvlab.centered.store_centered_mse(k.to(DEVICE), v.to(DEVICE), slots, cache, kc, vc)
    return cache, slots, k, vc


@pytest.mark.parametrize("reader, match", [
    (lambda: _centered(seed=1), r"statistics [0-9a-f]{12}\); got centered\(.*statistics [0-9a-f]{12}\) \(the same codec "
                                r"with other calibration statistics"),
    (lambda: _centered(rope=True), "other calibration statistics"),
    (lambda: kvlab.CenteredMSECodec(DIM, 4, *_stats(0)[:2], seed=1), r"got centered\(mse\(dim=64, bits=4, rotation='haar', seed=1"),
])
def test_centered_cache_read_with_other_statistics_is_an_error(reader, match):
    cache, slots, _, vc = _centered_cache()
    before, codec = cache.clone(), reader()
    q = torch.randn(1, HEADS, DIM).half().to(DEVICE)
    table, lens = torch.tensor([[0]], dtype=torch.int32, device=DEVICE), torch.tensor([5], device=DEVICE)
    calls = [
        lambda: kvlab.centered.load_centered_mse(cache, slots, codec, positions=slots.cpu()),
        lambda: kvlab.decode_attention(q, cache, table, lens, codec, vc),
        lambda: kvlab.prefill_attention(q[:, None], cache, table, lens, codec, vc),
    ]
    for call, name in zip(calls, ("codec", "key_codec", "key_codec")):
        with pytest.raises(ValueError, match=f"{name} must be the codec that wrote this cache, centered.*" + match):
            call()
    assert torch.equal(cache, before)


def test_centered_and_plain_codes_are_not_read_as_each_other():
    cache, slots, _, vc = _centered_cache()
    with pytest.raises(ValueError, match=r"got mse\(dim=64.*\(centred keys are read with the CenteredMSECodec"):
        kvlab.load_mse(cache, slots, kvlab.MSECodec(DIM, 4), part="key", space="model")
    plain, plain_slots = _written_cache(kvlab.MSECodec(DIM, 4), kvlab.MSECodec(DIM, 3))
    with pytest.raises(ValueError, match=r"codec must be the codec that wrote this cache, mse\(dim=64, bits=4.*got centered"):
        kvlab.centered.load_centered_mse(plain, plain_slots, _centered())


def test_centered_cache_read_with_its_statistics_is_correct():
    cache, slots, k, vc = _centered_cache()
    same = _centered()  # another object, built from the same statistics
    assert same.stats_fingerprint == _centered().stats_fingerprint != _centered(seed=1).stats_fingerprint
    got = kvlab.centered.load_centered_mse(cache, slots, same, out_dtype=torch.float32).cpu()
    assert float((got - k).norm() / k.norm()) < 0.15  # the codec's error at 4 bits
    q = torch.randn(1, HEADS, DIM).half().to(DEVICE)
    table, lens = torch.tensor([[0]], dtype=torch.int32, device=DEVICE), torch.tensor([5], device=DEVICE)
    out = kvlab.decode_attention(q, cache, table, lens, same, vc)
    ref = decode_attention_reference(q, cache, table, lens, same, vc)
    assert float((out.float() - ref).norm() / ref.norm()) < 5e-3


def test_stats_fingerprint_sees_one_changed_number():
    mean, scale, rope = _stats(0, rope=True)
    base = kvlab.centered.reference.stats_fingerprint(mean, scale, rope)
    bumped = mean.clone()
    bumped[1, 7] = torch.nextafter(bumped[1, 7], torch.tensor(math.inf))
    assert kvlab.centered.reference.stats_fingerprint(bumped, scale, rope) != base
    assert kvlab.centered.reference.stats_fingerprint(mean, scale, None) != base
    assert kvlab.centered.reference.stats_fingerprint(mean.clone(), scale.clone(), rope) == base


# ----------------------------------------------------------------------------- the cache's 16-bit parts at both ends


PARTS_16 = [
    pytest.param(KVFormat("fp16"), {}, id="fp16-layer"),
    pytest.param(KVFormat("affine", 4), {"residual": 4}, id="residual-window"),
    pytest.param(KVFormat("mse", 4), {"sink": 4}, id="sink"),
    pytest.param(KVFormat("mse", 4), {}, id="mse-tail"),
    pytest.param(KVFormat("affine", 4, key_axis="channel"), {}, id="open-key-group"),
    pytest.param(KVFormat("affine", [4, 8], 4), {"residual": 2}, id="mixed-residual"),
]


@pytest.mark.parametrize("fmt, options", PARTS_16)
@pytest.mark.parametrize("end", ["high", "low"])
@pytest.mark.parametrize("part", ["key_states", "value_states"])
def test_the_16_bit_parts_refuse_both_ends_of_fp16(fmt, options, end, part):
    cache = small_cache(fmt, **options)
    cache.update(*states(2), 0)
    k, v = states(2)
    x = k if part == "key_states" else v
    if end == "high":
        x[0, 1, 1, 5] = -7e4
        match = rf"{part} holds values up to 70000, beyond float16's range \(\|x\| <= 65504\)"
    else:
        x[0, 1, 1] = torch.randn(DIM) * 1e-9  # every value underflows fp16 (to 0 or a subnormal of no digits)
        match = rf"{part} has nonzero vectors whose values are all below 6.10352e-05 in magnitude"
    assert_fails_unchanged(cache, lambda: cache.update(k, v, 0), ValueError, match)


@pytest.mark.parametrize("fmt, options", PARTS_16)
def test_the_16_bit_parts_keep_zeros_small_vectors_and_tiny_elements(fmt, options):
    cache = small_cache(fmt, prefill="stored", **options)
    k, v = states(2)
    k[0, 0, 0] = 0.0  # a zero vector is stored exactly
    k[0, 1, 0] *= 1e-3  # a small vector whose values are normal fp16 numbers
    k[0, 1, 1, :8] = 1e-9  # tiny values in a vector that is not tiny: they lose nothing that matters
    out_k, _ = cache.update(k, v, 0)
    assert torch.equal(out_k[0, 0, 0], torch.zeros(DIM))
    small = k[0, 1, 0]
    assert float((out_k[0, 1, 0].float() - small).norm() / small.norm()) < (1e-2 if fmt.codec == "fp16" or options.get("residual") or options.get("sink") else 0.3)


def test_a_float32_cache_keeps_tiny_vectors_and_fp16_inputs_keep_their_subnormals():
    k, v = states(2)
    k[0, 0, 0] = torch.randn(DIM) * 1e-9
    out_k, _ = small_cache(KVFormat("fp16"), dtype=torch.float32, prefill="stored").update(k, v, 0)
    assert torch.equal(out_k, k)
    k16, v16 = k.half(), v.half()  # fp16 inputs into fp16 storage: nothing is lost, nothing to refuse
    out_k, _ = small_cache(KVFormat("fp16"), prefill="stored").update(k16, v16, 0)
    assert torch.equal(out_k, k16)


def test_bf16_inputs_below_fp16s_range_are_refused():
    k, v = states(2, dtype=torch.bfloat16)
    v[0, 0, 1] = (torch.randn(DIM) * 1e-12).bfloat16()
    cache = small_cache(KVFormat("fp16"))
    assert_fails_unchanged(cache, lambda: cache.update(k, v, 0), ValueError, "value_states has nonzero vectors")


# ----------------------------------------------------------------------------- SimulatedCache


def simulated(layers=1, key=None, value=None, **options):
    from kvlab.study.simulated import SimulatedCache, mse_part

    return SimulatedCache([(key or mse_part(DIM, 4), value or mse_part(DIM, 3)) for _ in range(layers)], **options)


def sim_state(cache):
    return [(layer.length, [[t.clone() for t in d] for d in getattr(layer, "decoded", ([], []))],
             [[t.clone() for t in e] for e in getattr(layer, "exact", ([], []))]) for layer in cache.layers]


def sim_same(a, b) -> bool:
    return all(la == lb and all(len(x) == len(y) and all(torch.equal(s, t) for s, t in zip(x, y))
                                for x, y in zip(da + ea, db + eb))
               for (la, da, ea), (lb, db, eb) in zip(a, b))


def sim_fails_unchanged(cache, call, error, match):
    before = sim_state(cache)
    with pytest.raises(error, match=match):
        call()
    assert sim_same(before, sim_state(cache))


@pytest.mark.parametrize("make, error, match", [
    (lambda: (torch.randint(0, 9, (1, HEADS, 2, DIM)),) * 2, TypeError, r"key_states must have dtype in \(float16, bfloat16, float32\)"),
    (lambda: tuple(x.double() for x in states(2)), TypeError, "key_states must have dtype in"),
    (lambda: (torch.randn(HEADS, 2, DIM),) * 2, ValueError, r"key_states must be \[batch, heads, tokens, head_dim\]"),
    (lambda: (torch.randn(1, HEADS + 1, 2, DIM),) * 2, ValueError, r"key_states must be \[1, 2, tokens, 64\] \(the batch, heads"),
    (lambda: states(2, batch=2), ValueError, r"key_states must be \[1, 2, tokens, 64\]"),
    (lambda: (torch.randn(1, HEADS, 2, 32),) * 2, ValueError, r"key_states must be \[1, 2, tokens, 64\]"),
    (lambda: states(2, dtype=torch.float16), TypeError, "key_states must have the dtype and device of the layer's first update"),
    (lambda: (states(2)[0], states(3)[1]), ValueError, "value_states must have the shape of key_states"),
    (lambda: (states(2)[0], states(2)[1].half()), TypeError, "value_states must have the dtype of key_states"),
])
def test_simulated_cache_bad_states_are_named(make, error, match):
    cache = simulated()
    cache.update(*states(2), 0)
    sim_fails_unchanged(cache, lambda: cache.update(*make(), 0), error, match)


@pytest.mark.parametrize("layer_idx, error", [(1, ValueError), (-1, ValueError), (0.0, TypeError), (None, TypeError)])
def test_simulated_cache_layer_index(layer_idx, error):
    cache = simulated()
    cache.update(*states(2), 0)
    sim_fails_unchanged(cache, lambda: cache.update(*states(2), layer_idx), error, "layer_idx must be")


@pytest.mark.parametrize("where, options, key", [
    ("fp16 part", {}, "fp16"), ("residual", {"residual": 3}, None), ("sink", {"sink": 8}, None),
])
@pytest.mark.parametrize("end", ["high", "low", "nan"])
def test_simulated_cache_fp16_parts_refuse_both_ends(where, options, key, end):
    from kvlab.study.simulated import fp16_part

    cache = simulated(key=fp16_part() if key else None, **options)
    cache.update(*states(2), 0)
    k, v = states(2)
    if end == "high":
        k[0, 0, 1, 3], match = 7e4, "key_states.*holds values up to 70000, beyond float16's range"
    elif end == "low":
        k[0, 1, 0], match = torch.randn(DIM) * 1e-9, "key_states.*nonzero vectors whose values are all below 6.10352e-05"
    else:
        k[0, 1, 0, 0], match = math.inf, "key_states holds NaN or Inf"
    sim_fails_unchanged(cache, lambda: cache.update(k, v, 0), ValueError, match)


@pytest.mark.parametrize("part", ["key", "value"])
def test_simulated_cache_failed_update_is_atomic_and_the_cache_goes_on(part):
    cache = simulated()
    cache.update(*states(2), 0)
    k, v = states(2, seed=1)
    (k if part == "key" else v)[0, 1, 0] = 60000.0  # every element fits fp16, the vector's norm does not
    sim_fails_unchanged(cache, lambda: cache.update(k, v, 0), ValueError,
                        f"{part}_states cannot be coded by the {part} part 'mse[34]': .*norm above 65504")
    out_k, out_v = cache.update(*states(2, seed=1), 0)
    assert cache.get_seq_length() == 4 and out_k.shape == out_v.shape == (1, HEADS, 4, DIM)


def test_simulated_cache_part_of_another_shape_and_bad_parts():
    from kvlab.study.simulated import Part, SimulatedCache, mse_part

    cache = simulated(key=Part(lambda x, pos: x[..., :8], 4.0, "truncating"))
    sim_fails_unchanged(cache, lambda: cache.update(*states(2), 0), ValueError,
                        r"the key part 'truncating' must return a tensor of the shape of its input \(1, 2, 2, 64\)")
    assert not cache.layers[0].is_initialized
    for parts, match in ((5, "parts must be a non-empty list"), ([], "parts must be a non-empty list"),
                         ([mse_part(DIM, 4)], r"parts\[0\] must be a \(key Part, value Part\) pair")):
        with pytest.raises(TypeError, match=match):
            SimulatedCache(parts)
    with pytest.raises(ValueError, match="bits_per_element must be a positive finite number"):
        Part(lambda x, pos: x, -1.0)
    with pytest.raises(TypeError, match="fn must be callable"):
        Part("not a function", 4.0)


def test_simulated_cache_returns_the_decoded_codes_and_the_exact_window():
    k_codec, v_codec = kvlab.MSECodec(DIM, 4), kvlab.MSECodec(DIM, 3)
    cache = simulated(residual=2)
    k1, v1 = states(3)
    assert cache.update(k1, v1, 0)[0] is k1  # the prompt, as given
    k2, v2 = states(2, seed=1)
    out_k, out_v = cache.update(k2, v2, 0)
    keys, values = torch.cat([k1, k2], 2), torch.cat([v1, v2], 2)
    assert torch.equal(out_k[:, :, :3], k_codec.decode(k_codec.encode(keys[:, :, :3])))
    assert torch.equal(out_v[:, :, :3], v_codec.decode(v_codec.encode(values[:, :, :3])))
    assert torch.equal(out_k[:, :, 3:], keys[:, :, 3:].half().float())


# ----------------------------------------------------------------------------- sweep: inputs that crashed, hung or failed late


@pytest.mark.parametrize("text, match", [
    ("[]", "not a notebook of nbformat 4"), ("null", "not a notebook of nbformat 4"),
    ('{"cells": 5}', "not a notebook of nbformat 4"),
    ('{"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [{"cell_type": "code", "metadata": '
     '{"tags": ["parameters"]}, "source": "a = 1"}]}', "not a valid notebook"),
    ('{"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": "a = 1"}', "not a valid notebook"),
    ("\xff", "not a notebook"),
])
def test_a_malformed_notebook_is_exit_2(tmp_path, capsys, text, match):
    notebook = tmp_path / "bad.ipynb"
    notebook.write_text(text)
    assert S.main([str(notebook), "-p", "a", "1", "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    assert match in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_huge_grid_fails_at_once(tmp_path, capsys):
    start = time.monotonic()
    code = S.main([str(NOTEBOOK), "-p", "a", ",".join(map(str, range(2000))), "-p", "b",
                   ",".join(f"{i}.5" for i in range(2000)), "--out", str(tmp_path / "out"), "--no-progress"])
    assert code == 2 and time.monotonic() - start < 5
    assert "the grid has 4000000 runs (2000 (a) x 2000 (b)), more than 100000" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["results.csv", "results.png", "a=1.ipynb", ".results.json"])
def test_an_output_that_is_a_folder_is_exit_2_before_anything_runs(tmp_path, capsys, name):
    (tmp_path / "out" / "sweep_point" / name).mkdir(parents=True)
    before = folder_state(tmp_path)
    assert S.main([str(NOTEBOOK), "-p", "a", "1", "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    assert f"{name} exists and is not a file" in capsys.readouterr().err
    assert folder_state(tmp_path) == before and sorted(os.listdir(tmp_path / "out" / "sweep_point")) == [name]


def test_an_unreadable_table_is_exit_2_and_kept(tmp_path, capsys):
    directory = tmp_path / "out" / "sweep_point"
    directory.mkdir(parents=True)
    (directory / "results.csv").write_bytes(b"a,status\n\xff\xfe,ok\n")
    before = folder_state(tmp_path)
    assert S.main([str(NOTEBOOK), "-p", "a", "1", "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    assert "results.csv cannot be read as a table" in capsys.readouterr().err
    assert folder_state(tmp_path) == before


def test_an_interrupted_local_sweep_ends_the_runs_in_flight_at_once(monkeypatch):
    # execute() stands for a run that lasts until the sweep is stopped (at most 60 s)
    def run_until_stopped(task):
        if task.parameters["a"] == 0:
            return S.Outcome(True, 0.0, "", None)
        SR.ABORT.wait(60)
        return S.Outcome(False, 0.0, "the sweep was interrupted", None)

    monkeypatch.setattr(SX, "execute", run_until_stopped)
    SR.ABORT.clear()
    tasks = {S.Run(i, {"a": i}, f"a={i}"): S.Task("n.ipynb", "", {"a": i}, {}) for i in range(2)}
    results = SX.run_local(tasks, [{}, {}])
    next(results)  # the quick run; the other is in flight
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        results.throw(KeyboardInterrupt)
    assert time.monotonic() - start < 10 and SR.ABORT.is_set()
    SR.ABORT.clear()


def test_a_second_interrupt_does_not_cut_the_ending_short(capsys):
    calls = []

    def wait():
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        SX._wait_uninterrupted(wait)
    assert len(calls) == 2 and "stopping: ending the runs in flight" in capsys.readouterr().err


# ----------------------------------------------------------------------------- perplexity and a cache written through a view


def test_a_cache_written_through_a_view_keeps_its_writer():
    kc, vc = kvlab.MSECodec(DIM, 4), kvlab.MSECodec(DIM, 3)
    base = paged(4, 3)
    slots = torch.arange(5, device=DEVICE)
    kvlab.store_mse(torch.randn(5, HEADS, DIM).to(DEVICE), torch.randn(5, HEADS, DIM).to(DEVICE), slots, base[:2], kc, vc)
    with pytest.raises(ValueError, match="codec must be the codec that wrote this cache"):  # the view is gone
        kvlab.load_mse(base, slots, kvlab.MSECodec(DIM, 4, seed=3), space="model")


@pytest.fixture(scope="module")
def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=50, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=32, max_position_embeddings=64)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("ids, options, error, match", [
    (torch.tensor([50] + [1] * 30), {}, ValueError, r"ids must be token ids in \[0, 50\) \(the model's vocabulary\), got range \[1, 50\]"),
    (torch.tensor([1] * 30 + [-1]), {}, ValueError, r"ids must be token ids in \[0, 50\).*got range \[-1, 1\]"),
    (torch.ones(200, dtype=torch.long), {"window": 128, "stride": 8}, ValueError,
     r"window \(128\) must be at most the model's max_position_embeddings \(64\)"),
    (torch.ones(40, dtype=torch.long), {"cache": lambda: 5}, TypeError,
     "cache must return a fresh transformers Cache for each window, got int"),
])
def test_perplexity_bad_inputs_are_named(tiny_model, ids, options, error, match):
    options = {"window": 16, "stride": 8, **options}
    with pytest.raises(error, match=match):
        kvlab.perplexity(tiny_model, ids, **options)


def test_perplexity_and_load_model_name_a_bad_model_or_device():
    with pytest.raises(TypeError, match="model must be a transformers causal LM"):
        kvlab.perplexity(None, torch.ones(40, dtype=torch.long), window=16, stride=8)
    with pytest.raises(ValueError, match="device must be a torch device this machine has"):
        kvlab.load_model(device="tpu")


def test_perplexity_with_a_simulated_cache_of_too_few_layers_names_layer_idx(tiny_model):
    from kvlab.study.simulated import SimulatedCache, mse_part

    with pytest.raises(ValueError, match=r"layer_idx must be in \[0, 1\)"):
        kvlab.perplexity(tiny_model, torch.ones(40, dtype=torch.long), window=16, stride=8,
                         cache=lambda: SimulatedCache([(mse_part(32, 4), mse_part(32, 4))]))


def test_a_utf16_notebook_is_exit_2(tmp_path, capsys):
    notebook = tmp_path / "utf16.ipynb"
    notebook.write_bytes(NOTEBOOK.read_text().encode("utf-16"))
    assert S.main([str(notebook), "-p", "a", "1", "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    assert "not a notebook" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_the_table_is_utf8_whatever_the_locale(tmp_path):
    script = ("import sys, locale; from pathlib import Path; from kvlab.sweep import api as SA\n"
              "assert locale.getpreferredencoding(False).lower() in ('ansi_x3.4-1968', 'ascii', 'us-ascii')\n"
              "row = {'a': 1, 'label': 'na\\u00efve \\u2211', 'status': 'ok', 'duration_s': 0.1, 'error': '', 'notebook': ''}\n"
              "SA._write_csv(Path(sys.argv[1]) / 'results.csv', ['a', 'label', *SA.STATUS_COLUMNS], [row], ['a'])\n")
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0",
           "PYTHONPATH": str(Path(__file__).parent.parent)}
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, check=True)
    assert _table(tmp_path)[0]["label"] == "na\u00efve \u2211"


@pytest.mark.parametrize("fmt", [KVFormat("mse", 4), KVFormat("affine", 4, key_axis="channel"), KVFormat("fp16")])
def test_meta_device_states_are_refused_by_name(fmt):
    """A model built on the meta device (shapes, no data) gets a clear error from a cache and a codec, not torch's."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=32)
    cache = KVCache(fmt, config=cfg)
    k = torch.zeros(1, 1, 3, 32, device="meta")
    with pytest.raises(ValueError, match="key_states is on the meta device, which holds shapes but no data"):
        cache.update(k, k, 0)
    assert cache.get_seq_length(0) == 0
    with pytest.raises(ValueError, match="x is on the meta device"):
        kvlab.MSECodec(32, 4).encode(torch.zeros(2, 32, device="meta"))
