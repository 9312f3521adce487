"""bench/run_all.py's report: figures beside baselines, the Markdown table, the plots, and its
refusal of bad parameters (the benchmarks themselves are run by the committed command)."""

from __future__ import annotations

import importlib.util
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_run_all():
    spec = importlib.util.spec_from_file_location("bench_run_all",
                                                  os.path.join(REPO, "bench", "run_all.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


run_all = load_run_all()


def report(figures):
    return {"command": "python bench/run_all.py", "finished": "2026-01-01T00:00:00Z",
            "wall_seconds": 12.0, "lock_wait_seconds": 3.0, "failed": {}, "plots": [],
            "raw": {}, "figures": figures,
            "machine": {"cpu_model": "Test CPU", "cores": 2, "ram_gib": 4.0, "kernel": "6.0",
                        "python": "3.11", "torch": "2.13.0", "etcd": "etcd 3.4"},
            "git": {"commit": "0123456789abcdef", "dirty": False}}


def test_figure_ratios_are_value_over_each_baseline():
    f = run_all.figure("snapshot", "copy", 10.0, "GB/s", [("memcpy", 12.5), ("save", 2.0)])
    assert [b["ratio"] for b in f["baselines"]] == [0.8, 5.0]
    assert f["unit"] == "GB/s" and f["better"] == "higher"


def test_missing_values_give_no_ratio():
    f = run_all.figure("recovery", "resume", 9.0, "s", [("torchrun", None)], better="lower")
    assert f["baselines"][0]["ratio"] is None
    g = run_all.figure("recovery", "resume", None, "s", [("torchrun", 5.0)])
    assert g["value"] is None and g["baselines"][0]["ratio"] is None


def test_markdown_has_one_row_per_baseline_and_the_provenance():
    figs = [run_all.figure("snapshot", "copy", 10.0, "GB/s", [("memcpy", 12.5), ("save", 2.0)],
                           target=">= 80% of memcpy"),
            run_all.figure("idle", "rss", 45.0, "MiB", [("etcd", 30.0)], better="lower")]
    md = run_all.markdown(report(figs))
    rows = [line for line in md.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + 3  # header + memcpy, save, etcd
    assert "| snapshot | copy | 10 | GB/s | higher | memcpy | 12.5 | 0.80 | >= 80% of memcpy |" in md
    assert "|  |  |  |  |  | save | 2 | 5.00 |  |" in md
    assert "`0123456789ab`" in md and "Test CPU" in md and "python bench/run_all.py" in md


def test_plots_are_png_files_one_per_benchmark(tmp_path):
    pytest.importorskip("matplotlib", reason="the 'bench' extra is not installed")
    figs = [run_all.figure("snapshot", "copy", 10.0, "GB/s", [("memcpy", 12.5)]),
            run_all.figure("snapshot", "seal", 20.0, "GB/s", [("memcpy", 12.5)]),
            run_all.figure("idle", "rss", 45.0, "MiB", [("etcd", 30.0)], better="lower")]
    paths = run_all.plot(report(figs), str(tmp_path))
    assert sorted(os.path.basename(p) for p in paths) == ["idle.png", "snapshot.png"]
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, message", [
    (["--only", "snapshot,nonsense"], "unknown benchmark"),
    (["--ttls", "2,x"], "--ttls takes whole seconds"),
    (["--nodes", "1"], "--nodes >= 2"),
])
def test_bad_parameters_are_refused_with_a_clear_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        run_all.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
