"""``oa.accumulate(k, axis_name=..., shard_update=True)``: the optimizer's
state sharded over the data axes (ZeRO-1), paid once per window.

The window's one reduction over the data axes is a reduce-scatter
(``reducer.Scatter``; ``reducer.placed_spec`` says where each leaf's shard
lies), the elements after the accumulate (*followers*: the optimizer,
weight decay, clipping) run on each device's shard with their state
sharded the same way, and their updates are all-gathered back to the
params' sharding. Only under ``jax.jit`` on a mesh
whose data axes are Explicit; see docs/scaling.md, "Sharding the optimizer
state over the data axes (shard_update)".
"""

from __future__ import annotations

import contextlib
import functools
import os
import pathlib
import traceback
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optaxaccum._src import checks, gating, keywords, owned, reducer, sharding

__all__: list[str] = []


_reshard = owned.reshard  # ``x`` resharded to ``spec`` on its mesh


def place(tree: Any, axis_name: Any) -> Any:
    """Each leaf on an explicit mesh with the axes ``axis_name`` resharded
    to its :func:`reducer.placed_spec`; an unreduced leaf is summed over
    the axes it is unreduced over on the way (a reduce-scatter). Other
    leaves pass."""
    axes = checks.axis_names(axis_name)

    def leaf(x):
        if not sharding.is_explicit(x, axes):
            return x
        named = sharding.named_sharding(x)
        spec = sharding.without_unreduced(named.spec)
        return _reshard(x, reducer.placed_spec(spec, x.shape, named.mesh, axes))

    return jax.tree.map(leaf, tree)


def gather(tree: Any, axis_name: Any, like: Any = None) -> Any:
    """Each leaf sharded over some of the axes ``axis_name`` resharded
    back to the params' sharding (an all-gather over them): that of the
    corresponding leaf of the params ``like`` where given (also when
    ``axis_name`` names axes that shard the params), else without them."""
    axes = set(checks.axis_names(axis_name))
    if like is not None:
        return jax.tree.map(lambda x, p: _like(x, p, tuple(axes)), tree, like)

    def leaf(x):
        if not sharding.is_explicit(x, tuple(axes)):
            return x
        spec = sharding.spec_of(x)
        if not sharding.sharded_axes(spec.partitions) & axes:
            return x
        return _reshard(
            x, spec.update(partitions=sharding.drop_axes(spec.partitions, axes))
        )

    return jax.tree.map(leaf, tree)


def _like(x: Any, p: Any, axes: tuple) -> Any:
    """``x`` resharded to the sharding of the params' leaf ``p`` (plain: no
    unreduced or reduced axes), where both lie on an explicit mesh."""
    if not (sharding.is_explicit(x, axes) and sharding.is_explicit(p, axes)):
        return gather(x, axes)
    spec = sharding.without_unreduced(sharding.spec_of(p))
    spec = spec.update(reduced=frozenset())
    return _reshard(x, spec)


def check_explicit(grads: Any, axis_name: Any) -> None:
    """Raises ``ValueError`` naming ``shard_update`` when a floating
    gradient is not on an explicit mesh with the axes ``axis_name``: inside
    ``pmap``/``shard_map`` the mode is not supported."""
    leaves = [
        g
        for g in jax.tree.leaves(grads)
        if jnp.issubdtype(jnp.result_type(g), jnp.inexact)
    ]
    if leaves and not all(sharding.is_explicit(g, axis_name) for g in leaves):
        raise ValueError(
            f"oa.accumulate(axis_name={axis_name!r}, shard_update=True) "
            "needs jax.jit on a mesh whose axes axis_name are Explicit "
            "(jax.set_mesh, oa.unreduced_value_and_grad); inside pmap or "
            "shard_map use shard_update=False (docs/scaling.md)"
        )


def gathered(
    gate: gating.GatedTransformation, axis_name: Any
) -> gating.GatedTransformation:
    """``gate`` (whose emitted updates lie as :func:`place` puts them) with
    its emitted updates gathered back to the params' sharding, for use
    alone or in ``optax.chain``. Its follower hook gives
    :func:`optaxaccum.chain` ``gate`` itself and the followers run on each
    device's piece (:func:`on_shard`), their state initialised on the
    :func:`place`-d params."""
    flush = gate.gate_flush
    tx = gating.GatedTransformation(
        gate.init,
        _gathering(gate.gate_update, axis_name, params_at=2),
        None if flush is None else _gathering(flush, axis_name, params_at=1),
    )
    hook = gating.Followers(
        gate=gate,
        wrap=functools.partial(on_shard, axis_name=axis_name),
        place=functools.partial(place, axis_name=axis_name),
        init=functools.partial(init_followers, axis_name=axis_name),
    )
    return gating.with_followers(tx, hook)


def _whole_at(followers: Any, states: Any) -> int | None:
    """The position of the follower that needs whole leaves
    (:func:`owned.needs_whole_leaves` of it and its state in ``states``),
    if any; ``ValueError`` where it is not the last, or not the only
    one."""
    found = [
        i
        for i, (tx, state) in enumerate(zip(followers, states, strict=True))
        if owned.needs_whole_leaves(tx, state)
    ]
    if not found:
        return None
    if found != [len(followers) - 1]:
        raise ValueError(
            "under oa.accumulate(..., shard_update=True), a follower that "
            "needs whole leaves (optax.contrib.muon, oa.whole_leaves) must "
            "be the only such element and the last of the chain; got one "
            f"at position(s) {found} of {len(followers)} followers (put "
            "element-wise transformations such as weight decay before it, "
            "or use shard_update=False)"
        )
    return found[0]


