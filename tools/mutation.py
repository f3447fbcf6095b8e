"""Mutation check: does the suite catch these deliberate bugs?

Each mutant is one textual replacement in one source file. For each, the
repository is copied into a temporary folder, the mutant is applied to the
copy, and the tests that should catch it run there, with the copy first on
the import path; the checkout itself is never written. Prints a table of
killed / survived mutants. Not part of ``make test`` (minutes of runtime):

    .venv/bin/python tools/mutation.py            # all mutants
    .venv/bin/python tools/mutation.py nested_tail # some, by name
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Where a mutant's file lies, relative to the repository (or its copy).
SRC = pathlib.Path("optaxaccum", "_src")
# What a copy leaves out when the repository is not a git checkout.
_NOT_COPIED = (
    ".git",
    ".venv",
    "venv",
    "build",
    "dist",
    "_build",
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
    "*.egg-info",
)
# The edge cases of the loss scale and of MultiSteps that the core's
# mutants must also pass (they run after the chain's and accumulate's tests).
_EDGES = [
    "tests/test_loss_scale.py::test_loss_scale_zero_weight_call_is_not_an_"
    "overflow",
    "tests/test_loss_scale.py::test_loss_scale_without_accumulate_passes_"
    "zero_weight_call_on",
    "tests/test_loss_scale.py::test_loss_scale_overflow_in_a_complex_part",
    "tests/test_loss_scale.py::test_dynamic_loss_scale_replicas_agree_on_"
    "one_device_overflow",
    "tests/test_multisteps.py::test_multisteps_has_updated_on_an_optax_"
    "state_answers_as_optax",
    "tests/test_multisteps.py::test_multisteps_takes_accumulator_dtype_"
    "fifth_positional",
]
CORE_TESTS = ["tests/test_chain.py", "tests/test_accumulate.py", *_EDGES]

_ACC = ["tests/test_accumulate.py"]
_CHAIN = ["tests/test_chain.py"]
_LOSS_SCALE = ["tests/test_loss_scale.py"]
# Nested chains and windows of weight 0 (API.md 2).
_NESTED_0 = [
    "tests/test_chain.py",
    "tests/test_contract.py",
    "-k",
    "as_one_accumulate_of_4 or skips_a_window_of_weight_0 or padding",
]

# name: (file under the package's _src folder, original text, mutated text,
# pytest arguments: test files, optionally -k)
MUTANTS = {
    "nested_tail": (  # issue 10 (a): followers' state from the inner branch
        "gating.py",
        "state=flags.select(out.opened, e.state, tail_state),",
        "state=e.state,",
        CORE_TESTS,
    ),
    "closed_params_plus_zeros": (  # issue 10 (b)
        "chain.py",
        "return params, res.state, flags.zeros_of(like)",
        "return (jax.tree.map(lambda p: p + jnp.zeros_like(p), params), "
        "res.state, flags.zeros_of(like))",
        ["tests/test_nnx_optimizer.py"],
    ),
    "zero_weight_not_masked": (
        "accumulate.py",
        "wg = jnp.where(weightless, jnp.zeros_like(wg), wg)",
        "wg = wg",
        CORE_TESTS,
    ),
    "nested_weight_not_passed": (
        "accumulate.py",
        "weight\n            if cfg.reduction",
        "jnp.ones_like(weight)\n            if cfg.reduction",
        CORE_TESTS,
    ),
    "invalid_weight_counts_as_finite": (
        "accumulate.py",
        "finite = flags.both(valid, flags.either(exempt, "
        "sums.finite(updates)))",
        "finite = flags.either(exempt, sums.finite(updates))",
        CORE_TESTS,
    ),
    "stale_accumulator_not_reset": (
        "accumulate.py",
        "        return jnp.where(fresh, jnp.zeros_like(a), a)",
        "        return a",
        ["tests/test_micro_step.py", "-k", "earlier_version"],
    ),
    "zero_weight_window_opens": (
        "accumulate.py",
        "closing & (weight != 0), closing",
        "closing, closing",
        CORE_TESTS,
    ),
    "dropped_micro_batch_advances": (
        "accumulate.py",
        "mini_step = flags.select(counted, state.mini_step + 1, "
        "state.mini_step)",
        "mini_step = state.mini_step + 1",
        CORE_TESTS,
    ),
    "flush_keeps_window_position": (
        "accumulate.py",
        "mini_step=jnp.zeros([], jnp.int32),\n        gradient_step="
        "optax.safe_increment(state.gradient_step),",
        "gradient_step=optax.safe_increment(state.gradient_step),",
        CORE_TESTS,
    ),
    "eager_gate_ignored": (
        "accumulate.py",
        "counted = passed\n",
        "counted = True\n",
        CORE_TESTS + ["tests/test_loss_scale.py"],
    ),
    # ----------------------------------------------- issue 23 (hardening 2)
    "float32_window_weight": (  # item 2
        "accumulate.py",
        "weight=jnp.zeros([], _weight_dtype(cfg, params)),",
        "weight=jnp.zeros([], jnp.float32),",
        _ACC + ["-k", "float64_mean"],
    ),
    "zero_weight_call_overflows": (  # item 4
        "loss_scale.py",
        "new_state = flags.select(no_data, state, _adjust(state, finite))",
        "new_state = _adjust(state, finite)",
        _LOSS_SCALE + ["-k", "zero_weight_call"],
    ),
    "complex_explicit_real_accumulator": (  # item 5
        "accumulate.py",
        "        return numerics.widen(jnp.complex64, cfg.accumulator_dtype)",
        "        return jnp.finfo(cfg.accumulator_dtype).dtype",
        _ACC + _LOSS_SCALE + ["-k", "complex"],
    ),
    "loss_scale_ignores_imaginary_part": (  # item 5
        "numerics.py",
        "parts = (g.real, g.imag) if jnp.iscomplexobj(g) else (g,)",
        "parts = (g.real,) if jnp.iscomplexobj(g) else (g,)",
        _LOSS_SCALE + ["-k", "complex_part"],
    ),
    "nnx_refused_micro_batch_enters_bn": (  # item 6
        "../flax/nnx.py",
        "                module.keep_counted(old_opt_state, opt_state)",
        "                pass",
        ["tests/test_nnx_optimizer.py", "-k", "refused"],
    ),
    "bare_weight_not_a_near_miss": (  # item 7
        "keywords.py",
        "        close = close or [d for d in declared "
        'if d.endswith(f"_{key}")]\n',
        "",
        _CHAIN + ["-k", "bare_weight"],
    ),
    "has_updated_flagless_optax_rule": (  # item 8
        "windows.py",
        "(jnp.asarray(mini_step) == 0) & (jnp.asarray(gradient_step) > 0)",
        "jnp.asarray(mini_step) == 0",
        ["tests/test_multisteps.py", "-k", "multisteps_has_updated"],
    ),
    "nnx_update_returns_none": (  # item 9
        "../flax/nnx.py",
        "        self.step[...] += 1\n        return updates",
        "        self.step[...] += 1\n        return None",
        ["tests/test_nnx_optimizer.py", "-k", "returns_the_updates"],
    ),
    "unreduced_first_argnum_only": (  # item 10
        "sharding.py",
        "        for i in nums:",
        "        for i in nums[:1]:",
        ["tests/test_mesh.py", "-k", "tuple_argnums"],
    ),
    "emitted_shapes_not_kept": (  # an eager closed update traces again
        "gating.py",
        "            like = trace()\n            self.put(key, like)",
        "            like = trace()",
        ["tests/test_gating.py", "-k", "stays_closed"],
    ),
    "emitted_shapes_by_tree_only": (  # shapes of another call reused
        "gating.py",
        "types.append(jax.typeof(x))",
        "types.append(type(x))",
        ["tests/test_gating.py", "-k", "kept_by_the_types"],
    ),
    "emitted_shapes_keep_functions": (  # a value_fn's tracers kept alive
        "gating.py",
        "                else:\n                    return None",
        "                else:\n                    types.append((type(x), x))",
        ["tests/test_gating.py", "-k", "no_function"],
    ),
    "emitted_shapes_copy_split": (  # a copy's update fills another cache
        "gating.py",
        'shapes = update_fn.__dict__["_oa_gate"]._shapes',
        "shapes = update_fn.__dict__.setdefault('_s', EmittedShapes())",
        ["tests/test_gating.py", "-k", "one_place"],
    ),
    "opened_false_zeros_grads_dtype": (  # zeros of an all-weight-0 window
        "gating.py",
        "            return flags.zeros_of(like), self.state",
        # zeros in the test's gradient dtype, not the followers' float32
        "            return jax.tree.map(lambda s: jnp.zeros(s.shape, "
        "jnp.bfloat16), like), self.state",
        _CHAIN + ["-k", "followers_output_dtype"],
    ),
    "closed_gate_zeros_grads_dtype": (  # a nested gate that stays closed
        "gating.py",
        "        return Emission.shut(like, later.state, opened=false, "
        "passed=false)\n",
        "        like = like._replace(updates=out.updates)\n"
        "        return Emission.shut(like, later.state, opened=false, "
        "passed=false)\n",
        _CHAIN + ["-k", "nested_closed_gate"],
    ),
    "per_micro_step_pmean": (  # one reduction per window, not per call
        "accumulate.py",
        "    acc = jax.tree.map(add, state.acc, updates)",
        "    if cfg.axis_name is not None and not sharding.is_explicit(\n"
        "        jax.tree.leaves(updates)[0], cfg.axis_name\n"
        "    ):\n"
        "        updates = jax.lax.pmean(updates, cfg.axis_name)\n"
        "    acc = jax.tree.map(add, state.acc, updates)",
        ["tests/test_multidevice.py", "-k", "hlo_gradient"],
    ),
    "micro_step_reduces_on_mesh": (  # a data-axis all-reduce per call
        "accumulate.py",
        "    acc = jax.tree.map(add, state.acc, updates)",
        "    updates = jax.tree.map(\n"
        "        lambda g: jax.reshard(\n"
        "            g, sharding.without_unreduced(sharding.spec_of(g))\n"
        "        )\n"
        "        if sharding.unreduced_axes(g)\n"
        "        else g,\n"
        "        updates,\n"
        "    )\n"
        "    acc = jax.tree.map(add, state.acc, updates)",
        [
            "tests/test_mesh.py",
            "-k",
            "hlo_one_data_reduction or no_data_collective_until",
        ],
    ),
    "no_window_reduction_explicit_mesh": (
        "reducer.py",
        "        return jax.tree.map(self._reduce_leaf, acc), weight",
        "        return acc, weight",
        ["tests/test_mesh.py", "-k", "emits_reduced"],
    ),
    "shard_update_followers_unsharded": (  # issue 27: ZeRO-1 state
        "chain.py",
        "    if at is None:\n        return optax.chain(*transforms).init",
        "    if True:\n        return optax.chain(*transforms).init",
        ["tests/test_shard_update.py", "-k", "born"],
    ),
    "shard_update_all_reduce": (  # issue 27: a reduce-scatter per window
        "reducer.py",
        "return Scatter(axis_name) if shard_update else Explicit(axis_name)",
        "return Explicit(axis_name)",
        ["tests/test_shard_update.py", "-k", "hlo"],
    ),
    "shard_update_wrong_piece": (  # issue 27: each device's own piece
        "reducer.py",
        "c = lax.psum_scatter(c, axes, scatter_dimension=i, tiled=True)",
        "c = lax.psum_scatter(\n"
        "                lax.rev(c, (i,)), axes, scatter_dimension=i, "
        "tiled=True\n            )",
        ["tests/test_shard_update.py", "-k", "equals"],
    ),
    "shard_update_not_gathered": (  # issue 27: updates back to params'
        "shard_update.py",
        "        if not sharding.sharded_axes(spec.partitions) & axes:",
        "        if True:",
        ["tests/test_shard_update.py", "-k", "born"],
    ),
    "shard_update_not_gathered_like_params": (  # issue 27, review
        "shard_update.py",
        "    return _reshard(x, spec)\n",
        "    return x\n",
        ["tests/test_shard_update.py", "-k", "fsdp_is_named"],
    ),
    "gate_drops_window_weight": (  # review: a gate between accumulates
        "chain.py",
        "        if window is not None:\n            res = res.pass_window_on(",
        "        if False:\n            res = res.pass_window_on(",
        CORE_TESTS + ["-k", "window_weight_on or behind_a_gate"],
    ),
    "zeros_not_device_varying": (  # issue 23: zeros under shard_map
        "flags.py",
        "    return jax.tree.map(jnp.zeros_like, shapes)",
        "    return jax.tree.map(\n"
        "        lambda s: jnp.zeros(s.shape, s.dtype), shapes)",
        _CHAIN + ["-k", "device_varying"],
    ),
    "state_shardings_masked_node": (  # issue 35 (2): optax.masked
        "sharding.py",
        '_masked(x) or getattr(x, "shape", None) == shape',
        'getattr(x, "shape", None) == shape',
        ["tests/test_reshard_state.py", "-k", "wrappers"],
    ),
    "reshard_state_counts_rows_n_times": (  # issue 35 (3)
        "reshard.py",
        "rows[0] = total",
        "rows[:] = total",
        ["tests/test_reshard_state.py", "-k", "across"],
    ),
    "reshard_state_keeps_one_row": (  # issue 35 (3): rows folded
        "reshard.py",
        "total = x.sum(0, dtype=_wide(x.dtype)) if stacked_in else x",
        "total = x[0] if stacked_in else x",
        ["tests/test_reshard_state.py", "-k", "across"],
    ),
    "noise_share_weight": (  # issue 35 (4): a share weighs w / n
        "noise_scale.py",
        "wsq = sums.scale(n * w, sq)",
        "wsq = sums.scale(w, sq)",
        ["tests/test_noise_scale.py", "-k", "uneven_shares_match"],
    ),
    "whole_leaves_not_named": (  # issue 35 (5): muon under shard_update
        "shard_update.py",
        'if type(e).__name__ != "ShardingTypeError":',
        "if True:",
        ["tests/test_shard_update.py", "-k", "whole_leaves"],
    ),
    "fsdp_gather_off_mesh_unnamed": (  # issue 35 (9)
        "sharding.py",
        "if sharding is None or not sharding.mesh.axis_names:",
        "if sharding is None:",
        ["tests/test_mesh.py", "-k", "not_on_a_mesh"],
    ),
    "shard_update_unsplit_leaf_not_summed": (  # issue 35 (10)
        "reducer.py",
        "spec.unreduced - set(axes if placed else ())",
        "spec.unreduced - set(axes)",
        ["tests/test_shard_update.py", "-k", "unsplit"],
    ),
    "shard_update_flush_not_gathered_like_params": (  # issue 35 (11)
        "shard_update.py",
        "_gathering(flush, axis_name, params_at=1)",
        "_gathering(flush, axis_name, params_at=9)",
        ["tests/test_shard_update.py", "-k", "flush_with_fsdp"],
    ),
    "shard_update_followers_params_not_placed": (  # issue 35 (12)
        "shard_update.py",
        "                    state,\n"
        "                    place(params, axis_name),\n",
        "                    state,\n                    params,\n",
        ["tests/test_shard_update.py", "-k", "split_like"],
    ),
    "fsdp_gather_drops_own_reduced_axes": (  # issue 35 (14)
        "sharding.py",
        "reduced=frozenset(names) | spec.reduced)",
        "reduced=frozenset(names))",
        ["tests/test_mesh.py", "-k", "own_reduced_axes"],
    ),
    "replicas_disagree_on_overflow": (
        "loss_scale.py",
        "            finite = sums.agree(finite)\n",
        "",
        _LOSS_SCALE + ["-k", "replicas_agree"],
    ),
    # ----------------------------------------------- issue 35 (hardening 3)
    "nested_plain_chain_drops_empty": (  # item 1
        "gating.py",
        "return res._replace(state=state, emit=emit)",
        "return Decision(state=state, may_open=res.may_open, emit=emit)",
        _NESTED_0,
    ),
    "empty_window_emit_steps_followers": (  # item 1: emit on weight 0
        "gating.py",
        "        if self.empty is False:\n            return self.emission()",
        "        if True:\n            return self.emission()",
        _NESTED_0,
    ),
    "nested_plain_chain_drops_window_weight": (  # item 1: positional
        "gating.py",
        "        return out._replace(updates=updates, state=(*head, out.state, "
        "*tail))",
        "        return Emission(updates=updates, state=(*head, out.state, "
        "*tail), opened=out.opened)",
        _NESTED_0,
    ),
    "required_keyword_gate_refused": (  # item 6
        "gating.py",
        "signature.bind(None, None, None, base.GateContext(), **required)",
        "signature.bind(None, None, None, base.GateContext())",
        ["tests/test_chain.py", "-k", "required_keyword"],
    ),
    "gate_flag_dtype_unchecked": (  # item 7
        "chain.py",
        "        _check_flags(res, gate)\n",
        "",
        ["tests/test_chain.py", "-k", "non_boolean"],
    ),
    "head_steps_on_a_window_of_weight_0": (  # item 15
        "chain.py",
        "counts = flags.both(ctx.passed, gating.window_counts(window))",
        "counts = ctx.passed",
        ["tests/test_chain.py", "-k", "skips_a_window_of_weight_0"],
    ),
    "critical_batch_min_k_1_silent": (  # item 8
        "noise_scale.py",
        "    if every_k.min_k < 2 and axis_name is None:",
        "    if False:",
        ["tests/test_noise_scale.py", "-k", "min_k_1"],
    ),
    "critical_batch_window_rounds_to_nearest": (  # item 13
        "noise_scale.py",
        "k = jnp.ceil(self.fraction * b_simple(state) / "
        "self.micro_batch_weight)",
        "k = jnp.round(self.fraction * b_simple(state) / "
        "self.micro_batch_weight)",
        ["tests/test_noise_scale.py", "-k", "rounds_up"],
    ),
    "counted_ignores_closed_windows": (  # item 16: windows of one
        "windows.py",
        "    return (new.mini_step != old.mini_step) | (\n"
        "        new.gradient_step != old.gradient_step\n    )",
        "    return new.mini_step != old.mini_step",
        [
            "tests/test_accumulate.py",
            "tests/test_nnx_optimizer.py",
            "-k",
            "window_of_one",
        ],
    ),
    "plain_optimizer_calls_not_counted": (  # item 17
        "windows.py",
        "    except ValueError:\n        return True\n    return _moved",
        "    except ValueError:\n        return False\n    return _moved",
        ["tests/test_nnx_optimizer.py", "-k", "counts_every_call"],
    ),
    "has_updated_reads_the_last_window": (  # item 18
        "windows.py",
        "    for node in jax.tree.leaves(state, is_leaf=match):",
        "    for node in reversed(jax.tree.leaves(state, is_leaf=match)):",
        ["tests/test_nnx_optimizer.py", "-k", "follows_nested"],
    ),
    "nnx_flush_not_recorded_as_counted": (  # item 19
        "../flax/nnx.py",
        "            self._record(self._stats())  # a flush always counts",
        "            pass",
        ["tests/test_nnx_optimizer.py", "-k", "right_after_flush"],
    ),
    "closed_ignores_nesting": (  # BN windows close with the first window
        "windows.py",
        "    return functools.reduce(jnp.logical_and, flags)",
        "    return flags[0]",
        ["tests/test_nnx_optimizer.py", "-k", "window_of_one_in_front"],
    ),
    "closed_skips_inner_windows": (  # an accumulate inside oa.MultiSteps
        "windows.py",
        "found += [s, *_window_states(tuple(s))]",
        "found += [s]",
        ["tests/test_multisteps.py", "-k", "inside_a_window"],
    ),
    "older_batch_stats_flushed": (  # no momentum: the flush would raise
        "../flax/_linen.py",
        "        stats_lib.MOMENTUM_KEY not in layer for _, layer in layers(",
        "        False for _, layer in layers(",
        ["tests/test_flax.py", "-k", "without_a_momentum"],
    ),
    "closed_on_every_counted_call": (  # the window's position ignored
        "windows.py",
        "_moved(old, new) & (new.mini_step == 0)",
        "_moved(old, new)",
        ["tests/test_nnx_optimizer.py", "-k", "critical_batch"],
    ),
    "trainstate_bn_windows_not_closed_with_the_optimizer": (
        "../flax/_train_state.py",
        "    return _linen.flush_windows(kept, None, where=closed)",
        "    return kept",
        ["tests/test_flax.py", "-k", "critical_batch"],
    ),
    "nnx_bn_windows_not_closed_with_the_optimizer": (
        "../flax/nnx.py",
        "        if closed is not False:\n            self._flush(closed)",
        "        if False:\n            self._flush(closed)",
        ["tests/test_nnx_optimizer.py", "-k", "critical_batch"],
    ),
    "gate_branch_not_kept": (  # XLA:GPU would turn the gate into a select
        "flags.py",
        "return lax.cond(pred, _kept(true_fn), _kept(false_fn))",
        "return lax.cond(pred, true_fn, false_fn)",
        ["tests/test_gpu_branch.py"],
    ),
    "gate_closed_branch_not_kept": (
        "flags.py",
        "return lax.cond(pred, _kept(true_fn), _kept(false_fn))",
        "return lax.cond(pred, _kept(true_fn), false_fn)",
        ["tests/test_gpu_branch.py"],
    ),
    # ----------------------------------------- one helper per idea
    "divide_or_sees_the_excluded_divisor": (
        "numerics.py",
        "return jnp.where(ok, x / jnp.where(ok, y, 1), otherwise)",
        "return jnp.where(ok, x / y, otherwise)",
        ["tests/test_utils.py", "-k", "divide_or"],
    ),
    "axis_name_checked_by_a_second_rule": (
        "checks.py",
        "    if value is not None:\n        axis_names(value)\n",
        "    if value is not None:\n        hash(value)\n",
        ["tests/test_utils.py", "-k", "axis_name"],
    ),
    "hlo_walk_forgets_branches": (
        "hlo.py",
        "inner = branches if index is None else (*branches, index)",
        "inner = branches",
        ["tests/test_utils.py", "-k", "hlo_walker"],
    ),
    "hlo_every_call_enters_branches": (
        "hlo.py",
        "if through_branches or index is None",
        "if True",
        ["tests/gpu_compile/test_hlo_reader.py", "-k", "placement"],
    ),
    # ------------------------------- one reducer per mesh mode (reducer.py)
    "noise_sum_reduction_not_undone": (  # pmap: "sum" averages the sums
        "reducer.py",
        'return lax.axis_size(self.axis_name) if reduction == "sum" else None',
        "return None",
        ["tests/test_noise_scale.py", "-k", "small_batches"],
    ),
    "noise_sums_not_reduced_when_mapped": (  # pmap/shard_map: one psum
        "reducer.py",
        "both = lax.psum(jnp.stack([sq_sum, count]), self.axis_name)",
        "both = jnp.stack([sq_sum, count])",
        ["tests/test_noise_scale.py", "-k", "small_batches"],
    ),
    # ------------------------------- behaviours a mutation run found unpinned
    "stacked_in_the_given_axis_order": (  # axis_name out of mesh order
        "reducer.py",
        "        axes = sharding.ordered_axes(named.mesh, "
        "checks.axis_names(axis_name))\n        n = int(",
        "        axes = checks.axis_names(axis_name)\n        n = int(",
        ["tests/test_mesh.py", "-k", "out_of_mesh_order"],
    ),
    "stack_read_in_the_given_axis_order": (
        "reducer.py",
        "    axes = sharding.ordered_axes(named.mesh, "
        "checks.axis_names(axis_name))\n    first = ",
        "    axes = checks.axis_names(axis_name)\n    first = ",
        ["tests/test_mesh.py", "-k", "out_of_mesh_order"],
    ),
    "has_updated_flagless_rule_swapped": (  # optax's rule, its two counters
        "windows.py",
        "optax_has_updated(found.mini_step, found.gradient_step)",
        "optax_has_updated(found.gradient_step, found.mini_step)",
        ["tests/test_multisteps.py", "-k", "has_updated"],
    ),
    "bn_window_of_no_element_closes": (  # all masked: running stats stay
        "batch_stats.py",
        "    use = where & seen\n",
        "    use = where\n",
        ["tests/test_flax.py", "-k", "mask"],
    ),
    "head_steps_on_a_refused_call": (  # behind a loss scale that overflows
        "chain.py",
        "counts = flags.both(ctx.passed, gating.window_counts(window))",
        "counts = gating.window_counts(window)",
        _CHAIN + ["-k", "skips_an_overflow"],
    ),
    "window_of_weight_0_stops_at_an_eager_gate": (  # not counted after it
        "gating.py",
        "            if plain:  # they do not step on a window of weight 0\n",
        "            if True:  # they do not step on a window of weight 0\n",
        _CHAIN + ["-k", "reaches_a_second_accumulate"],
    ),
    "reshard_state_folds_complex_as_real": (  # the imaginary part lost
        "reshard.py",
        "    return np.complex128 if np.iscomplexobj(np.zeros((), dtype)) "
        "else np.float64",
        "    return np.float64",
        ["tests/test_reshard_state.py", "-k", "complex"],
    ),
    "older_batch_stats_warn_on_every_call": (  # not only where a close is due
        "../flax/_train_state.py",
        "    if (known is not None and not known) or not _linen.has_windows(",
        "    if not _linen.has_windows(",
        ["tests/test_flax.py", "-k", "older_batch_stats"],
    ),
    "counted_reads_the_innermost_window": (  # nested windows
        "windows.py",
        '    return _moved(old, _find_window(new_state, "counted"))',
        "    return _moved(\n        _window_states(old_state)[-1], "
        "_window_states(new_state)[-1]\n    )",
        ["tests/test_accumulate.py", "-k", "counted"],
    ),
    # Windows that follow the data, an optimizer that follows the window.
    "every_weight_max_k_off_by_one": (
        "every_weight.py",
        "return reached | (mini_step >= self.max_k)",
        "return reached | (mini_step > self.max_k)",
        ["tests/test_every_weight.py", "-k", "hand_loop"],
    ),
    "scale_by_window_schedule_after_the_window": (
        "window_scale.py",
        "scale = r if schedule is None else r * schedule(state.tau)",
        "scale = r if schedule is None else r * schedule(state.tau + r)",
        ["tests/test_scale_by_window.py", "-k", "schedule_at_tau"],
    ),
    "scale_by_window_gain_nan_kept": (
        "window_scale.py",
        "return jnp.where(jnp.isnan(r), jnp.ones_like(r), r)",
        "return r",
        ["tests/test_scale_by_window.py", "-k", "unset"],
    ),
    "window_noise_reaches_every_follower": (
        "gating.py",
        '    for k in ("accum_weight", *private):',
        '    for k in ("accum_weight", *private[1:]):',
        ["tests/test_scale_by_window.py", "-k", "stays_private"],
    ),
    # ------------------------------- gather once per step (gather_once.py)
    "held_copy_reduced_over_held_axes_only": (  # per-micro-batch psum
        "gather_once.py",
        "reduced = spec.reduced | (\n        frozenset(cfg.batch_axes)",
        "reduced = spec.reduced | axes | (\n        frozenset()",
        ["tests/test_gather_once.py", "-k", "deferral"],
    ),
    "gather_once_holds_nothing": (
        "gather_once.py",
        "    if not axes or not sharding.all_explicit(",
        "    if True or not sharding.all_explicit(",
        ["tests/test_gather_once.py", "-k", "census"],
    ),
    "held_scatter_without_rest_psum": (
        "gather_once.py",
        "return lax.psum(c, rest) if rest else c",
        "return c",
        ["tests/test_gather_once.py", "-k", "deferral"],
    ),
    "held_smallest_first": (
        "gather_once.py",
        "for i in sorted(costs, key=lambda i: -costs[i]):",
        "for i in sorted(costs, key=lambda i: costs[i]):",
        ["tests/test_gather_once.py", "-k", "budget"],
    ),
    # Gather once, hidden: the first and last micro-batch peeled.
    "peel_never": (
        "microbatch.py",
        "        if not (holds and self.peel):",
        "        if True:",
        ["tests/test_gather_once.py", "-k", "census_one"],
    ),
    "peel_last_stacked_first": (
        "microbatch.py",
        "parts.append(jax.tree.map(lambda x: x[None], last))",
        "parts.insert(0, jax.tree.map(lambda x: x[None], last))",
        ["tests/test_gather_once.py", "-k", "peeled_step"],
    ),
    "interleave_split_by_jax_rule": (  # a size-1 axis on the index
        "microbatch.py",
        "    if not interleave or named is None:",
        "    if True:",
        ["tests/test_gather_once.py", "-k", "one_row_per_device"],
    ),
    "gather_once_dtype_value_error": (
        "gather_once.py",
        "                wrong_kind=TypeError,\n",
        "",
        ["tests/test_gather_once.py", "-k", "field_once"],
    ),
    "gather_once_no_mesh_names_axis_name": (
        "gather_once.py",
        "nothing to gather: drop gather_once= from ",
        "nothing to gather: drop axis_name from ",
        ["tests/test_gather_once.py", "-k", "no_mesh"],
    ),
    # Hardening 4, items 1-9: crashes and traps.
    "one_device_mesh_inlines_unreduced": (  # JAX rejects the inlined body
        "sharding.py",
        "    one_device = math.prod(context.shape.values()) == 1",
        "    one_device = False",
        ["tests/test_mesh.py", "-k", "one_device_steps"],
    ),
    "has_updated_first_window_only": (  # nested: an inner window closing
        "windows.py",
        "flags = [window_updated(s) for s in _window_states(state)]",
        "flags = [window_updated(s) for s in _window_states(state)][:1]",
        ["tests/test_accumulate.py", "-k", "answers_for_the_optimizer"],
    ),
    "nested_flush_closes_the_first_window_only": (
        "chain.py",
        '        if getattr(rest, "gate_flush", None) is None:',
        "        if True:",
        ["tests/test_chain.py", "-k", "as_one_window"],
    ),
    "flush_misses_a_stock_optax_chain": (
        "chain.py",
        'fns = inspect.getclosurevars(update).nonlocals.get("update_fns")',
        "fns = None",
        ["tests/test_chain.py", "-k", "chains_of_accumulates_flush"],
    ),
    "accum_weight_reaches_every_follower": (  # optax.lbfgs breaks
        "gating.py",
        '    for k in ("accum_weight", *private):',
        "    for k in private:",
        ["tests/test_chain.py", "-k", "lbfgs_after or reaches_only"],
    ),
    "unbound_axis_name_left_to_jax": (
        "sharding.py",
        "                raise ValueError(msg) from None",
        "                raise",
        ["tests/test_mesh.py", "-k", "without_mesh_or_map"],
    ),
    "batchnorm_early_close_unchecked": (  # accum_steps < the window
        "batch_stats.py",
        "    early = early & counted & jnp.logical_not(closed)",
        "    early = early & False",
        ["tests/test_flax.py", "-k", "shorter_than_the_window"],
    ),
    # Whole-matrix followers under shard_update (owned leaves).
    "owned_everyone_computes": (  # every device runs branch 0's leaves
        "owned.py",
        "upd_rows, pieces, new = lax.switch(r, branches, *args)",
        "upd_rows, pieces, new = branches[0](*args)",
        ["tests/test_owned.py", "-m", "not slow", "-k", "equals"],
    ),
    "owned_rows_not_moved": (  # reshard keeps the old owners' offsets
        "reshard.py",
        "moved[o2, off2 : off2 + size] = rows[o, off : off + size]",
        "moved[o, off : off + size] = rows[o, off : off + size]",
        ["tests/test_owned.py", "-m", "not slow", "-k", "new_owner"],
    ),
    "muon_found_inside_another_transformation": (  # a global norm breaks
        "owned.py",
        '    inner = getattr(state, "inner_states", None)\n',
        "    found = jax.tree.leaves(\n"
        "        state, is_leaf=lambda x: isinstance(x, optax.PartitionState)\n"
        "    )\n"
        "    state = next(\n"
        "        (x for x in found if isinstance(x, optax.PartitionState)),\n"
        "        state,\n"
        "    )\n"
        '    inner = getattr(state, "inner_states", None)\n',
        ["tests/test_shard_update.py", "-k", "refused_by_name"],
    ),
    "muon_not_recognised": (  # muon itself runs on each device's piece
        "owned.py",
        '        set(inner) == {"muon", "adam"}\n',
        '        set(inner) == {"muon", "adam", "never"}\n',
        ["tests/test_owned.py", "-m", "not slow", "-k", "equals"],
    ),
    "owned_unbalanced": (  # every matrix to the first device
        "owned.py",
        "d = int(np.argmin(share))  # the first of equals",
        "d = 0",
        ["tests/test_owned.py", "-m", "not slow", "-k", "balanced"],
    ),
    "owned_stacked_leaf_gathered_whole": (  # back over data: all layers
        "owned.py",
        "    entries = sharding.padded_entries(leaf.spec, len(leaf.shape))\n"
        "    return P(None, *entries[1:])\n",
        "    return P()\n",
        ["tests/test_owned.py", "-k", "stacked_leaf_returns"],
    ),
    "owned_index_in_device_order": (  # not by path: reshard mismatches
        "owned.py",
        "    for _, k, row in sorted(entries):\n",
        "    for _, k, row in entries:\n",
        ["tests/test_owned.py", "-k", "largest_matrix_is_the_last"],
    ),
    "owned_stacked_split_regardless": (  # 3 layers split over data=2
        "owned.py",
        "    return n > 1 and shape[0] % n == 0\n",
        "    return n > 1\n",
        ["tests/test_owned.py", "-k", "does_not_divide"],
    ),
    "owned_layer_axis_false_accepted": (  # False == 0
        "owned.py",
        "    if layer_axis not in (None, 0) or isinstance(layer_axis, bool):",
        "    if layer_axis not in (None, 0):",
        ["tests/test_owned.py", "-k", "bad_input"],
    ),
    "owned_init_off_a_mesh": (  # owned.init on params on no mesh
        "shard_update.py",
        "    if at is None or not _on_mesh(params, axis_name):\n",
        "    if at is None:\n",
        ["tests/test_owned.py", "-k", "on_no_mesh"],
    ),
    "owned_reshard_blames_another_follower": (  # a stacked leaf's move
        "reshard.py",
        '    if not changed:\n        return " (another follower',
        '    if changed:\n        return " (another follower',
        ["tests/test_owned.py", "-k", "split_on_one_mesh"],
    ),
    # ------------------------------- the reducers, one mode at a time
    "mapped_agree_is_local": (  # one device's flag, not every device's
        "reducer.py",
        "        return sharding.agree(flag, self.axis_name)",
        "        return flag",
        ["tests/test_reducer.py", "-k", "agree"],
    ),
    "scatter_unplaced_leaf_not_summed": (  # a bias of odd size
        "reducer.py",
        "        return lax.psum(c, rest) if rest else c\n\n"
        "    return sharding.local_map(body, mesh=mesh, in_specs=spec, "
        "out_specs=target)",
        "        return c\n\n"
        "    return sharding.local_map(body, mesh=mesh, in_specs=spec, "
        "out_specs=target)",
        ["tests/test_reducer.py", "-k", "explicit_reduce"],
    ),
    "device_sq_counts_every_copy": (  # a replicated leaf's copies
        "reducer.py",
        "for axis in sorted(copies):  # a replicated copy counts once",
        "for axis in ():  # a replicated copy counts once",
        ["tests/test_reducer.py", "-k", "squared_norm"],
    ),
    "local_map_reads_the_context_mesh": (  # jit with no jax.set_mesh
        "sharding.py",
        "    context = mesh or jax.sharding.get_abstract_mesh()\n",
        "    context = jax.sharding.get_abstract_mesh()\n",
        ["tests/test_reducer.py", "-k", "without_set_mesh"],
    ),
    # ----------------------------- the gate's inner workings (gating.py)
    "mesh_less_reducer_takes_unreduced_gradients": (  # the check skipped
        "reducer.py",
        "                return Reducer()  # unreduced over a mesh axis",
        "                return _LOCAL  # unreduced over a mesh axis",
        ["tests/test_mesh.py", "-k", "unreduced_gradients_without_axis"],
    ),
    "mesh_less_step_enters_sharding": (  # the short trip grows back
        "reducer.py",
        "        del like\n        return x if s is None else s * x\n",
        "        return sharding.times(s, x, like)\n",
        ["tests/test_gating.py", "-k", "short_trip"],
    ),
    "next_gate_loses_the_literal_passed": (  # a select on every state
        "gating.py",
        "return flags._replace(passed=None) if out.passed is True else flags",
        "return flags",
        ["tests/test_gating.py", "-k", "one_call_of_weight_0"],
    ),
    # ---------------------- optaxaccum.batchnorm's checks (batch_stats.py)
    "bn_merge_broadcasts_a_wrong_shape": (
        "batch_stats.py",
        '    _check_shapes("merge", window, count=count, mean=mean, var=var)\n',
        "",
        ["tests/test_batch_stats.py", "-k", "shape"],
    ),
    "bn_momentum_unchecked": (
        "batch_stats.py",
        "    if not np.all((value >= 0) & (value <= 1)):",
        "    if False:",
        ["tests/test_batch_stats.py", "-k", "momentum"],
    ),
    # ------------------------------- held-out mutants of hardening 5
    "scale_by_window_gain_clipped_to_1_and_linear": (  # W < B0: W / B0
        "window_scale.py",
        "r = jnp.clip(ratio, jnp.minimum(1.0, linear), "
        "jnp.maximum(1.0, linear))",
        "r = jnp.clip(ratio, 1.0, linear)",
        ["tests/test_scale_by_window.py", "-k", "lighter"],
    ),
    "scale_by_window_no_cast_back": (  # bf16 updates come out float32
        "window_scale.py",
        "lambda u: (u * jnp.asarray(scale, u.dtype)).astype(u.dtype), updates",
        "lambda u: u * scale, updates",
        ["tests/test_scale_by_window.py", "-k", "bf16"],
    ),
    "closed_on_a_dropped_call_after_a_close": (  # the window did not move
        "windows.py",
        "_moved(old, new) & (new.mini_step == 0)",
        "(new.mini_step == 0)",
        ["tests/test_batch_stats.py", "-k", "dropped_right_after"],
    ),
    "gate_flag_of_shape_1_taken": (  # bool() takes a one-element array
        "chain.py",
        "if dtype == jnp.bool_ and jnp.shape(flag) == ():",
        "if dtype == jnp.bool_:",
        ["tests/test_gating.py", "-k", "shape_1"],
    ),
    "has_updated_kept_on_a_dropped_call": (  # a loop counts a window twice
        "accumulate.py",
        "updated=jnp.zeros_like(state.updated),",
        "updated=flags.select(\n            counted, "
        "jnp.zeros_like(state.updated), state.updated\n        ),",
        ["tests/test_accumulate.py", "-k", "dropped_call_after_a_close"],
    ),
    # The micro-step at the floor: acc + g, zeroed at the close.
    "zero_not_nan_safe": (
        "accumulate.py",
        "jnp.where, finite, optax.tree.scale(0, tree), zeros)",
        "lambda f, a, z: a, finite, optax.tree.scale(0, tree), zeros)",
        ["tests/test_micro_step.py"],
    ),
    "close_keeps_the_sum": (
        "accumulate.py",
        "acc=zeroed(state.acc),",
        "acc=state.acc,",
        ["tests/test_micro_step.py"],
    ),
    "summed_gradients_weighted_again": (
        "accumulate.py",
        "if summed or (isinstance(w, float) and w == 1.0):",
        "if isinstance(w, float) and w == 1.0:",
        ["tests/test_micro_step.py"],
    ),
    "known_weight_selected": (
        "accumulate.py",
        "if weightless is not False:",
        "if True:",
        ["tests/test_micro_step.py"],
    ),
    "earlier_state_not_converted": (
        "accumulate.py",
        "    fresh = state.mini_step == 0\n\n    def zero(a):",
        "    fresh = state.mini_step < 0\n\n    def zero(a):",
        ["tests/test_micro_step.py", "-k", "earlier_version"],
    ),
    "weight_plain_float32_sum": (
        "accumulate.py",
        "return total, low + ((hi - (total - back)) + (w - back))",
        "return total, low",
        ["tests/test_every_weight.py", "-k", "2_to_the_24 or reaches_total"],
    ),
    # ------------------------------- held-out mutants of hardening 6
    "summed_gradient_at_known_weight_0_dropped": (  # item 1
        "accumulate.py",
        "        if weightless is True and not summed:\n            return a",
        "        if weightless is True:\n            return a",
        _ACC + ["-k", "known_weight_0_is_added"],
    ),
    "window_mean_without_the_low_part": (  # item 2
        "accumulate.py",
        "        weight = state.weight + state.weight_low\n",
        "        weight = state.weight\n",
        _ACC + ["-k", "divides_by_the_exact_weight"],
    ),
    "low_part_not_reset_at_a_close": (  # item 3
        "accumulate.py",
        "weight_low=jax.tree.map(jnp.zeros_like, state.weight_low),",
        "weight_low=state.weight_low,",
        _ACC + ["-k", "low_part_starts_from_zero"],
    ),
    "summed_window_of_weight_0_empty": (  # item 4: not zeroed
        "accumulate.py",
        "checked = cfg.axis_name is None and not cfg.summed_gradients",
        "checked = cfg.axis_name is None",
        _ACC + ["-k", "weight_0_zeroes_its_accumulator"],
    ),
    "from_optax_state_fresh_has_updated": (  # item 5
        "multisteps.py",
        "updated=jnp.logical_and(n == 0, gradient_step > 0),",
        "updated=n == 0,",
        ["tests/test_multisteps.py", "-k", "answers_has_updated_as_optax"],
    ),
    "multisteps_drops_acc_weight_low": (  # item 6
        "multisteps.py",
        "            acc_weight_low=acc.weight_low,\n",
        "            acc_weight_low=None,\n",
        ["tests/test_multisteps.py", "-k", "keeps_its_low_part"],
    ),
    "window_weight_call_told_unweighted": (  # item 7: a driver's ctx
        "chain.py",
        'if asks_units and window is None and "accum_weight" not in '
        "extra_args:",
        'if asks_units and "accum_weight" not in extra_args:',
        ["tests/test_gating.py", "-k", "does_not_warn_of_no_weight"],
    ),
    "held_copy_not_pinned": (  # item 8 (XLA:TPU: tests/gpu_compile/)
        "gather_once.py",
        "    return lax.optimization_barrier(\n"
        "        jax.reshard(leaf.astype(how.dtype), how.held)\n    )",
        "    return jax.reshard(leaf.astype(how.dtype), how.held)",
        ["tests/test_gather_once.py", "-k", "pinned_in_the_program"],
    ),
    "gather_once_peel_false_ignored": (  # item 9
        "microbatch.py",
        "peel=gather_once is None or gather_once.peel,",
        "peel=True,",
        ["tests/test_gather_once.py", "-k", "peel_false_runs"],
    ),
    "every_weight_budget_rounded": (  # item 11
        "every_weight.py",
        "tail = np.asarray(self.total - float(head), weight.dtype)",
        "tail = np.zeros((), weight.dtype)",
        ["tests/test_every_weight.py", "-k", "at_its_exact_value"],
    ),
    "mapped_weight_low_dropped": (  # item 12: before the psum
        "reducer.py",
        "local = hi if low is None else hi + low",
        "local = hi",
        ["tests/test_multidevice.py", "-k", "beyond_2_to_the_24"],
    ),
    "summed_window_followers_branch": (  # Adam's moments copied
        "gating.py",
        "updates, tail = flags.select_or_call(out.opened, run, skip)",
        "updates, tail = flags.cond_or_call(\n"
        "            out.opened, run, lambda: skip(jax.eval_shape(run))\n"
        "        )",
        ["tests/test_micro_step.py", "-k", "closes_in_no_tree"],
    ),
    "window_followers_branch_again": (  # a copy of Adam's moments
        "gating.py",
        "updates, tail = flags.select_or_call(out.opened, run, skip)",
        "updates, tail = flags.cond_or_call(\n"
        "            out.opened, run, lambda: skip(jax.eval_shape(run))\n"
        "        )",
        ["tests/test_micro_step.py", "-k", "closes_in_no_more"],
    ),
    "moments_not_ordered": (
        "flags.py",
        "    if moments:\n        state = jax.tree.map(",
        "    if False:\n        state = jax.tree.map(",
        ["tests/test_micro_step.py", "-k", "closes_in_no_more"],
    ),
    "moments_ordered_without_select": (
        "chain.py",
        "        moments = in_loop and selected[-1]\n",
        "        moments = in_loop\n",
        ["tests/test_micro_step.py", "-k", "two_tree_adds"],
    ),
    "window_peaks_ignored": (
        "loss_scale.py",
        "    if peaks is None:\n        peaks = numerics.peaks(updates)",
        "    if True:\n        peaks = numerics.peaks(updates)",
        ["tests/test_micro_step.py", "-k", "loss_scale_closes_in_no_tree"],
    ),
    "window_peaks_not_in_updates_dtype": (
        "accumulate.py",
        "numerics.peaks(acc, scale, out_dtypes)",
        "numerics.peaks(acc, scale)",
        ["tests/test_window_loss_scale.py", "-k", "own_dtype"],
    ),
    "window_peaks_past_an_element": (
        "chain.py",
        "        if peaks is not None and not gate_at:",
        "        if peaks is not None:",
        ["tests/test_window_loss_scale.py", "-k", "between_the_accumulate"],
    ),
    "sharded_followers_select": (
        "accumulate.py",
        "        followers_branch=cfg.shard_update,\n    )\n\n\ndef _call",
        "        followers_branch=False,\n    )\n\n\ndef _call",
        ["tests/test_owned.py", "-k", "newton_schulz_flops and data8"],
    ),
}


def copy_repository(root: pathlib.Path, dest: pathlib.Path) -> pathlib.Path:
    """Copies the repository's working tree into ``dest``.

    The files git knows of (tracked, and untracked ones it does not
    ignore), as they are on disk; outside a git checkout, the whole tree
    less the environments, builds and caches of ``_NOT_COPIED``.

    Args:
      root: the repository's root folder.
      dest: a folder that does not exist yet.

    Returns:
      ``dest``, holding the copy.

    Example::

        copy = copy_repository(ROOT, pathlib.Path(tmp, "repo"))
    """
    listed = subprocess.run(
        ["git", "ls-files", "-z", "-co", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        text=True,
    )
    if listed.returncode != 0:
        ignore = shutil.ignore_patterns(*_NOT_COPIED)
        shutil.copytree(root, dest, ignore=ignore, symlinks=True)
        return dest
    for name in filter(None, listed.stdout.split("\0")):
        source = root / name
        if source.is_file():  # a tracked file may be deleted on disk
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def apply(copy: pathlib.Path, file: str, old: str, new: str) -> bool:
    """Writes one mutant into a copy of the repository.

    Args:
      copy: the root of a copy made by :func:`copy_repository`.
      file: the mutated file, relative to the package's ``_src`` folder.
      old: the original text, which must occur exactly once.
      new: the text that replaces it.

    Returns:
      Whether the mutant was applied (``False``: ``old`` is not in the
      file exactly once, the mutant is stale).

    Example::

        applied = apply(copy, *MUTANTS["nested_tail"][:3])
    """
    path = copy / SRC / file
    text = path.read_text() if path.is_file() else ""
    if text.count(old) != 1:
        return False
    path.write_text(text.replace(old, new))
    return True


def _environment(copy: pathlib.Path) -> dict[str, str]:
    """The environment of a run in ``copy``: the copy first on the import
    path, checked by importing the package from it."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(copy), *filter(None, [env.get("PYTHONPATH")])]
    )
    where = subprocess.run(
        [sys.executable, "-c", "import optaxaccum; print(optaxaccum.__file__)"],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not pathlib.Path(where).resolve().is_relative_to(copy.resolve()):
        raise RuntimeError(f"the copy's tests would import {where}")
    return env


def run(name: str, root: pathlib.Path = ROOT) -> tuple[str, float]:
    """Applies mutant ``name`` to a copy of the repository and runs its
    tests there.

    Args:
      name: a key of :data:`MUTANTS`.
      root: the repository to copy; it is only read.

    Returns:
      The verdict (``killed``, ``killed (crash)``, ``SURVIVED`` or
      ``stale (text not found once)``) and the seconds the run took.

    Example::

        verdict, seconds = run("nested_tail")
    """
    file, old, new, tests = MUTANTS[name]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="optaxaccum-mutant-") as tmp:
        copy = copy_repository(root, pathlib.Path(tmp, "repo"))
        if not apply(copy, file, old, new):
            return "stale (text not found once)", 0.0
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-x",
                "-q",
                "-p",
                "no:xdist",
                "-p",
                "no:cacheprovider",
                *tests,
            ],
            cwd=copy,
            env=_environment(copy),
            capture_output=True,
            text=True,
            timeout=1200,
        )
    if proc.returncode == 0:
        verdict = "SURVIVED"
    else:  # by an assertion, or only by a crash (an error, an abort)?
        verdict = "killed" if _asserted(proc.stdout) else "killed (crash)"
    return verdict, time.perf_counter() - start


def _asserted(output: str) -> bool:
    """Whether pytest's output shows a failed assertion (``assert``,
    ``AssertionError``, ``pytest.raises`` not raised)."""
    for line in output.splitlines():
        text = line[1:].strip() if line.startswith("E ") else ""
        if text.startswith(("assert ", "AssertionError", "Failed: DID NOT")):
            return True
    return False


def main(names: list[str]) -> int:
    """Runs the mutants named (all when none are) and prints their table.

    Args:
      names: keys of :data:`MUTANTS`; empty for all of them.

    Returns:
      The exit status: 0 when every mutant was killed by an assertion.

    Example::

        status = main(["nested_tail"])
    """
    unknown = sorted(set(names) - set(MUTANTS))
    if unknown:
        print(f"unknown mutants: {', '.join(unknown)}", file=sys.stderr)
        return 2
    names = names or list(MUTANTS)
    print("| mutant | file | verdict | seconds |")
    print("|---|---|---|---|")
    survived = 0
    for name in names:
        verdict, seconds = run(name)
        survived += verdict != "killed"
        print(
            f"| {name} | {MUTANTS[name][0]} | {verdict} | {seconds:.0f} |",
            flush=True,
        )
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
