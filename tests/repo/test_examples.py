"""Smoke tests of the scripts in ``examples/``, so that they never rot.

Each example runs as a user would run it -- a fresh Python process, on CPU,
with its small flags (seconds) -- and must exit with status 0, print what it
promises and emit no warning. Where an example demonstrates an equality
(token weighting, flushing) the printed numbers are checked too.
"""

import ast
import os
import pathlib
import re
import subprocess
import sys

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
TIMEOUT_S = 180


def _run(script, *args, cwd):
    env = dict(os.environ, JAX_PLATFORMS="cpu", MPLBACKEND="Agg")
    # The single-device examples must not inherit a device count (e.g. the
    # test session's); data_parallel.py sets its own when none is given.
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, "-W", "default", str(EXAMPLES / script), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    report = (
        f"{script} {' '.join(args)}\n--- stdout\n{proc.stdout}\n"
        f"--- stderr\n{proc.stderr}"
    )
    assert proc.returncode == 0, report
    assert "Warning:" not in proc.stderr, report
    return proc.stdout


def _number(pattern, text):
    match = re.search(pattern, text, re.MULTILINE)
    assert match, f"{pattern!r} not found in\n{text}"
    return float(match.group(1))


def test_quickstart(tmp_path):
    out = tmp_path / "figures"
    stdout = _run("quickstart.py", "--tiny", "--out", str(out), cwd=tmp_path)
    header = re.search(
        r"^run +test acc +train loss +opt steps +wall s +"
        r"step mem KiB +temp KiB$",
        stdout,
        re.MULTILINE,
    )
    assert header, stdout
    for run in ("(a) batch 64", "(b) 16 x accumulate(4)", "(c) batch 16"):
        assert re.search(rf"^{re.escape(run)} ", stdout, re.MULTILINE), stdout
    # (a) and (b) take the same optimizer steps; (c) four times as many
    # micro-batches, each one a step (18 per epoch for 2 epochs).
    steps = {
        name: _number(rf"^{re.escape(name)} +\S+ +\S+ +(\d+) ", stdout)
        for name in ("(a) batch 64", "(b) 16 x accumulate(4)", "(c) batch 16")
    }
    assert steps["(a) batch 64"] == steps["(b) 16 x accumulate(4)"] == 10
    assert steps["(c) batch 16"] == 36
    png = out / "quickstart.png"
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert png.stat().st_size > 10_000
    assert not (tmp_path / "quickstart.png").exists()


def test_flax_trainstate(tmp_path):
    stdout = _run("flax_trainstate.py", "--tiny", cwd=tmp_path)
    assert re.search(r"micro-step +opt steps +loss scale +loss", stdout)
    assert "end of epoch 2: test accuracy" in stdout
    assert _number(r"^final: loss scale (\d+)", stdout) >= 2.0**15


def test_nnx_example(tmp_path):
    stdout = _run("nnx_example.py", "--tiny", cwd=tmp_path)
    # 10 micro-batches per epoch: 2 full windows + 1 flushed = 3 Adam steps,
    # and no BatchNorm window left open.
    assert "epoch 2: " in stdout
    assert "micro-steps 20, Adam steps 6, open BN window 0" in stdout
    assert 0.0 < _number(r"^final test accuracy ([\d.]+)", stdout) <= 1.0


def test_fp16_loss_scale(tmp_path):
    stdout = _run("fp16_loss_scale.py", "--tiny", cwd=tmp_path)
    assert re.search(r"loss x 1e30 = inf in float16; dropped: True", stdout)
    assert "params finite: True" in stdout
    assert _number(r"^done: (\d+) of \d+ micro-batches dropped", stdout) >= 1


def test_token_weighting(tmp_path):
    stdout = _run("token_weighting.py", "--tiny", cwd=tmp_path)

    def distance(name):
        return _number(rf"^{re.escape(name)} +\S+ +(\S+)$", stdout)

    assert distance("oa.accumulate, accum_weight=tokens") < 1e-5
    assert distance("oa.microbatched_value_and_grad") < 1e-5
    assert distance("oa.accumulate, unweighted (naive)") > 1e-2
    assert _number(r"optax.adam\), weighted +(\S+)$", stdout) < 1e-6
    assert _number(r"optax.adam\), naive +(\S+)$", stdout) > 1e-3


def test_flush_epoch(tmp_path):
    stdout = _run("flush_epoch.py", "--tiny", cwd=tmp_path)
    flushed = re.search(
        r"^ +with oa.flush +(\d+) +(\d+) +(\S+)$", stdout, re.MULTILINE
    )
    unflushed = re.search(
        r"^ +without flush +(\d+) +(\d+) +(\S+)$", stdout, re.MULTILINE
    )
    assert flushed and unflushed, stdout
    assert flushed.group(1, 2) == ("3", "0")  # 3 SGD steps, nothing left
    assert unflushed.group(1, 2) == ("2", "2")  # 2 steps, 2 micro-batches
    assert float(flushed.group(3)) < 1e-5 < 1e-2 < float(unflushed.group(3))
    assert _number(r"\|flushed - \(g8 \+ g9\) / 2\| = (\S+)", stdout) < 1e-6


def test_data_parallel(tmp_path):
    stdout = _run(
        "data_parallel.py",
        "--steps",
        "8",
        "--accum",
        "4",
        "--log-every",
        "4",
        cwd=tmp_path,
    )
    assert stdout.startswith("8 cpu device(s)"), stdout
    assert "micro-step    8  optimizer steps   2" in stdout
    assert re.search(
        r"^final loss [\d.]+  train accuracy [\d.]+$", stdout, re.MULTILINE
    )


