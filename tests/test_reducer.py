"""The reducers of ``optaxaccum/_src/reducer.py``, one mesh mode at a time.

Each mode is checked directly against hand sums of the devices' partial
sums: :class:`~optaxaccum._src.reducer.Local` (no ``axis_name``),
:class:`~optaxaccum._src.reducer.Mapped` (``shard_map``/``pmap``),
:class:`~optaxaccum._src.reducer.Explicit` (``jax.jit`` on an explicit
mesh: unreduced partial sums, stored stacked) and
:class:`~optaxaccum._src.reducer.Scatter` (the same with
``shard_update``): which reducer ``of``/``at_init`` choose, that
``load(store(x))`` gives ``x`` back, and ``reduce``, ``reduce_sums``,
``scale``, ``agree``, ``finite`` and ``squared_norm``. The multi-device
cases run on the 8 CPU devices conftest.py gives, on a ``data=2 x fsdp=4``
mesh and on a mesh whose axes all have size 1 (a run resumed on one
device).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from optaxaccum._src import reducer

EIGHT = pytest.mark.devices(8)
MESHES = {"data2xfsdp4": (2, 4), "one1x1": (1, 1)}
ROWS, COLS = 8, 4  # an accumulator leaf sharded over fsdp on its rows


def _mesh(shape, axis_type=AxisType.Explicit):
    return jax.make_mesh(
        shape,
        ("data", "fsdp")[: len(shape)],
        axis_types=(axis_type,) * len(shape),
        devices=jax.devices()[: int(np.prod(shape))],
    )


def _rows(n, *shape, seed=0):
    """``n`` devices' partial sums of a leaf of ``shape`` (distinct
    values, so that a sum over the wrong rows shows)."""
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, *shape)).astype(np.float32)


# ------------------------------------------------------------ no mesh


def test_local_is_chosen_without_axis_name():
    """Without axis_name every choice is Local, shard_update or not, on a
    mesh or not."""
    tree = {"w": jnp.ones(3)}
    assert type(reducer.of(None, tree)) is reducer.Local
    assert type(reducer.of(None, tree, shard_update=True)) is reducer.Local
    assert type(reducer.at_init(None)) is reducer.Local
    assert type(reducer.at_init(None, shard_update=True)) is reducer.Local
    mesh = _mesh((1, 1))
    x = jax.device_put(jnp.ones(3), NamedSharding(mesh, P()))
    assert type(reducer.of(None, {"w": x}, shard_update=True)) is reducer.Local
    with jax.set_mesh(mesh):
        assert type(reducer.at_init(None, True)) is reducer.Local


def test_local_sums_are_the_window_sums():
    """Local: stored as they are, reduced as they are (one device's sum is
    the sum), scaled, squared in the accumulator's dtype."""
    red = reducer.Local()
    g = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.array([1.0, -2.0])}
    back = red.load(red.store(g))
    jax.tree.map(np.testing.assert_array_equal, back, g)
    jax.tree.map(np.testing.assert_array_equal, red.zeros(g), g)
    z = red.sum_zeros(jnp.float32)
    assert z.shape == () and z.dtype == jnp.float32 and float(z) == 0.0
    np.testing.assert_array_equal(red.load_sum(jnp.float32(5.0)), 5.0)
    acc, w = red.reduce(g, jnp.float32(3.0), "mean")
    jax.tree.map(np.testing.assert_array_equal, acc, g)
    assert float(w) == 3.0
    sq_sum, count = red.reduce_sums(jnp.float32(2.0), jnp.int32(3))
    assert (float(sq_sum), int(count)) == (2.0, 3)
    assert red.global_weight((jnp.float32(4.0), None))[0] == 4.0
    assert red.sum_scale("sum") is None and red.sum_scale("mean") is None
    np.testing.assert_array_equal(
        red.scale(jnp.float32(0.5), g["w"]), 0.5 * g["w"]
    )
    assert bool(red.agree(jnp.bool_(False))) is False
    # |g|^2 in the accumulator's dtype, one device's share.
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), g)
    acc32 = jax.tree.map(jnp.zeros_like, g)
    sq, sq_sum, n = red.squared_norm(bf16, acc32, jnp.float32(1.0))
    want = sum(
        float((np.asarray(x, np.float32) ** 2).sum()) for x in g.values()
    )
    assert sq.dtype == jnp.float32 and n == 1 and float(sq_sum) == 1.0
    np.testing.assert_allclose(float(sq), want, rtol=1e-6)


