"""The shared helpers of ``optaxaccum._src.utils`` and ``hlo``: one helper
per idea, each checked against the rule it replaces at its call sites."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxaccum as oa
from optaxaccum._src import checks, collectives, hlo, numerics, windows
from tests import hlo_queries

# ------------------------------------------------------------ arithmetic


def test_divide_or_never_divides_by_the_excluded_value():
    """x / y where ok, else the fallback, with no NaN in the gradient of an
    excluded y (the division sees 1 there)."""
    x, y = jnp.array([1.0, 1.0, 3.0]), jnp.array([2.0, 0.0, -1.0])
    np.testing.assert_array_equal(numerics.divide_or(x, y), [0.5, 0.0, -3.0])
    got = numerics.divide_or(x, y, y > 0, jnp.inf)
    np.testing.assert_array_equal(got, [0.5, np.inf, np.inf])
    grad = jax.grad(lambda y: numerics.divide_or(1.0, y).sum())(y)
    assert np.isfinite(grad).all(), grad


def test_optax_has_updated_is_optax_multisteps_rule():
    """The rule for flagless states answers as optax.MultiSteps does."""
    ms = optax.MultiSteps(optax.sgd(1.0), every_k_schedule=2)
    state = ms.init(jnp.zeros(1))
    for _ in range(4):
        want = ms.has_updated(state)
        got = windows.optax_has_updated(state.mini_step, state.gradient_step)
        assert bool(got) == bool(want)
        _, state = ms.update(jnp.ones(1), state)


# ------------------------------------------------------------ arguments


def test_check_callable_names_the_argument():
    assert checks.check_callable("f", len) is len
    assert checks.check_callable("f", None, none_ok=True) is None
    with pytest.raises(TypeError, match=r"^f must be callable, got f=3$"):
        checks.check_callable("f", 3)
    with pytest.raises(TypeError, match=r"^f must be callable or None, got"):
        checks.check_callable("f", 3, none_ok=True)


@pytest.mark.parametrize("bad", [(), ("data", None), ["data"], None])
def test_one_axis_name_rule(bad):
    """axis_names and check_axis_name share one rule: a hashable name or a
    non-empty tuple of them (check_axis_name also takes None)."""
    assert checks.axis_names("data") == ("data",)
    assert checks.axis_names(("a", "b")) == ("a", "b")
    with pytest.raises(TypeError, match="non-empty tuple"):
        checks.axis_names(bad)
    if bad is None:
        assert checks.check_axis_name(None) is None
        return
    with pytest.raises(TypeError, match="non-empty tuple"):
        checks.check_axis_name(bad)


def test_accumulate_refuses_an_empty_axis_name_when_built():
    """axis_name=() was refused only at the first update (by the mesh
    checks); the one rule refuses it where the argument is given."""
    with pytest.raises(TypeError, match="axis_name"):
        oa.accumulate(2, axis_name=())
    with pytest.raises(TypeError, match="axis_name"):
        oa.dynamic_loss_scale(axis_name=("data", None))


def test_wrap_indices_counts_negative_indices_from_the_end():
    assert checks.wrap_indices((0, -1, np.int64(-3)), 3, str) == (0, 2, 0)
    with pytest.raises(ValueError, match=r"^bad 3$"):
        checks.wrap_indices((1, 3), 3, lambda i: f"bad {i}")
    with pytest.raises(ValueError, match=r"^bad -4$"):
        checks.wrap_indices((-4,), 3, lambda i: f"bad {i}")


@pytest.mark.parametrize(
    ("cls", "caller", "what", "hint", "want"),
    [
        (
            oa.AccumulateState,
            "oa.accumulate",
            "",
            "",
            "oa.accumulate expects an AccumulateState, got tuple",
        ),
        (
            oa.DynamicLossScaleState,
            "oa.dynamic_loss_scale",
            "",
            "",
            "oa.dynamic_loss_scale expects a DynamicLossScaleState, got tuple",
        ),
        (
            oa.MultiStepsState,
            "oa.MultiSteps",
            "oa.MultiStepsState",
            " (convert it)",
            "oa.MultiSteps expects an oa.MultiStepsState, got tuple "
            "(convert it)",
        ),
    ],
)
def test_check_state_type_writes_the_three_messages(
    cls, caller, what, hint, want
):
    """The three "expects a ..., got ..." messages of the state classes."""
    with pytest.raises(TypeError) as e:
        checks.check_state_type((), cls, caller, what, hint)
    assert str(e.value) == want
    checks.check_state_type(
        cls(*[None] * len(cls._fields)), cls, caller, what, hint
    )


# ------------------------------------------------------------ states


def test_find_state_takes_a_class_or_a_predicate():
    """The first match in leaves order; a predicate names what it seeks."""
    tx = oa.chain(oa.accumulate(2), oa.accumulate(3), optax.sgd(1.0))
    state = tx.init(jnp.zeros(1))
    first = windows.find_state(state, oa.AccumulateState, "me")
    assert first is state[0]
    holds = lambda x: getattr(type(x), "_holds_window", False)  # noqa: E731
    assert windows.find_state(state, holds, "me", "windows") is state[0]
    with pytest.raises(ValueError, match=r"^me found no windows in the state"):
        windows.find_state((1, 2), holds, "me", "windows")
    with pytest.raises(ValueError, match="found no AccumulateState or"):
        windows.find_state((1,), (oa.AccumulateState, oa.MultiStepsState), "me")


def test_concrete_is_none_for_traced_values():
    np.testing.assert_array_equal(numerics.concrete(jnp.ones(2)), [1.0, 1.0])
    assert numerics.concrete(2, np.float32).dtype == np.float32
    seen = []
    jax.jit(lambda x: seen.append(numerics.concrete(x)) or x)(1.0)
    jax.vmap(lambda x: seen.append(numerics.concrete(x)) or x)(jnp.ones(2))
    assert seen == [None, None]


# ------------------------------------------------------------ HLO


def test_one_hlo_walker_serves_both_readers():
    """all_reduces and collective_census read the same instructions, in the
    same order, with the same branch paths (a reduction inside lax.cond's
    true branch, one on every call)."""
    mesh = jax.make_mesh((1,), ("d",), devices=jax.devices()[:1])

    def f(x, p):
        x = jax.lax.psum(x, "d")
        return jax.lax.cond(p, lambda: jax.lax.psum(x * 2, "d"), lambda: x)

    g = jax.shard_map(
        f, mesh=mesh, in_specs=(jax.P(), jax.P()), out_specs=jax.P()
    )
    text = jax.jit(g).lower(jnp.ones(3), True).compile().as_text()
    walked = list(hlo.instructions(text))
    assert walked, text
    reduces = hlo_queries.all_reduces(text)
    census = [
        c
        for c in collectives.collective_census(text, mesh)
        if c["op"] == "all-reduce"
    ]
    if jax.default_backend() == "cpu":  # XLA:CPU keeps one-device psums
        assert [r["branches"] for r in reduces] == [(), (1,)], reduces
    assert [r["branches"] for r in reduces] == [c["branches"] for c in census]
    assert [r["bytes"] for r in reduces] == [c["bytes"] for c in census]
    want = [
        dict(bytes=hlo.shape_bytes(shape), computation=name, branches=br)
        for name, br, _, shape, op in walked
        if op in ("all-reduce", "all-reduce-start")
    ]
    assert reduces == want
