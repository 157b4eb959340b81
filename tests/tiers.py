"""Which tier each test runs in: ``make test`` and ``make test-heavy`` (the oldest JAX), ``make test-newest`` (the newest).

``make ci`` (what ``.ci/run`` runs) runs the three, so every test runs in CI at least once:

* ``make test`` runs every test but the ``heavy`` ones, on the oldest JAX the project supports;
* ``make test-heavy`` runs the ``heavy`` tests, on the oldest JAX too (the newest compiles the same tests in
  about twice the CPU time: tests/test_blockwise.py 58 s wall / 98 s CPU on jax 0.10.2, 111 s / 192 s on 0.12.1);
* ``make test-newest`` runs the tests of the :data:`NEWEST` files but their heavy ones, on the newest JAX.

A test is ``heavy`` when it is marked so (training to a verdict, the differential fuzz, sharded training) or
named in :data:`SLOW`. ``tests/conftest.py`` applies both sets at collection; ``tests/test_tiers.py`` checks that
they name tests that exist.
"""

from __future__ import annotations

#: The files ``make test-newest`` runs on the newest JAX: those that exercise the JAX APIs that change most
#: between releases (transformations of custom rules, lowering, Pallas, XLA's flags and CPU compiler, Flax,
#: orbax, shard_map). The whole suite passed on jax 0.12.1 on 2026-12-07 (1,104 + 41 tests, clean clone).
NEWEST = {
    "test_transforms.py",
    "test_higher_order.py",
    "test_fused_cpu.py",
    "test_gpu_kernel.py",
    "test_mosaic_gpu.py",  # interpreted from jax 0.12 on (skipped before)
    "test_lowering.py",
    "test_pallas.py",
    "test_xla_flags.py",
    "test_compat.py",
    "test_flax.py",
    "test_cli.py",  # orbax checkpoints, the training CLI
    "test_shard_map.py",  # tests/multidevice: shard_map's API
    "test_transforms_sharded.py",
    "test_sharded_train.py",  # tests/multidevice: orbax across meshes (its training runs are heavy)
    "test_paged.py",  # paged attention: both paths, custom_jvp's refusal, jit of traced tables
    "test_paged_pallas.py",  # the paged Pallas kernel: interpret mode, lowering for CUDA
    "test_paged_mosaic.py",  # the paged Mosaic GPU kernel: interpreted from jax 0.12 on (skipped before)
}