@pytest.mark.parametrize(
    "bad",
    [np.nan, np.inf, -np.inf, complex(0.0, np.inf)],
    ids=["nan", "inf", "-inf", "complex_inf"],
)
def test_local_finite_sees_any_non_finite_value(bad):
    """finite is False as soon as one element of one leaf is NaN or
    infinite (a complex leaf's imaginary part included), True otherwise."""
    red = reducer.Local()
    dtype = np.complex64 if isinstance(bad, complex) else np.float32
    tree = {"a": jnp.ones(3), "b": jnp.zeros(4, dtype)}
    assert bool(red.finite(tree))
    tree["b"] = tree["b"].at[2].set(bad)
    assert not bool(red.finite(tree))
    assert not bool(jax.jit(red.finite)(tree))


# ---------------------------------------------- pmap / shard_map (Mapped)


def _shard_mapped(f, *per_device):
    """``f`` on each of 8 devices' rows of ``per_device`` (leading axis
    8) under ``jax.shard_map`` over ``data``; its outputs stacked again."""
    mesh = _mesh((8,))

    def body(*xs):
        out = f(*(x[0] for x in xs))
        return jax.tree.map(lambda y: jnp.asarray(y)[None], out)

    rows = NamedSharding(mesh, P("data"))
    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    )(*(jax.device_put(x, rows) for x in per_device))


@EIGHT
def test_mapped_is_chosen_for_a_mapped_axis():
    """axis_name outside any mesh (plain arrays) and inside shard_map
    (a manual axis): Mapped, shard_update or not; at_init without a mesh
    (the user adds the device axis) or under a mesh of Auto axes: Mapped."""
    assert type(reducer.of("data", {"w": jnp.ones(3)})) is reducer.Mapped
    assert type(reducer.of("data", jnp.ones(3), True)) is reducer.Mapped
    assert type(reducer.at_init("data")) is reducer.Mapped
    with jax.set_mesh(_mesh((8,), AxisType.Auto)):
        assert type(reducer.at_init("data")) is reducer.Mapped
    seen = []

    def f(x):
        seen.append(type(reducer.of("data", {"w": x})))
        return x

    _shard_mapped(f, jnp.ones((8, 3)))
    assert seen == [reducer.Mapped]


@EIGHT
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_mapped_reduce_is_the_hand_sum_over_devices(reduction):
    """Each device's partial sum and weight: reduce gives their sums
    ("mean") or the devices' mean of the sums, which sum_scale (the
    devices' number) makes the sum ("sum"); reduce_sums and global_weight
    sum the devices' values; store/load keep each device's own."""
    rows, w = _rows(8, 3), np.arange(1.0, 9.0, dtype=np.float32)
    sq, count = _rows(8, seed=1), np.arange(8, dtype=np.float32)
    red = reducer.Mapped("data")

    def f(a, w, sq, count):
        kept = red.load(red.store(a))
        acc, weight = red.reduce(a, w, reduction)
        scale = red.sum_scale(reduction)
        acc = acc if scale is None else acc * scale
        return (
            kept,
            acc,
            weight,
            red.reduce_sums(sq, count),
            red.global_weight((w, None))[0],
        )

    kept, acc, weight, (sq_sum, n), global_w = _shard_mapped(
        f, rows, w, sq, count
    )
    np.testing.assert_array_equal(kept, rows)
    np.testing.assert_allclose(
        acc, np.broadcast_to(rows.sum(0), (8, 3)), rtol=1e-6
    )
    np.testing.assert_allclose(weight, np.full(8, w.sum()))
    np.testing.assert_allclose(global_w, np.full(8, w.sum()))
    np.testing.assert_allclose(sq_sum, np.full(8, sq.sum()), rtol=1e-6)
    np.testing.assert_allclose(n, np.full(8, count.sum()))


@EIGHT
def test_mapped_reduce_under_pmap():
    """The same reducer under jax.pmap's named axis: psum of the devices'
    partial sums and weights."""
    rows, w = _rows(8, 3), np.arange(1.0, 9.0, dtype=np.float32)
    red = reducer.Mapped("data")
    acc, weight = jax.pmap(
        lambda a, w: red.reduce(a, w, "mean"), axis_name="data"
    )(rows, w)
    np.testing.assert_allclose(
        acc, np.broadcast_to(rows.sum(0), (8, 3)), rtol=1e-6
    )
    np.testing.assert_allclose(weight, np.full(8, w.sum()))


