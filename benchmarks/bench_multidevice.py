"""Data parallelism: all-reduce once per window, not once per micro-batch.

A window of ``K = 4`` micro-batches on 8 devices (8 host CPU devices unless
the default backend has 8 or more), an MLP, Adam, each device computing the
plain local gradient of its own micro-batch, in a ``jax.shard_map`` step
(params and optimizer state donated). Three variants:

* ``pmean + MultiSteps`` (the optax way): ``lax.pmean`` of the gradients on
  every micro-batch, then ``optax.MultiSteps(adam, K)``;
* ``pmean + oa.accumulate``: the same per-micro-batch ``pmean``, then
  ``oa.chain(oa.accumulate(K), adam)`` (isolates the cost of the
  communication from that of the optimizer wrapper);
* ``oa.accumulate(axis_name)``: no collective in the user's step;
  ``oa.chain(oa.accumulate(K, axis_name="d"), adam)`` all-reduces the
  window's sum once, in the closing call.

Reported: the all-reduce ops of each compiled step, split into those at the
top level (executed on every call) and those inside the branch of a
``conditional`` (executed only when the window closes), with the bytes they
reduce; the all-reduces executed per window derived from them; and the
wall time of a whole window (``K`` calls), median of interleaved rounds, as
a ratio to ``oa.accumulate(axis_name)``.

Run: ``python benchmarks/bench_multidevice.py [--tiny]``. ``main()`` returns
the results as a dict (see ``run_all.py``). The device count is fixed when
JAX starts; when the running process has fewer than 8 devices, ``main()``
measures in a fresh subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator

N_DEVICES = 8
_FLAG = f"--xla_force_host_platform_device_count={N_DEVICES}"

if __name__ == "__main__" and "xla_force_host_platform_device_count" not in (
    os.environ.get("XLA_FLAGS", "")
):
    # Before JAX starts: only when run as a script, and only if the user
    # has not chosen a device count.
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optaxaccum as oa  # noqa: E402

K = 4
LEARNING_RATE = 1e-3
AXIS = "d"
FULL = dict(widths=(256, 1024, 1024, 256), batch=8, rounds=15, warmup=1)
TINY = dict(widths=(16, 32, 16), batch=2, rounds=3, warmup=0)

# ------------------------------------------------------------ HLO parsing

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
    "c128": 16,
}
_ARRAY_RE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_CALLEE_RE = re.compile(
    r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)"
    r"=%?([\w.\-]+)"
)
_BRANCHES_RE = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_TRUE_FALSE_RE = re.compile(
    r"\btrue_computation=%?([\w.\-]+).*?\bfalse_computation=%?([\w.\-]+)"
)
_ALL_REDUCE_OPS = ("all-reduce", "all-reduce-start")


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape, e.g. ``(f32[], f32[3,5]{1,0})`` -> 64."""
    total = 0
    for dtype, dims in _ARRAY_RE.findall(shape):
        if dtype not in _DTYPE_BYTES:
            continue
        total += _DTYPE_BYTES[dtype] * int(
            np.prod([int(d) for d in dims.split(",") if d])
        )
    return total


def _split_instruction(line: str) -> tuple[str, str] | None:
    """``(shape, opcode)`` of an HLO instruction line, else None."""
    head, sep, rest = line.partition(" = ")
    if not sep or not head.split() or not head.split()[-1].startswith("%"):
        return None
    rest = rest.lstrip()
    if rest.startswith("("):  # tuple shape: up to the matching parenthesis
        depth = 0
        end = 0
        for end, c in enumerate(rest, 1):  # noqa: B007
            depth += (c == "(") - (c == ")")
            if depth == 0:
                break
        shape, rest = rest[:end], rest[end:].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    opcode = rest.split("(", 1)[0].strip()
    return shape, opcode