def init_followers(followers: Any, params: Any, axis_name: Any) -> tuple:
    """The followers' states: each initialised on the :func:`place`-d
    params, except a follower that needs whole leaves
    (:func:`owned.init`: its state by ownership)."""
    placed = place(params, axis_name)
    shapes = [jax.eval_shape(tx.init, placed) for tx in followers]
    at = _whole_at(followers, shapes)
    if at is None or not _on_mesh(params, axis_name):
        return tuple(tx.init(placed) for tx in followers)
    return (
        *(tx.init(placed) for tx in followers[:at]),
        owned.init(followers[at], params, axis_name),
    )


def _on_mesh(params: Any, axis_name: Any) -> bool:
    """Whether ``params`` lie on a mesh whose axes ``axis_name`` are
    Explicit."""
    leaves = jax.tree.leaves(params)
    return bool(leaves) and sharding.tree_is_explicit(params, axis_name)


def _gathering(fn: Any, axis_name: Any, params_at: int) -> Any:
    """A gate function whose result's emitted updates are :func:`gather`-ed
    to the sharding of its params (argument ``params_at``), if given."""

    @functools.wraps(fn, updated=())  # not fn's attributes
    def wrapped(*args, **kwargs):
        res = gating.Decision.of(fn(*args, **kwargs))
        params = args[params_at] if len(args) > params_at else None
        params = kwargs.get("params", params)

        def gather_out(out: gating.Emission) -> gating.Emission:
            updates = gather(out.updates, axis_name, like=params)
            return out._replace(updates=updates)

        return res.then(gather_out)

    return wrapped


def on_shard(rest: Any, axis_name: Any) -> Any:
    """The chain's followers ``rest`` (a gated chain, or the plain run
    ``run(updates, state, params, window, extra_args)`` of ``gating.py``)
    run on the updates and params :func:`place`-d over ``axis_name``, their
    updates :func:`gather`-ed back."""
    if not gating.is_gate(rest):
        followers = getattr(rest, "transforms", ())
        _whole_at(followers, [owned.probed_state(tx) for tx in followers])

        def run(updates, state, params, window, extra_args):
            at = _whole_at(followers, state) if followers else None
            if at is not None:  # what the followers' state says
                owned_run = _owned_run(followers, at, axis_name)
                return owned_run(updates, state, params, window, extra_args)
            with _whole_leaves_named(axis_name):
                updates, state = rest(
                    place(updates, axis_name),
                    state,
                    place(params, axis_name),
                    window,
                    extra_args,
                )
            return gather(updates, axis_name, like=params), state

        return run

    def gate_update(updates, state, params, ctx, **extra_args):
        with _whole_leaves_named(axis_name):
            return rest.gate_update(
                place(updates, axis_name),
                state,
                place(params, axis_name),
                ctx,
                **extra_args,
            )

    # The chain calls only a follower's gate_update (flush closes the first
    # gate that can), so the wrapped gate needs no gate_flush.
    return gating.GatedTransformation(
        rest.init, _gathering(gate_update, axis_name, params_at=2)
    )


def _owned_run(followers: Any, at: int, axis_name: Any) -> Any:
    """The plain followers' run where the last, ``followers[at]``, needs
    whole leaves: those before it on each device's piece (as
    :func:`on_shard`), it by ownership (:func:`owned.update`)."""
    before = gating.plain_run(followers[:at]) if at else None
    whole = optax.with_extra_args_support(followers[at])

    def run(updates, state, params, window, extra_args):
        updates = place(updates, axis_name)
        if before is not None:
            with _whole_leaves_named(axis_name):
                updates, head = before(
                    updates,
                    state[:at],
                    place(params, axis_name),
                    window,
                    extra_args,
                )
        else:
            head = ()
        args = gating.args_for(
            keywords.declared_extra_args(whole), extra_args, window
        )
        updates, last = owned.update(
            whole, updates, state[at], params, axis_name, args
        )
        return updates, (*head, last)

    return run


@contextlib.contextmanager
def _whole_leaves_named(axis_name: Any) -> Iterator[None]:
    """Turns JAX's ``ShardingTypeError`` raised while the followers run on
    each device's piece (a follower that needs whole leaves: a matrix
    product over a dimension the data axes split, as in
    ``optax.contrib.muon``) into a ``ValueError`` naming ``shard_update``
    and the follower's code, raised at the first step's trace."""
    try:
        yield
    except Exception as e:
        if type(e).__name__ != "ShardingTypeError":
            raise
        frames = [
            f
            for f in traceback.extract_tb(e.__traceback__)
            if f"{os.sep}jax{os.sep}" not in f.filename
        ]
        where = _module(frames[-1].filename) if frames else "?"
        func = frames[-1].name if frames else "?"
        raise ValueError(
            f"oa.accumulate(axis_name={axis_name!r}, shard_update=True): a "
            f"follower needs whole leaves and cannot run on each device's "
            f"piece of them (in {where}, {func}: {e}). A follower that "
            "orthogonalises or preconditions whole matrices runs by "
            "ownership when it is the last element of oa.chain and is "
            "optax.contrib.muon itself or marked oa.whole_leaves(tx) (it "
            "must treat leaves independently); else use shard_update=False "
            "(docs/scaling.md)."
        ) from e


def _module(filename: str) -> str:
    """An installed source file's module name (``optax.contrib._muon``);
    another file's path."""
    parts = pathlib.Path(filename).with_suffix("").parts
    for top in ("site-packages", "dist-packages"):
        if top in parts:
            return ".".join(parts[parts.index(top) + 1 :])
    return filename