@EIGHT
def test_mapped_finite_and_agree_drop_a_nan_on_one_device_everywhere():
    """A NaN in device 3's partial sum: finite is False there, and agree
    of the devices' flags is False on every device (True when all are);
    with no NaN, finite is True everywhere."""
    rows = _rows(8, 3)
    rows[3, 1] = np.nan
    red = reducer.Mapped("data")

    def f(a):
        ok = red.finite({"g": a})
        return ok, red.agree(ok), red.agree(jnp.bool_(True))

    ok, agreed, all_true = _shard_mapped(f, rows)
    assert not np.asarray(ok)[3]
    np.testing.assert_array_equal(agreed, np.zeros(8, bool))
    np.testing.assert_array_equal(all_true, np.ones(8, bool))
    ok, agreed, _ = _shard_mapped(f, np.nan_to_num(rows))
    np.testing.assert_array_equal(ok, np.ones(8, bool))
    np.testing.assert_array_equal(agreed, np.ones(8, bool))


@EIGHT
def test_mapped_scale_and_squared_norm_are_per_device():
    """scale multiplies each device's own value; squared_norm is this
    device's |g|^2 (one share: n = 1)."""
    rows = _rows(8, 3)
    red = reducer.Mapped("data")

    def f(a):
        sq, _, n = red.squared_norm({"g": a}, {"g": a}, jnp.float32(0.0))
        assert n == 1
        return red.scale(jnp.float32(2.0), a), sq

    scaled, sq = _shard_mapped(f, rows)
    np.testing.assert_allclose(scaled, 2.0 * rows)
    np.testing.assert_allclose(sq, (rows**2).sum(1), rtol=1e-6)


# ------------------------------------- jax.jit on an explicit mesh


def _stacked(mesh, rows):
    """Rows ``(data, ROWS, COLS)``: the stacked form of an accumulator
    leaf of spec ``P("fsdp", None)`` unreduced over ``data``."""
    spec = P("data", "fsdp", None)
    return jax.device_put(rows, NamedSharding(mesh, spec))


def _explicit(name, shard_update=False):
    mesh = _mesh(MESHES[name])
    red = reducer.Scatter if shard_update else reducer.Explicit
    return mesh, red("data"), mesh.shape["data"]


@EIGHT
@pytest.mark.parametrize("name", list(MESHES))
def test_explicit_is_chosen_on_an_explicit_mesh(name):
    """Arrays on a mesh whose axis_name axes are Explicit (and init under
    jax.set_mesh of one): Explicit, Scatter with shard_update."""
    mesh = _mesh(MESHES[name])
    x = jax.device_put(jnp.ones((ROWS, COLS)), NamedSharding(mesh, P("fsdp")))
    assert type(reducer.of("data", {"w": x})) is reducer.Explicit
    assert type(reducer.of(("data", "fsdp"), [x])) is reducer.Explicit
    assert type(reducer.of("data", x, shard_update=True)) is reducer.Scatter
    with jax.set_mesh(mesh):
        assert type(reducer.at_init("data")) is reducer.Explicit
        assert type(reducer.at_init("data", True)) is reducer.Scatter


@EIGHT
@pytest.mark.parametrize("name", list(MESHES))
def test_explicit_store_load_round_trip(name):
    """load makes each device's row its partial sum of an array unreduced
    over data; store stacks it back: store(load(s)) is s, row for row, and
    load(store(u)) has u's type. A leaf not in stacked form passes both."""
    mesh, red, n = _explicit(name)
    rows = _rows(n, ROWS, COLS)
    types = []

    def f(s, plain):
        u = red.load({"w": s, "b": plain})
        types.append(jax.tree.map(jax.typeof, u))
        again = red.load(red.store(u))
        types.append(jax.tree.map(jax.typeof, again))
        return red.store(u)

    with jax.set_mesh(mesh):
        plain = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P()))
        out = jax.jit(f)(_stacked(mesh, rows), plain)
    np.testing.assert_array_equal(out["w"], rows)
    np.testing.assert_array_equal(out["b"], np.arange(4.0))
    assert out["w"].sharding.spec == P("data", "fsdp", None)
    unreduced = types[0]["w"].sharding.spec
    assert unreduced.unreduced == {"data"}, unreduced
    assert tuple(unreduced.partitions) == ("fsdp", None), unreduced
    assert types[1] == types[0]
    assert not types[0]["b"].sharding.spec.unreduced