def parse_hlo(text: str) -> tuple[dict[str, list[str]], str]:
    """Splits HLO text into computations: ``({name: lines}, entry name)``."""
    comps: dict[str, list[str]] = {}
    entry = None
    current = None
    for line in text.splitlines():
        if current is None:
            if line and not line[0].isspace() and line.rstrip().endswith("{"):
                words = line.split()
                is_entry = words[0] == "ENTRY"
                name = words[1 if is_entry else 0].lstrip("%")
                if not re.match(r"^[\w.\-]+$", name):
                    continue  # e.g. "HloModule ..., {...}" has no body
                current = comps.setdefault(name, [])
                if is_entry:
                    entry = name
        elif line.strip() == "}":
            current = None
        else:
            current.append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def _callees(line: str) -> Iterator[tuple[str, int | None]]:
    """Computations called by an instruction: ``(name, branch index)``;
    the index is None for calls that always run (fusions, reductions...)."""
    tf = _TRUE_FALSE_RE.search(line)
    if tf:  # a predicated conditional: branch 1 is the true computation
        yield tf.group(2), 0
        yield tf.group(1), 1
        return
    m = _BRANCHES_RE.search(line)
    if m:
        for i, name in enumerate(m.group(1).split(",")):
            yield name.strip().lstrip("%"), i
        return
    for name in _CALLEE_RE.findall(line):
        yield name, None


def all_reduces(text: str) -> list[dict]:
    """Every all-reduce of an HLO module, with where it runs.

    Returns:
      One dict per all-reduce op (``all-reduce`` or ``all-reduce-start``):
      ``bytes`` it reduces, ``computation`` holding it and ``branches``: the
      ``conditional`` branches (index; 1 is ``lax.cond``'s true branch) that
      lead to it from the entry computation, ``()`` when it runs on every
      call.
    """
    comps, entry = parse_hlo(text)
    found: list[dict] = []
    seen: set[tuple[str, tuple[int, ...]]] = set()

    def visit(name: str, branches: tuple[int, ...]) -> None:
        if (name, branches) in seen or name not in comps:
            return
        seen.add((name, branches))
        for line in comps[name]:
            parsed = _split_instruction(line)
            if parsed is None:
                continue
            shape, opcode = parsed
            if opcode in _ALL_REDUCE_OPS:
                found.append(dict(bytes=shape_bytes(shape), computation=name,
                                  branches=branches))
            for callee, index in _callees(line):
                visit(callee, branches if index is None else (*branches, index))

    visit(entry, ())
    return found


def summarize(text: str) -> dict:
    """All-reduce ops and bytes at the top level and inside conditionals."""
    ops = all_reduces(text)
    top = [o for o in ops if not o["branches"]]
    cond = [o for o in ops if o["branches"]]
    return {
        "top_ops": len(top),
        "top_bytes": sum(o["bytes"] for o in top),
        "branch_ops": len(cond),
        "branch_bytes": sum(o["bytes"] for o in cond),
        "true_branch_only": all(o["branches"][-1] == 1 for o in cond),
    }


# ------------------------------------------------------------- the model


def init_mlp(widths, seed=0):
    keys = jax.random.split(jax.random.key(seed), len(widths) - 1)
    return [
        {
            "w": jax.random.normal(k, (a, b), jnp.float32) / np.sqrt(a),
            "b": jnp.zeros((b,), jnp.float32),
        }
        for k, a, b in zip(keys, widths[:-1], widths[1:], strict=True)
    ]


def mlp_loss(params, x, y):
    h = x
    for i, layer in enumerate(params):
        h = h @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            h = jax.nn.relu(h)
    return jnp.mean((h - y) ** 2)


def per_device_state_specs(state, axis=AXIS):
    """In/out specs of an optimizer state inside ``shard_map``: the
    accumulators (``acc`` and ``weight`` of every ``oa.AccumulateState``)
    differ from device to device and are stored with a leading device axis;
    everything else is replicated."""
    specs = jax.tree.map(lambda _: P(), state)
    return map_per_device(specs, lambda _: P(axis))


def map_per_device(state, fn):
    """Applies ``fn`` to the per-device leaves (accumulators) of ``state``."""

    def fix(s):
        if isinstance(s, oa.AccumulateState):
            return s._replace(acc=jax.tree.map(fn, s.acc), weight=fn(s.weight))
        return s

    return jax.tree.map(
        fix, state, is_leaf=lambda s: isinstance(s, oa.AccumulateState)
    )


