"""benchmarks.compare: a rerun's ratios to the committed results, per group, and its exit status."""

import csv
import pathlib

import pytest

from benchmarks import compare

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIELDS = ["codec", "key_bits", "value_bits", "batch", "context", "status", "time_ms", "time_graph_ms", "host_ms",
          "device", "date"]


def write(folder: pathlib.Path, rows: list[dict], name="decode_attention.csv", fields=FIELDS) -> pathlib.Path:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / name, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    return folder


def row(codec, batch, graph, python=None, status="ok", device="GPU A", **kw):
    return dict(codec=codec, key_bits=4, value_bits=4, batch=batch, context=1024, status=status, time_graph_ms=graph,
                time_ms=graph if python is None else python, host_ms="", device=device, date="2026-12-05", **kw)


def entries(new: pathlib.Path, old: pathlib.Path, name="decode_attention.csv") -> list[dict]:
    table = compare.TABLES[name]
    return compare.compare(compare.read_points(new / name, table), compare.read_points(old / name, table), table)


def test_every_committed_results_file_compares_with_itself(capsys):
    """Each registered file is read (its point columns exist, no point twice) and equals itself."""
    assert compare.main([str(ROOT / "results"), "--tolerance", "0"]) == 0
    out = capsys.readouterr().out
    for name in compare.TABLES:
        assert name in out
    assert "other GPUs" not in out


def test_ratios_per_group_and_the_tolerance(tmp_path, capsys):
    old = write(tmp_path / "old", [row("mse", 1, 1.0), row("mse", 8, 2.0), row("affine", 1, 1.0), row("affine", 8, 4.0)])
    new = write(tmp_path / "new", [row("mse", 1, 1.02, python=3.0), row("mse", 8, 2.02), row("affine", 1, 1.3),
                                   row("affine", 8, 4.0), row("centered", 1, 9.0)])
    by = {(e["group"], e["column"]): e for e in entries(new, old)}
    mse = by[("mse, 4, 4", "time_graph_ms")]
    assert mse["points"] == 2 and mse["kind"] == "device" and mse["median"] == pytest.approx(1.015)
    assert by[("mse, 4, 4", "time_ms")]["kind"] == "python"
    assert by[("mse, 4, 4", "time_ms")]["high"] == pytest.approx(3.0)
    assert by[("affine, 4, 4", "time_graph_ms")]["low"] == pytest.approx(1.0)
    assert not any(g == "centered, 4, 4" for g, _ in by)  # only in the rerun
    assert compare.main([str(new), "--against", str(old), "--tolerance", "0.2"]) == 0
    assert "1 only in the rerun" in capsys.readouterr().out
    assert compare.main([str(new), "--against", str(old), "--tolerance", "0.05"]) == 1  # affine's median: 1.15
    assert "decode_attention.csv affine, 4, 4 time_graph_ms" in capsys.readouterr().out


def test_a_device_time_outside_the_tolerance_exits_1(tmp_path, capsys):
    old = write(tmp_path / "old", [row("mse", 1, 1.0), row("mse", 8, 1.0)])
    new = write(tmp_path / "new", [row("mse", 1, 1.2, python=1.0), row("mse", 8, 1.2, python=1.0)])
    assert compare.main([str(new), "--against", str(old)]) == 0  # reported only
    assert compare.main([str(new), "--against", str(old), "--tolerance", "0.1"]) == 1
    assert "outside the tolerance" in capsys.readouterr().out
    slow_python = write(tmp_path / "py", [row("mse", 1, 1.0, python=5.0), row("mse", 8, 1.0, python=5.0)])
    assert compare.main([str(slow_python), "--against", str(old), "--tolerance", "0.1"]) == 0  # Python times not checked


def test_eager_generation_steps_are_python_times(tmp_path):
    fields = ["cache", "mode", "batch", "context", "status", "ms_per_step", "device", "date"]
    rows = [dict(cache="kvlab mse k4v4", mode=m, batch=1, context=4096, status="ok", ms_per_step=t, device="G", date="d")
            for m, t in (("eager", 10.0), ("graph", 5.0))]
    old = write(tmp_path / "old", rows, "generate.csv", fields)
    new = write(tmp_path / "new", [dict(r, ms_per_step=2 * float(r["ms_per_step"])) for r in rows], "generate.csv", fields)
    kinds = {e["group"]: e["kind"] for e in entries(new, old, "generate.csv")}
    assert kinds == {"kvlab mse k4v4, eager": "python", "kvlab mse k4v4, graph": "device"}


def test_rows_not_ok_and_empty_times_are_left_out(tmp_path):
    old = write(tmp_path / "old", [row("mse", 1, 1.0), row("mse", 8, 1.0), row("mse", 32, "")])
    new = write(tmp_path / "new", [row("mse", 1, 1.0), row("mse", 8, 50.0, status="skipped: out of memory"),
                                   row("mse", 32, 2.0)])
    graph = [e for e in entries(new, old) if e["column"] == "time_graph_ms"]
    assert len(graph) == 1 and graph[0]["points"] == 1 and graph[0]["median"] == 1.0


def test_another_gpu_is_named(tmp_path, capsys):
    old = write(tmp_path / "old", [row("mse", 1, 1.0)])
    new = write(tmp_path / "new", [row("mse", 1, 0.7, device="GPU B")])
    assert compare.main([str(new), "--against", str(old)]) == 0
    assert "other GPUs" in capsys.readouterr().out


def test_bad_inputs(tmp_path, capsys):
    old = write(tmp_path / "old", [row("mse", 1, 1.0)])
    empty = tmp_path / "empty"
    empty.mkdir()
    assert compare.main([str(empty), "--against", str(old)]) == 2  # no file in both
    assert "no results file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        compare.main([str(tmp_path / "missing"), "--against", str(old)])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        compare.main([str(old), "--against", str(old), "--tolerance", "1.5"])
    twice = write(tmp_path / "twice", [row("mse", 1, 1.0), row("mse", 1, 2.0)])
    assert compare.main([str(twice), "--against", str(old)]) == 2
    assert "appears twice" in capsys.readouterr().err
    other = write(tmp_path / "other", [{"x": 1}], fields=["x"])
    assert compare.main([str(other), "--against", str(old)]) == 2
    assert "no column codec" in capsys.readouterr().err