@EIGHT
def test_explicit_load_under_jit_without_set_mesh_keeps_each_row():
    """Under jax.jit with no jax.set_mesh (the mesh only in the arrays'
    shardings): load makes each device's row its partial sum (the size
    of the mesh local_map is given, not of the empty context mesh), so
    the array reduced over data is the rows' sum."""
    mesh, red, n = _explicit("data2xfsdp4")
    rows = _rows(n, ROWS, COLS)
    whole = NamedSharding(mesh, P("fsdp"))
    out = jax.jit(lambda s: jax.reshard(red.load(s), whole))(
        _stacked(mesh, rows)
    )
    np.testing.assert_allclose(out, rows.sum(0), rtol=1e-6)


@EIGHT
@pytest.mark.parametrize("shard_update", [False, True])
@pytest.mark.parametrize("name", list(MESHES))
def test_explicit_reduce_is_the_hand_sum_of_the_rows(name, shard_update):
    """reduce (of the stored form, or of the loaded one) sums the devices'
    rows, for both reductions; the weight is global already. Explicit
    leaves each sum at its leaf's spec, Scatter at its placed_spec:
    sharded over data too where a dimension takes it, else (a bias of odd
    size) at the leaf's own spec, summed all the same."""
    mesh, red, n = _explicit(name, shard_update)
    rows, odd = _rows(n, ROWS, COLS), _rows(n, 3, seed=4)
    want = {"w": P("fsdp", None), "b": P()}
    if shard_update:
        want["w"] = reducer.placed_spec(
            want["w"], (ROWS, COLS), mesh, ("data",)
        )
    with jax.set_mesh(mesh):
        s = {
            "w": _stacked(mesh, rows),
            "b": jax.device_put(odd, NamedSharding(mesh, P("data"))),
        }
        for reduction in ("mean", "sum"):
            for loaded in (False, True):

                def f(s, w, loaded=loaded, reduction=reduction):
                    a = red.load(s) if loaded else s
                    return red.reduce(a, w, reduction)

                acc, w = jax.jit(f)(s, jnp.float32(3.0))
                np.testing.assert_allclose(acc["w"], rows.sum(0), rtol=1e-6)
                np.testing.assert_allclose(acc["b"], odd.sum(0), rtol=1e-6)
                assert float(w) == 3.0
                for k, spec in want.items():
                    placed = NamedSharding(mesh, spec)
                    assert acc[k].sharding.is_equivalent_to(
                        placed, acc[k].ndim
                    ), (
                        k,
                        acc[k].sharding,
                    )
    assert red.sum_scale("sum") is None
    if shard_update and n > 1:
        assert want["w"] == P("fsdp", "data")


@EIGHT
@pytest.mark.parametrize("name", list(MESHES))
def test_explicit_zeros_are_stacked_over_data(name):
    """zeros of a leaf on the mesh: one zero row per data device, stacked
    over data (under jit and eagerly); sum_zeros: one entry per device of
    the mesh."""
    mesh, red, n = _explicit(name)
    z = jax.device_put(jnp.ones((ROWS, COLS)), NamedSharding(mesh, P("fsdp")))
    eager = red.zeros({"w": z})["w"]
    with jax.set_mesh(mesh):
        traced = jax.jit(lambda z: red.zeros({"w": z})["w"])(z)
        sums = jax.jit(lambda: red.sum_zeros(jnp.float32))()
    for out in (eager, traced):
        assert out.shape == (n, ROWS, COLS)
        np.testing.assert_array_equal(out, 0.0)
        assert out.sharding.spec == P("data", "fsdp", None), out.sharding
    assert sums.shape == (mesh.size,) and sums.dtype == jnp.float32
    np.testing.assert_array_equal(sums, 0.0)