def make_steps(mesh, params):
    """Compiled window steps of the three variants and their initial states.

    Returns ``{name: (compiled step, init_fn)}``; a step maps ``(params,
    state, x, y) -> (params, state)``.
    """
    adam = optax.adam(LEARNING_RATE)
    n = mesh.shape[AXIS]

    def local_grads(p, x, y):
        return jax.grad(mlp_loss)(lax.pcast(p, AXIS, to="varying"), x, y)

    def pmean_multisteps(tx):
        def step(p, s, x, y):
            g = lax.pmean(local_grads(p, x, y), AXIS)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        return step

    def pmean_accumulate(tx):
        def step(p, s, x, y):
            g = lax.pmean(local_grads(p, x, y), AXIS)
            return oa.apply_gradients(tx, g, s, p)

        return step

    def ours(tx):
        def step(p, s, x, y):
            s = map_per_device(s, lambda a: a[0])
            p, s = oa.apply_gradients(tx, local_grads(p, x, y), s, p)
            return p, map_per_device(s, lambda a: a[None])

        return step

    variants = {
        "pmean + MultiSteps": (optax.MultiSteps(adam, K), pmean_multisteps),
        "pmean + oa.accumulate": (oa.chain(oa.accumulate(K), adam),
                                  pmean_accumulate),
        "oa.accumulate(axis_name)": (
            oa.chain(oa.accumulate(K, axis_name=AXIS), adam), ours),
    }
    batch_spec = P(AXIS)
    out = {}
    for name, (tx, make) in variants.items():
        state0 = tx.init(params)
        if name.startswith("oa.accumulate(axis"):
            specs = per_device_state_specs(state0)

            def init(p, tx=tx):
                return map_per_device(
                    tx.init(p), lambda a: jnp.broadcast_to(a, (n, *a.shape))
                )
        else:
            specs = jax.tree.map(lambda _: P(), state0)
            init = tx.init
        step = jax.jit(
            jax.shard_map(make(tx), mesh=mesh,
                          in_specs=(P(), specs, batch_spec, batch_spec),
                          out_specs=(P(), specs)),
            donate_argnums=(0, 1),
        )
        shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
        out[name] = (step, init, shardings)
    return out


# ------------------------------------------------------------ measuring