#: Tests of 9 s or more of one xdist worker (``python -m tests.durations`` after ``make test``, 2-core AMD EPYC
#: Zen 4 with other work beside it, 2026-12-07): run by ``make test-heavy``, so that ``make test`` stays within
#: 15 minutes. Their node ids without ``tests/``. Not the docs' examples (75 s): they run on both, as users run
#: them on either.
SLOW = {
    "test_paged_invariance.py::test_every_arrival_gives_the_training_forwards_bits[causal-0]",  # 34 s
    "test_paged_invariance.py::test_every_arrival_gives_the_training_forwards_bits[causal-1]",  # 16 s
    "test_paged_invariance.py::test_every_arrival_gives_the_training_forwards_bits[causal-2]",  # 22 s
    "test_paged_invariance.py::test_every_arrival_gives_the_training_forwards_bits[window-0]",  # 20 s
    "test_paged_invariance.py::test_every_arrival_gives_the_training_forwards_bits[window-1]",  # 13 s
    "test_paged_invariance.py::test_every_arrival_gives_the_training_forwards_bits[window-2]",  # 15 s
    "test_paged_invariance.py::test_every_arrival_gives_the_training_forwards_bits[causal & window-0]",  # 42 s
    "test_paged_invariance.py::test_every_arrival_gives_the_training_forwards_bits[causal & window-1]",  # 24 s
    "test_paged_invariance.py::test_every_arrival_gives_the_training_forwards_bits[causal & window-2]",  # 34 s
    "test_log_linear.py::TestLogLinearKinds::test_jit_and_vmap_equal_the_eager_call_and_a_loop[log deltanet]",  # 27 s
    "test_paged_modules.py::test_where_the_pages_are_does_not_change_a_bit",  # 21 s
    "test_log_linear.py::TestLogLinearKinds::test_jit_and_vmap_equal_the_eager_call_and_a_loop[log ssd]",  # 29 s
    "test_paged_modules.py::test_paged_steps_equal_the_contiguous_cache_and_the_full_pass",  # 56 s
    "test_gpu_kernel.py::test_second_order_with_learned_slopes_under_vmap_equals_a_loop",  # 47 s
    "test_log_linear.py::TestLogLinearKinds::test_jit_and_vmap_equal_the_eager_call_and_a_loop[log linear]",  # 35 s
    "test_gpu_kernel.py::test_second_order_through_the_dense_path",  # 30 s
    "test_transforms.py::test_cell[hessian-pallas]",  # 28 s
    "test_train.py::test_sigint_saves_a_checkpoint_and_the_same_command_resumes",  # 26 s
    "test_fused_cpu.py::test_every_vector_layer_gives_this_builds_values[avx2]",  # 21 s
    "test_fused_cpu.py::test_the_neon_layer_compiles_for_aarch64",  # 20 s
    "test_train.py::test_eval_entry_reloads_and_prints_examples",  # 19 s
    "test_gated_linear.py::TestGatedKinds::test_jit_and_vmap_equal_the_eager_call_and_a_loop[kda]",  # 17 s
    "test_transforms.py::test_cell[hessian-modules]",  # 16 s
    "test_transforms.py::test_cell[hessian-xla]",  # 16 s
    "test_train.py::test_resume_is_bit_identical",  # 15 s
    "test_train.py::test_tiny_sort_run_beats_chance_and_writes_its_run_directory",  # 15 s
    "test_transforms.py::test_cell[hessian-blockwise]",  # 15 s
    "test_transforms.py::test_cell[hessian-dense]",  # 15 s
    "test_gated_linear.py::TestGatedKinds::test_gradients_equal_the_float64_reference[kda]",  # 11 s
    "test_fused_cpu.py::test_every_vector_layer_gives_this_builds_values[scalar]",  # 11 s
    "test_gpu_kernel.py::test_second_order_with_a_batched_mask_inside_and_outside_vmap_is_dense",  # 10 s
    "test_gpu_kernel.py::test_dropout_jvp_and_second_order",  # 10 s
    "test_variants.py::test_decoding_equals_the_full_causal_pass[eager-options0-mask0-cache0]",  # 10 s
    "test_lowering.py::test_second_order_keeps_the_first_order_kernels_and_no_score_matrix",  # 10 s
    "test_variants.py::test_decoding_equals_the_full_causal_pass[eager-options3-mask3-cache3]",  # 9 s
    "test_contract.py::test_low_precision_under_jit_matches_eager_and_float32",  # 9 s
    "test_paths.py::test_every_path_of_the_support_table_runs_and_returns_what_was_asked",  # 9 s
    "multidevice/test_log_linear_sharded.py::test_the_sequence_over_4_devices_equals_one_device[ssd-chunk]",  # 28 s
    "multidevice/test_ring.py::test_ring_equals_dense_forward_and_gradients[4-zigzag]",  # 27 s
    "multidevice/test_ring.py::test_ring_equals_dense_forward_and_gradients[8-zigzag]",  # 22 s
    "multidevice/test_ring.py::test_sequence_parallel_attention_pads_uneven_lengths_gqa_and_cross[zigzag]",  # 21 s
    "multidevice/test_ring.py::test_ring_equals_dense_forward_and_gradients[2-zigzag]",  # 21 s
    "multidevice/test_transforms_sharded.py::test_ring_cell_modules",  # 19 s
    "multidevice/test_transforms_sharded.py::test_ring_cell_checkpoint",  # 18 s
    "multidevice/test_gated_linear_sharded.py::test_the_sequence_over_4_devices_equals_one_device[kda-chunk]",  # 17 s
    "multidevice/test_ring.py::test_modules_with_a_sequence_axis_equal_the_plain_modules_under_a_mesh",  # 17 s
    "multidevice/test_gated_linear_sharded.py::test_the_sequence_over_4_devices_equals_one_device[gated deltanet-chunk]",  # 16 s
    "multidevice/test_gated_linear_sharded.py::test_deltaproduct_over_4_devices_equals_one_device[chunk]",  # 14 s
    "multidevice/test_log_linear_sharded.py::test_the_sequence_over_4_devices_equals_one_device[gated deltanet-chunk]",  # 14 s
    "multidevice/test_transforms_sharded.py::test_ring_jvp_and_hvp_with_sinks_softcap_and_segment_ids",  # 13 s
    "multidevice/test_gated_linear_sharded.py::test_the_low_rank_transition_over_4_devices_equals_one_device[chunk]",  # 13 s
    "multidevice/test_transforms_sharded.py::test_shard_map_cell[blockwise]",  # 12 s
    "multidevice/test_ring.py::test_ring_equals_dense_forward_and_gradients[2-contiguous]",  # 12 s
    "multidevice/test_transforms_sharded.py::test_ring_cell[grad of jvp (a loss through jvp), with and without jax.checkpoint]",  # 11 s
    "multidevice/test_ring.py::test_ring_score_mod_sinks_and_max_logit_equal_the_dense_core[zigzag]",  # 11 s
    "multidevice/test_transforms_sharded.py::test_shard_map_cell[modules]",  # 10 s
    "multidevice/test_transforms_sharded.py::test_ring_cell[grad of grad, reverse-over-reverse HVP]",  # 10 s
    "multidevice/test_ring.py::test_ring_equals_dense_forward_and_gradients[8-contiguous]",  # 10 s
    "multidevice/test_gated_linear_sharded.py::test_the_sequence_over_4_devices_equals_one_device[gated deltanet-recurrent]",  # 9 s
    "multidevice/test_log_linear_sharded.py::test_the_sequence_over_4_devices_equals_one_device[gated deltanet-recurrent]",  # 9 s
}
