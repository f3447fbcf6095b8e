"""optax's own ``MultiSteps`` test cases, run against ``oa.MultiSteps``.

Ported from ``optax/transforms/_accumulation_test.py`` (optax 0.2.8,
Apache-2.0, Copyright 2019 DeepMind Technologies Limited): every
``test_multi_steps*`` case, with ``_accumulation.MultiSteps`` replaced by
``oa.MultiSteps`` and optax's private module paths by the public ones. The
assertions are optax's, unchanged.
"""

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import parameterized

import optaxaccum as oa

OPTIMIZERS_TO_TEST = [
    {"opt_name": "adam", "opt_kwargs": {"learning_rate": 0.1}},
    {
        "opt_name": "adam",
        "opt_kwargs": {"learning_rate": 0.1, "mu_dtype": jnp.float32},
    },
]


class Loss(flax.linen.Module):
    @flax.linen.compact
    def __call__(self, x, dtype=jnp.float32, param_dtype=jnp.float32):
        return jnp.sum(
            flax.linen.Dense(10, dtype=dtype, param_dtype=param_dtype)(x) ** 2
        )


class MultiStepsOptaxCasesTest(parameterized.TestCase):
    def test_multi_steps(self):
        batch_size = 32
        x_size = 7
        # Parameters should be updated only every `k_steps` optimization steps.
        k_steps = 4
        data = jnp.ones([batch_size, x_size])
        loss = Loss()

        params = loss.init({"params": jax.random.key(0)}, data)["params"]

        def loss_apply(params, data):
            return loss.apply({"params": params}, data)

        ms_opt = oa.MultiSteps(
            # Use a non-trivial inner optimizer:
            # * it has a state,
            # * it requires the params for the update.
            optax.chain(
                optax.scale_by_adam(),
                optax.add_decayed_weights(1e-2),
                optax.scale(-1e-4),
            ),
            k_steps,
        )

        opt_init, opt_update = ms_opt.gradient_transformation()

        # Put the training in one function, to check that the update is
        # indeed jittable.
        def train_step(data, opt_state, params):
            grad = jax.grad(loss_apply)(params, data)
            updates, opt_state = opt_update(grad, opt_state, params)
            return updates, opt_state

        opt_state = opt_init(params)

        prev_loss = loss_apply(params, data)
        for idx in range(5 * k_steps):
            updates, opt_state = jax.jit(train_step)(data, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            new_loss = loss_apply(new_params, data)
            if idx % k_steps < k_steps - 1:
                # The parameters should not have changed and the loss should
                # be constant.
                jax.tree.map(np.testing.assert_array_equal, new_params, params)
                np.testing.assert_equal(new_loss, prev_loss)
                self.assertFalse(ms_opt.has_updated(opt_state))
            else:
                # This is a step where parameters should actually have been
                # updated, and the loss should accordingly go down.
                np.testing.assert_array_less(new_loss, prev_loss)
                prev_loss = new_loss
                self.assertTrue(ms_opt.has_updated(opt_state))
            params = new_params

    def test_multi_steps_every_k_schedule(self):
        # Test a non-trivial schedule which varies over time.
        ms_opt = oa.MultiSteps(
            optax.sgd(1e-4), lambda grad_step: jnp.where(grad_step < 2, 1, 3)
        )
        opt_init, opt_update = ms_opt.gradient_transformation()
        params = {"a": jnp.zeros([])}
        opt_state = opt_init(params)
        grad = {"a": jnp.zeros([])}
        self.assertFalse(ms_opt.has_updated(opt_state))
        # First two steps have 1 mini-step per update.
        for _ in range(2):
            _, opt_state = opt_update(grad, opt_state, params)
            self.assertTrue(ms_opt.has_updated(opt_state))
        # Subsequently, mini-steps should have 3 mini-steps per update.
        for _ in range(5):
            for _ in range(2):
                _, opt_state = opt_update(grad, opt_state, params)
                self.assertFalse(ms_opt.has_updated(opt_state))
            _, opt_state = opt_update(grad, opt_state, params)
            self.assertTrue(ms_opt.has_updated(opt_state))

    def test_multi_steps_scan_dtype_stability(self):
        # Testing if accumulator dtype stays the same under jax.lax.scan
        # It is important that the dtype is not promoted in the accumulator
        ms_opt = oa.MultiSteps(
            optax.sgd(1e-4), 2, accumulator_dtype=jnp.float32
        )
        opt_init, opt_update = ms_opt.gradient_transformation()
        params = {"a": jnp.zeros([], dtype=jnp.bfloat16)}

        # We use bfloat16 to test if gradients of bfloat16 promote the states
        # to bfloat16 or similar.
        def train_step(state, _):
            grad = {"a": jnp.ones([], dtype=jnp.bfloat16)}
            updates, opt_state = opt_update(grad, state, params)
            return opt_state, updates

        opt_state = opt_init(params)
        # This map should succeed without raising dtype errors in lax.scan
        # if dtype is stable.
        final_state, _ = jax.lax.scan(train_step, opt_state, jnp.arange(4))
        # Also ensure actual dtype of accumulator is float32
        self.assertEqual(final_state.acc_grads["a"].dtype, jnp.float32)

    def test_multi_steps_zero_nans(self):
        # Test that MultiStep is compatible with zero_nans
        # https://github.com/google-deepmind/optax/issues/828
        ms_opt = oa.MultiSteps(
            optax.chain(optax.zero_nans(), optax.sgd(1e-4)),
            every_k_schedule=2,
        )
        opt_init, opt_update = ms_opt.gradient_transformation()
        params = {"a": jnp.zeros([])}
        opt_state = opt_init(params)
        grad = {"a": jnp.zeros([])}
        opt_update(grad, opt_state, params)

    def test_multi_steps_computes_mean(self):
        k_steps = 4
        ms_opt = oa.MultiSteps(optax.scale(1.0), k_steps, use_grad_mean=True)
        opt_init, opt_update = ms_opt.gradient_transformation()
        params = {"a": jnp.zeros([])}
        opt_state = opt_init(params)
        grads = [{"a": jnp.ones([]) * i} for i in [1, 2, 3, 4]]
        self.assertFalse(ms_opt.has_updated(opt_state))

        # First 3 steps don't update.
        for grad in grads[:-1]:
            _, opt_state = opt_update(grad, opt_state, params)
            self.assertFalse(ms_opt.has_updated(opt_state))

        # Actual update.
        new_params, opt_state = opt_update(grads[-1], opt_state, params)
        self.assertTrue(ms_opt.has_updated(opt_state))
        np.testing.assert_array_equal(new_params["a"], 2.5)

    def test_multi_steps_skip_not_finite(self):
        k_steps = 2
        ms_opt = oa.MultiSteps(
            optax.sgd(1.0),
            k_steps,
            should_skip_update_fn=optax.skip_not_finite,
        )
        opt_init, opt_update = ms_opt.gradient_transformation()
        opt_init = jax.jit(opt_init)
        opt_update = jax.jit(opt_update)
        params = {"a": jnp.zeros([])}
        opt_state = opt_init(params)

        with self.subTest("test_good_updates"):
            updates, opt_state = opt_update(
                {"a": jnp.ones([])}, opt_state, params
            )
            self.assertEqual(int(opt_state.mini_step), 1)
            params = optax.apply_updates(params, updates)
            updates, opt_state = opt_update(
                {"a": jnp.ones([])}, opt_state, params
            )
            self.assertEqual(int(opt_state.mini_step), 0)
            params = optax.apply_updates(params, updates)
            np.testing.assert_array_equal(
                params["a"], jnp.negative(jnp.ones([]))
            )

        with self.subTest("test_inf_updates"):
            updates, opt_state = opt_update(
                {"a": jnp.array(float("inf"))}, opt_state, params
            )
            # No increase in mini_step
            self.assertEqual(int(opt_state.mini_step), 0)
            params = optax.apply_updates(params, updates)
            np.testing.assert_array_equal(
                params["a"], jnp.negative(jnp.ones([]))
            )

        with self.subTest("test_nan_updates"):
            updates, opt_state = opt_update(
                {"a": jnp.full([], float("nan"))}, opt_state, params
            )
            # No increase in mini_step
            self.assertEqual(int(opt_state.mini_step), 0)
            params = optax.apply_updates(params, updates)
            np.testing.assert_array_equal(
                params["a"], jnp.negative(jnp.ones([]))
            )

        with self.subTest("test_final_good_updates"):
            updates, opt_state = opt_update(
                {"a": jnp.ones([])}, opt_state, params
            )
            self.assertEqual(int(opt_state.mini_step), 1)
            params = optax.apply_updates(params, updates)
            updates, opt_state = opt_update(
                {"a": jnp.ones([])}, opt_state, params
            )
            self.assertEqual(int(opt_state.mini_step), 0)
            params = optax.apply_updates(params, updates)
            np.testing.assert_array_equal(
                params["a"], jnp.negative(jnp.full([], 2.0))
            )

    @parameterized.parameters(OPTIMIZERS_TO_TEST)
    def test_multi_steps_mixed_precision(self, opt_name, opt_kwargs):
        batch_size = 32
        x_size = 7
        k_steps = 4
        data = jnp.ones([batch_size, x_size])
        loss = Loss()

        def loss_apply(params, data):
            return loss.apply({"params": params}, data)

        # Compare optimizer dtypes with and without MultiSteps
        def create_optimizer(k_steps):
            base_opt = getattr(optax, opt_name)(**opt_kwargs)
            ms_opt = oa.MultiSteps(base_opt, k_steps)
            return base_opt, ms_opt

        opt, ms_opt = create_optimizer(k_steps)
        ms_opt_init, ms_opt_update = ms_opt.gradient_transformation()

        # General train step
        def train_step(data, opt_state, params, opt_update_fn, upd_dtype):
            grad = jax.grad(loss_apply)(params, data)
            grad = jax.tree.map(
                lambda x: x.astype(upd_dtype), grad
            )  # mimic varying dtype
            updates, opt_state = opt_update_fn(grad, opt_state, params)
            return updates, opt_state

        # Utility for dtype comparison
        def compare_dtypes(tree1, tree2):
            return jax.tree.all(
                jax.tree.map(lambda x, y: x.dtype == y.dtype, tree1, tree2)
            )

        # Iterate over parameter and update dtypes
        dtypes = [jnp.float32, jnp.float16, jnp.bfloat16]
        for upd_dtype in dtypes:
            for param_dtype in dtypes:
                data = data.astype(param_dtype)
                with self.subTest(
                    f"upd_dtype={upd_dtype.__name__}-"
                    f"param_dtype={param_dtype.__name__}"
                ):
                    # Initialize parameters with current combination of dtypes
                    params = loss.init(
                        {"params": jax.random.key(0)},
                        data,
                        param_dtype=param_dtype,
                    )["params"]
                    opt_state = opt.init(params)
                    ms_opt_state = ms_opt_init(params)

                    for _ in range(k_steps + 1):
                        updates, opt_state = train_step(
                            data, opt_state, params, opt.update, upd_dtype
                        )
                        ms_updates, ms_opt_state = train_step(
                            data,
                            ms_opt_state,
                            params,
                            ms_opt_update,
                            upd_dtype,
                        )
                        get_dtypes = lambda tree: jax.tree.map(  # noqa: E731
                            lambda x: x.dtype, tree
                        )
                        self.assertTrue(
                            compare_dtypes(updates, ms_updates),
                            "Underlying optimizer and MultiSteps updates "
                            "dtype must match. Got "
                            f"({get_dtypes(updates)}) vs "
                            f"({get_dtypes(ms_updates)}).",
                        )
                        new_params = optax.apply_updates(params, ms_updates)
                        self.assertTrue(
                            compare_dtypes(params, new_params),
                            "Updates parameters dtypes must match. Got "
                            f"({get_dtypes(params)}) vs "
                            f"({get_dtypes(new_params)}).",
                        )
                        params = new_params