@EIGHT
@pytest.mark.parametrize("name", list(MESHES))
def test_explicit_scalar_sums_reduce_over_every_device(name):
    """The noise scale's sq_sum, one entry per device of the mesh: loaded
    it is unreduced over every axis, reduce_sums gives the hand sum (the
    count is global), and store(load_sum(x)) is x."""
    mesh, red, _ = _explicit(name)
    entries = _rows(mesh.size, seed=2)
    types = []

    def f(x):
        loaded = red.load_sum(x)
        types.append(jax.typeof(loaded))
        return red.reduce_sums(loaded, jnp.float32(5.0)), red.store(loaded)

    with jax.set_mesh(mesh):
        x = jax.device_put(entries, NamedSharding(mesh, P(("data", "fsdp"))))
        (sq_sum, count), back = jax.jit(f)(x)
    assert types[0].sharding.spec.unreduced == {"data", "fsdp"}
    np.testing.assert_allclose(float(sq_sum), entries.sum(), rtol=1e-6)
    assert float(count) == 5.0
    np.testing.assert_array_equal(back, entries)


@EIGHT
@pytest.mark.parametrize("name", list(MESHES))
def test_explicit_scale_agree_global_weight(name):
    """scale multiplies an unreduced partial sum (its window sum becomes
    s times the rows' sum) and a plain array; agree and global_weight
    leave a global value as it is."""
    mesh, red, n = _explicit(name)
    rows = _rows(n, ROWS, COLS)

    def f(s, plain):
        scaled = red.scale(jnp.float32(0.5), red.load(s))
        acc, _ = red.reduce(scaled, jnp.float32(1.0), "mean")
        flag = red.agree(jnp.bool_(False))
        return acc, red.scale(jnp.float32(3.0), plain), flag

    with jax.set_mesh(mesh):
        plain = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P()))
        acc, tripled, flag = jax.jit(f)(_stacked(mesh, rows), plain)
        weight = jax.jit(red.global_weight)((jnp.float32(7.0), None))[0]
    np.testing.assert_allclose(acc, 0.5 * rows.sum(0), rtol=1e-6)
    np.testing.assert_array_equal(tripled, 3.0 * np.arange(4.0))
    assert not bool(flag)
    assert float(weight) == 7.0


@EIGHT
@pytest.mark.parametrize("name", list(MESHES))
def test_explicit_finite_sees_every_devices_partial_sum(name):
    """A NaN in the last data device's row: finite of the unreduced sums
    is False (globally); with every row finite, True; an infinite plain
    leaf beside an unreduced one counts too."""
    mesh, red, n = _explicit(name)
    rows = _rows(n, ROWS, COLS)
    bad = rows.copy()
    bad[n - 1, 2, 1] = np.nan

    def f(s, plain):
        return red.finite({"w": red.load(s), "b": plain})

    with jax.set_mesh(mesh):
        fine = jax.device_put(jnp.ones(4), NamedSharding(mesh, P()))
        inf = jax.device_put(jnp.ones(4).at[1].set(np.inf), fine.sharding)
        step = jax.jit(f)
        assert bool(step(_stacked(mesh, rows), fine))
        assert not bool(step(_stacked(mesh, bad), fine))
        assert not bool(step(_stacked(mesh, rows), inf))


@EIGHT
@pytest.mark.parametrize("name", list(MESHES))
def test_explicit_squared_norm_sums_each_devices_share(name):
    """Gradients unreduced over data: squared_norm gives sum_d |g_d|^2
    over the data devices' partial sums (each fsdp shard and each copy
    counted once), left unreduced for the window's reduction, and n is the
    data size; a plain gradient is one share (n = 1)."""
    mesh, red, n = _explicit(name)
    rows, bias = _rows(n, ROWS, COLS), _rows(n, COLS, seed=3)

    def f(s, b, plain):
        g = red.load({"w": s, "b": b})  # b: replicated over fsdp
        zero = red.load_sum(red.sum_zeros(jnp.float32))
        sq, sq_sum, k = red.squared_norm(g, g, zero)
        assert k == n, k
        total, _ = red.reduce_sums(sq + sq_sum, jnp.float32(0.0))
        one = {"b": plain}
        sq1, _, k1 = red.squared_norm(one, one, jnp.float32(0.0))
        assert k1 == 1
        return total, sq1

    with jax.set_mesh(mesh):
        plain = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P()))
        b = jax.device_put(bias, NamedSharding(mesh, P("data")))
        total, sq1 = jax.jit(f)(_stacked(mesh, rows), b, plain)
    want = (rows**2).sum() + (bias**2).sum()
    np.testing.assert_allclose(float(total), want, rtol=1e-5)
    np.testing.assert_allclose(float(sq1), (np.arange(4.0) ** 2).sum())