def _measure(tiny: bool) -> dict:
    import _common

    cfg = TINY if tiny else FULL
    devices = jax.devices()[:N_DEVICES]
    mesh = jax.make_mesh((N_DEVICES,), (AXIS,), devices=devices,
                         axis_types=(jax.sharding.AxisType.Explicit,))
    widths, batch = cfg["widths"], cfg["batch"]
    replicated = NamedSharding(mesh, P())
    data_sharding = NamedSharding(mesh, P(AXIS))

    def fresh_params():
        return jax.device_put(init_mlp(widths), replicated)

    params = fresh_params()
    n_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
    rng = np.random.default_rng(0)
    xs = [jax.device_put(
        rng.normal(size=(N_DEVICES * batch, widths[0])).astype(np.float32),
        data_sharding) for _ in range(K)]
    ys = [jax.device_put(
        rng.normal(size=(N_DEVICES * batch, widths[-1])).astype(np.float32),
        data_sharding) for _ in range(K)]

    steps = make_steps(mesh, params)
    compiled, hlo, loops = {}, {}, {}
    for name, (step, init, shardings) in steps.items():
        p = fresh_params()
        s = jax.device_put(init(p), shardings)
        compiled[name] = step.lower(p, s, xs[0], ys[0]).compile()
        hlo[name] = summarize(compiled[name].as_text())
        loops[name] = {"params": p, "state": s}

    def window_call(name):
        comp = compiled[name]

        def call(p, s):
            for x, y in zip(xs, ys, strict=True):
                p, s = comp(p, s, x, y)
            return p, s

        def prepare():
            return loops[name]["params"], loops[name]["state"]

        def keep(out):
            loops[name]["params"], loops[name]["state"] = out

        return _common.Timed(call, prepare, keep)

    # Sanity (and a first, untimed window): from the same params, one window
    # of each variant moves them the same way.
    for name in steps:
        window_call(name).run_once()
    ref = jax.tree.leaves(loops["pmean + MultiSteps"]["params"])
    for name in steps:
        got = jax.tree.leaves(loops[name]["params"])
        for a, b in zip(got, ref, strict=True):
            # Adam's first step is about +-lr per entry, less where the
            # gradient is near 0 (there summation order shows): compare
            # against lr.
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0,
                                       atol=1e-2 * LEARNING_RATE, err_msg=name)

    seconds = _common.time_interleaved(
        {name: window_call(name) for name in steps},
        rounds=cfg["rounds"], warmup=cfg["warmup"],
    )
    ours = "oa.accumulate(axis_name)"
    rows = []
    per_window = {}
    for name in steps:
        h = hlo[name]
        executed = K * h["top_ops"] + h["branch_ops"]
        per_window[name] = executed
        rows.append([
            name,
            f"{h['top_ops']} ({_common.format_bytes(h['top_bytes'])})",
            f"{h['branch_ops']} ({_common.format_bytes(h['branch_bytes'])})",
            str(executed),
            _common.format_bytes(K * h["top_bytes"] + h["branch_bytes"]),
            f"{1e3 * seconds[name]:.2f}",
            f"{seconds[name] / seconds[ours]:.2f}x",
        ])
    headers = ["variant", "all-reduce every call (bytes)",
               "all-reduce in closing branch (bytes)",
               f"all-reduces per window of {K}", "bytes per window",
               "ms/window", f"vs {ours}"]
    tree_bytes = 4 * n_params
    targets = [
        _target(f"{ours}: no all-reduce outside the closing branch",
                str(hlo[ours]["top_ops"]), hlo[ours]["top_ops"] == 0),
        _target(f"{ours}: 1 gradient all-reduce per window "
                f"(>= one tree, {_common.format_bytes(tree_bytes)})",
                f"{per_window[ours]} "
                f"({_common.format_bytes(hlo[ours]['branch_bytes'])})",
                per_window[ours] == 1
                and hlo[ours]["branch_bytes"] >= tree_bytes),
        _target(f"pmean + MultiSteps: {K} gradient all-reduces per window",
                str(per_window["pmean + MultiSteps"]),
                per_window["pmean + MultiSteps"] == K),
        _target(f"{ours} window not slower than pmean + MultiSteps",
                seconds["pmean + MultiSteps"] / seconds[ours],
                seconds[ours] <= seconds["pmean + MultiSteps"],
                suffix="x faster"),
    ]
    return {
        "name": "B-multidevice",
        "title": (f"Data parallel: a window of k={K} micro-batches on "
                  f"{N_DEVICES} {devices[0].platform.upper()} devices, "
                  f"{n_params:,} float32 params, Adam; "
                  f"median of {cfg['rounds']} interleaved rounds"),
        "headers": headers,
        "rows": rows,
        "ratios": {f"B-multidevice {n}": seconds[n] / seconds[ours]
                   for n in steps if n != ours},
        "ratio_label": f"window time / {ours}",
        "targets": targets,
        "seconds": seconds,
        "all_reduces": hlo,
        "all_reduces_per_window": per_window,
    }


def _target(what, value, met, suffix="x"):
    shown = f"{value:.2f}{suffix}" if isinstance(value, float) else str(value)
    return {"target": what, "measured": shown, "met": bool(met)}


def main(tiny: bool = False) -> dict:
    """Runs the benchmark; returns the results (see ``run_all.py``)."""
    if jax.device_count() >= N_DEVICES:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        return _measure(tiny)
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {_FLAG}"
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, os.path.abspath(__file__), "--json"]
    if tiny:
        cmd.append("--tiny")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    args = sys.argv[1:]
    res = main(tiny="--tiny" in args)
    if "--json" in args:
        print(json.dumps(res))
    else:
        import _common

        print(res["title"])
        print(_common.markdown_table(res["headers"], res["rows"]))
        print()
        print(_common.markdown_table(
            ["target", "measured", "met"],
            [[t["target"], t["measured"], "yes" if t["met"] else "NO"]
             for t in res["targets"]],
        ))
