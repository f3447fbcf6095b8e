"""Smoke tests of the benchmark scripts on toy sizes, so that they never rot.

The figures of a tiny run mean nothing; what is checked is that each
benchmark runs end to end, that the steps it times are the ones it names
(their compiled memory shows every donated buffer reused), and that the
report writer produces its files. The multi-device benchmark is smoke-tested
in ``test_multidevice.py``.
"""

import importlib.util
import json
import pathlib
import subprocess
import sys

import chex
import jax
import numpy as np
import optax
import pytest

import optaxaccum as oa
from tools.tables import markdown_table

# The benchmarks' own runs (minutes on 2 cores): the development leg runs
# them; the installed legs leave them out (Makefile, INSTALLED_MARKS).
bench_smoke = pytest.mark.bench_smoke

BENCH_DIR = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name):
    # Benchmarks import their siblings (_common imports _devices).
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))
    path = BENCH_DIR / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_script(name, *args, timeout=900):
    """``python benchmarks/<name> args...`` from the repository root, in
    its own process (a benchmark is run, not imported)."""
    proc = subprocess.run(
        [sys.executable, str(BENCH_DIR / name), *args],
        cwd=BENCH_DIR.parent,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _check_result_format(res):
    for key in (
        "name",
        "title",
        "headers",
        "rows",
        "targets",
        "ratios",
        "ratio_label",
    ):
        assert key in res, key
    assert all(len(row) == len(res["headers"]) for row in res["rows"])
    for t in res["targets"]:
        assert set(t) == {"target", "measured", "met"}
        assert isinstance(t["met"], bool)
    assert res["ratios"]
    assert all(r > 0 for r in res["ratios"].values())


@bench_smoke
def test_bench_step_main_tiny():
    bench = _load("bench_step")
    res = bench.main(tiny=True)
    _check_result_format(res)
    names = [row[0] for row in res["rows"]]
    expected = ["floor", "Adam step alone"] + [
        f"{kind} {phase}"
        for kind in (
            "fused",
            "fused+noise_scale",
            "plain",
            "MultiSteps",
            "oa.MultiSteps(fused)",
            "oa.MultiSteps(plain)",
        )
        for phase in ("non-closing", "closing", f"window/{bench.K}")
    ]
    assert names == expected
    # Donation works: every tree-sized input buffer is reused for an output
    # (params and optimizer state in all three steps; the accumulator in the
    # floor), so the aliased bytes cover all tree-sized arguments except the
    # gradients.
    tree_bytes = 4 * sum(
        x.size for x in jax.tree.leaves(bench._tree(bench.TINY_SHAPES, 0))
    )
    mem = res["memory"]
    # (Outputs also count the output tuple's table of buffer pointers.)
    assert mem["floor"]["argument"] == 2 * tree_bytes
    assert tree_bytes <= mem["floor"]["output"] < tree_bytes + 64
    assert mem["floor"]["alias"] == tree_bytes
    assert mem["floor"]["temp"] == 0
    # The Adam reference: params, mu and nu donated, no tree-sized temporary.
    assert 3 * tree_bytes <= mem["Adam"]["alias"] < 3 * tree_bytes + 64
    assert mem["Adam"]["temp"] < bench.SCALARS
    for kind in bench.KINDS:
        # params, accumulator, Adam's mu and nu: 4 trees, plus scalars.
        assert 4 * tree_bytes <= mem[kind]["alias"] < 4 * tree_bytes + 64
    # ... and each donated buffer to the output it becomes: with the donated
    # arguments in another order than the outputs (e.g. a step taking
    # ``(grads, opt_state, params)``) XLA copies every leaf (21 copies here).
    assert res["tree_copies"]["floor"] == 0
    assert res["tree_copies"]["fused"] == 0
    # The noise scale adds a sum of squares per leaf, no tree-sized buffer:
    # its temporaries are the reductions' partial sums (under 1 KiB here).
    assert res["tree_copies"]["fused+noise_scale"] == 0
    noise_temp = mem["fused+noise_scale"]["temp"] - mem["fused"]["temp"]
    assert noise_temp < bench.SCALARS
    assert res["tree_copies"]["plain"] == 0
    # oa.MultiSteps, the drop-in, compiles to the same program shape as the
    # oa.chain it wraps: no leaf copied, no tree-sized temporary when fused.
    assert res["tree_copies"]["oa.MultiSteps(fused)"] == 0
    assert res["tree_copies"]["oa.MultiSteps(plain)"] == 0
    assert mem["oa.MultiSteps(fused)"]["temp"] < bench.SCALARS
    assert mem["oa.MultiSteps(plain)"]["temp"] <= mem["plain"]["temp"]


@bench_smoke
def test_bench_microbatch_main_tiny():
    bench = _load("bench_microbatch")
    res = bench.main(tiny=True)  # raises if a variant's result is wrong
    _check_result_format(res)
    assert set(res["seconds"]) == {
        "full batch",
        "optax microbatch",
        "optax micro_grad",
        "oa.microbatched",
        "lax.scan by hand",
    }
    assert list(res["temp_by_num_microbatches"]) == list(bench.SWEEP)
    assert (
        res["temp_by_num_microbatches"][bench.NUM_MICROBATCHES]
        == res["memory"]["oa.microbatched"]["temp"]
    )


def test_run_all_write_report(tmp_path):
    run_all = _load("run_all")
    results = [
        {
            "name": "Bx",
            "title": "Bx: a made-up benchmark",
            "headers": ["variant", "ms"],
            "rows": [["slow one", "2.00"], ["fast one", "0.50"]],
            "targets": [{"target": "fast", "measured": "0.25x", "met": True}],
            "ratios": {"Bx slow one": 4.0, "Bx fast one": 1.0},
            "ratio_label": "time / fast one",
            "wall_s": 1.0,
        }
    ]
    json_path, md_path, png_path = run_all.write_report(
        results, str(tmp_path), tiny=True
    )
    md = pathlib.Path(md_path).read_text()
    # The record holds the tables the pages quote; RESULTS.md is made from it.
    record = json.loads(pathlib.Path(json_path).read_text())
    assert record["results"][0]["rows"] == results[0]["rows"]
    assert record["meta"]["tiny"] is True and record["hand"] == []
    assert md.startswith(run_all.render_report(record))
    for text in (
        "Bx: a made-up benchmark",
        "| slow one | 2.00 |",
        "| fast   | 0.25x    | yes |",
        "jax " + jax.__version__,
        "cpu_count",
        "device_kind",
        "load average",
        "results.png",
    ):
        assert text in md, text
    png = pathlib.Path(png_path).read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000


def test_markdown_table_aligns_columns():
    table = markdown_table(["a", "bb"], [["xyz", 1]])
    assert table.splitlines() == [
        "| a   | bb |",
        "|-----|----|",
        "| xyz | 1  |",
    ]


def test_bn_pooling_script_runs():
    out = _run_script("bn_pooling.py").stdout
    assert out.count("AccumBatchNorm vs nn.BatchNorm") == 2


@bench_smoke
def test_bench_compile_main_quick():
    """B5 on toy trees: every configuration compiles in its own process and
    reports its stages, peak RSS and HLO counts; the gated configurations
    hold one conditional."""
    bench = _load("bench_compile")
    res = bench.main(tiny=True)
    _check_result_format(res)
    for config in bench.CONFIGS:
        for n in bench.QUICK_SIZES:
            (run,) = res["runs"][f"{config} N={n}"]
            assert "error" not in run, run
            assert run["total_cpu_s"] > 0 and run["peak_rss_kib"] > 0
            gated = config.startswith(("README", "accumulate", "scale per"))
            assert run["conditionals"] == gated, (config, run["conditionals"])
    assert set(res["seconds"]) == {
        "tree add (floor)",
        "accumulate fused non-closing",
        "accumulate fused identity step",
        "README fused non-closing",
        "README fused identity step",
    }


def test_run_all_keeps_hand_recorded_sections(tmp_path):
    """Figures recorded by hand below the marker survive a new report;
    without the marker the report ends with it."""
    run_all = _load("run_all")
    results = [
        {
            "name": "Bx",
            "title": "Bx: a made-up benchmark",
            "headers": ["variant", "ms"],
            "rows": [["one", "1.00"]],
            "targets": [],
            "ratios": {"Bx one": 1.0},
            "ratio_label": "time / one",
            "wall_s": 1.0,
        }
    ]
    json_path, md_path, _ = run_all.write_report(
        results, str(tmp_path), tiny=True
    )
    first = pathlib.Path(md_path).read_text()
    # The record's hand-recorded tables survive a new run too.
    record = json.loads(pathlib.Path(json_path).read_text())
    record["hand"] = [{"name": "GPU", "headers": ["a"], "rows": [["1"]]}]
    pathlib.Path(json_path).write_text(json.dumps(record))
    assert first.rstrip().endswith(run_all.HAND_MARKER)
    hand = "\n## Before and after (by hand)\n\n| a | 1.23x |\n"
    pathlib.Path(md_path).write_text(first + hand)
    run_all.write_report(results, str(tmp_path), tiny=True)
    second = pathlib.Path(md_path).read_text()
    assert second.count(run_all.HAND_MARKER) == 1
    assert second.endswith(run_all.HAND_MARKER + "\n" + hand)
    assert "Bx: a made-up benchmark" in second
    again = json.loads(pathlib.Path(json_path).read_text())
    assert again["hand"] == record["hand"]


@bench_smoke
def test_bench_eager_quick():
    """B5-eager on a toy tree: every configuration is timed (the script
    checks that each call it times closes the window or not, as named) and
    reported against the optax chain's update."""
    bench = _load("bench_eager")
    res = bench.main(tiny=True)
    _check_result_format(res)
    assert [row[0] for row in res["rows"]] == list(res["seconds"])
    assert res["rows"][0] == [
        bench.REFERENCE,
        f"{1e3 * res['seconds'][bench.REFERENCE]:.2f}",
        "1.00x",
    ]
    assert len(res["targets"]) == 3


@bench_smoke
def test_compile_limits_quick():
    """B5-limits on toy sizes: every case runs in its own process without
    error and the report has its rows."""
    limits = _load("compile_limits")
    res = limits.main(tiny=True)
    _check_result_format(res)
    errors = {k: v["error"] for k, v in res["raw"].items() if "error" in v}
    assert not errors, errors
    assert len(res["rows"]) == len(res["raw"])


def test_compile_limits_hand_steps_equal_the_library():
    """The three hand-written steps whose compiles B5-limits compares
    compute what ``oa.chain(oa.accumulate(K), optax.adam)`` does, over two
    windows and a bit (params, Adam's moments, the count)."""
    limits = _load("compile_limits")
    make_tree = _load("bench_compile").make_tree
    n = limits.QUICK_FLAT_N
    grads = [make_tree(n, seed=i + 1) for i in range(2 * limits.K + 1)]
    tx = oa.chain(oa.accumulate(limits.K), optax.adam(1e-3))
    lib = jax.jit(lambda p, s, g: oa.apply_gradients(tx, g, s, p))
    params, state = make_tree(n), tx.init(make_tree(n))
    for g in grads:
        params, state = lib(params, state, g)
    adam_state = state[1][0]
    for how in limits.HAND:
        step, _, init = limits.hand_step(n, how)
        p, s = make_tree(n), init(make_tree(n))
        for g in grads:
            p, s = jax.jit(step)(p, s, g)
        # float32, the mean taken in another order: ~10 ulp apart at most
        chex.assert_trees_all_close(p, params, rtol=1e-5, atol=1e-9)
        chex.assert_trees_all_close(s[2][0], adam_state, rtol=1e-5, atol=1e-9)
    assert not np.allclose(params["p00"], make_tree(n)["p00"])  # it moved


def test_rss_of_a_worker_is_its_own(tmp_path):
    """A B5 worker reports its own peak RSS, not its parent's: a parent
    holding 600 MB more than the worker needs must not show in it."""
    bench = _load("bench_compile")
    common = _load("_common")
    big = np.ones(75_000_000)  # 600 MB, touched
    parent_peak = common.rss_kib()["peak"]
    res = bench.compile_in_subprocess("adam", 8, None)
    assert "error" not in res, res
    assert res["peak_rss_kib"] < parent_peak - 300_000, (res, parent_peak)
    del big


@bench_smoke
def test_bench_compile_one_size():
    """One size gives no growth target (it used to fail unpacking sizes)."""
    bench = _load("bench_compile")
    res = bench.main(
        tiny=True,
        sizes=(8,),
        configs=("optax agc+adam", "MultiSteps", "README fused"),
    )
    _check_result_format(res)
    targets = [t["target"] for t in res["targets"]]
    assert not any("time(" in t for t in targets), targets
    assert any("< MultiSteps" in t for t in targets), targets


def test_run_all_rerun_replaces_one_benchmark(tmp_path, monkeypatch):
    """``run_all.py --only MODULE`` reruns one benchmark and replaces its
    results in the record, marked with its own date and load; the others
    stay as recorded, and RESULTS.md is written again from the record."""
    run_all = _load("run_all")

    def result(name, ms):
        return {
            "name": name,
            "title": f"{name}: made up",
            "headers": ["variant", "ms"],
            "rows": [["one", ms]],
            "targets": [],
            "ratios": {f"{name} one": 1.0},
            "ratio_label": "time / one",
            "wall_s": 1.0,
        }

    run_all.write_report(
        [result("Bx", "1.00"), result("By", "2.00")], str(tmp_path), tiny=True
    )
    monkeypatch.setattr(
        run_all, "run_benchmarks", lambda **kw: [result("By", "3.00")]
    )
    run_all.rerun(["bench_y"], out_dir=str(tmp_path))
    record = json.loads((tmp_path / "results.json").read_text())
    bx, by = record["results"]
    assert bx["rows"] == [["one", "1.00"]] and "date" not in bx
    assert by["rows"] == [["one", "3.00"]] and by["date"] and by["load"]
    md = (tmp_path / "RESULTS.md").read_text()
    assert md.startswith(run_all.render_report(record))
    assert "Run alone on" in md