def test_transformer_lm(tmp_path):
    stdout = _run(
        "transformer_lm.py",
        "--quick",
        "--no-progress",
        "--out",
        str(tmp_path / "figures"),
        cwd=tmp_path,
    )
    k = _number(r"oa.plan_microbatches picks k = (\d+) ", stdout)
    assert k >= 2

    def row(name, column):  # the table: steps, train, eval, dparams, grad err
        match = re.search(rf"^{re.escape(name)} .*$", stdout, re.MULTILINE)
        assert match, stdout
        return float(match.group(0)[len(name) :].split()[column])

    a, b, c = (
        "(a) batch 8",
        f"(b) {8 // int(k)} x accumulate({int(k)}), weighted",
        f"(c) {8 // int(k)} x accumulate({int(k)}), naive",
    )
    # (b) takes the updates of (a), to float tolerance; (c) does not.
    assert row(a, 0) == row(b, 0) == row(c, 0)  # optimizer steps
    assert row(b, 4) < 1e-5 and row(c, 4) > 1e-3  # gradient error at init
    # max |params - params(a)| after training: Adam turns the rounding of
    # near-zero gradients into differences of ~1e-5; (c)'s is ~1e-2.
    assert row(b, 3) < 1e-4 and row(c, 3) > 1e-3
    assert abs(row(b, 1) - row(a, 1)) < 1e-4  # final train loss
    # Padding is a real share of every batch: 30-50% of tokens.
    mean = _number(r"mean ([\d.]+) of 32\)", stdout)
    assert 0.5 <= mean / 32 <= 0.7, mean
    # (b) logs B_simple per window, in tokens: finite and positive once
    # windows of k >= 2 micro-batches closed (every window here).
    block = stdout.split("B_simple of (b) per window")[1].split("saved")[0]
    values = re.findall(r"\b\d+:\s+(\S+)", block.split("\n", 1)[1])
    assert len(values) == row(b, 0), stdout
    assert all(0 < float(v) < float("inf") for v in values), values
    for name in ("transformer_lm.png", "transformer_lm_noise_scale.png"):
        png = tmp_path / "figures" / name
        assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_transformer_lm_mesh_gather_once(tmp_path):
    """--mesh: on data=2 x fsdp=4, the default step reduce-scatters every
    kernel inside the scan's loop; with gather_once each kernel is gathered
    and reduce-scattered once per step, nothing in the loop."""
    stdout = _run("transformer_lm.py", "--quick", "--mesh", cwd=tmp_path)
    line = r"{} +all-gather (\d+) \((\d+) in the loop\), "
    line += r"reduce-scatter (\d+) \((\d+) in the loop\)"
    default = re.search(line.format("default"), stdout)
    held = re.search(line.format("gather_once"), stdout)
    assert default and held, stdout
    kernels = int(held[1])
    assert kernels > 0 and held.groups()[1:] == ("0", str(kernels), "0")
    assert int(default[3]) == 4 * kernels and int(default[4]) == kernels


def test_equinox_batchnorm(tmp_path):
    """An Equinox BatchNorm built on the framework-neutral helpers follows
    the optimizer's windows of changing length (critical_batch_every_k)."""
    stdout = _run("equinox_batchnorm.py", "--tiny", cwd=tmp_path)
    match = re.search(r"^window lengths: \[([\d, ]+)\]$", stdout, re.MULTILINE)
    assert match, stdout
    assert len(set(match.group(1).split(", "))) > 1, stdout  # lengths change
    assert "BatchNorm windows closed with the optimizer's: True" in stdout
    assert _number(r"on the windows: error (\S+)$", stdout) < 1e-5
    # Written against the public and framework-neutral layers only.
    tree = ast.parse((EXAMPLES / "equinox_batchnorm.py").read_text())
    imported = {
        a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.Import)
        for a in n.names
    }
    imported |= {
        f"{n.module}.{a.name}" if n.module == "optaxaccum._src" else n.module
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom)
        for a in n.names
    }
    ours = {m for m in imported if m.startswith("optaxaccum")}
    assert ours == {"optaxaccum"}, ours
    assert not any(m.split(".")[0] == "flax" for m in imported), imported


def _private_imports(path):
    """The ``optaxaccum._src`` modules that ``path`` imports, anywhere in
    it (function-local imports included)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {n for n in names if n.startswith("optaxaccum._src")}
    return found


def test_examples_and_benchmarks_use_only_the_public_api():
    """What users copy from is written on the public API: no file of
    examples/ or benchmarks/ imports ``optaxaccum._src``."""
    root = EXAMPLES.parent
    offenders = {
        str(path.relative_to(root)): sorted(_private_imports(path))
        for folder in ("examples", "benchmarks")
        for path in sorted((root / folder).rglob("*.py"))
        if _private_imports(path)
    }
    assert not offenders, offenders


def test_adascale(tmp_path):
    """examples/adascale.py, short: the growing windows with the gain lose
    less per example than without scaling, on a fraction of the steps."""
    stdout = _run(
        "adascale.py",
        "--micro-steps",
        "240",
        "--out",
        str(tmp_path / "figures"),
        cwd=tmp_path,
    )

    def row(name, column):  # the table: opt steps, train loss, tau
        match = re.search(rf"^{re.escape(name)} .*$", stdout, re.MULTILINE)
        assert match, stdout
        return float(match.group(0)[len(name) :].split()[column])

    base, plain, gain = "(a) base batch", "(b) ramp, no scale", "(d) ramp, gain"
    assert row(base, 0) == 240 and row(gain, 0) == row(plain, 0) < 240 / 2
    assert row(gain, 1) < row(plain, 1)
    assert row(plain, 0) == row(plain, 2) < row(gain, 2) <= row(base, 2)
    png = tmp_path / "figures" / "adascale.png"
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
