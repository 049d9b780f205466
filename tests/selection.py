"""Which tests the README's test command runs, and which run after it (`.ci/run`'s second pass).

The default run (`pytest -q -n 2`) keeps at least one case of every behaviour. The rest are marked
`exhaustive` here, by test name (a function name takes all its parameter cases; `name[id]` one case),
so that a test keeps its place in the table when its file moves: the further mesh sweeps of a
behaviour a default case already checks, the real-size attention cases (marker `large`), and the
whole-process runs (servers killed and restarted, multi-process runs, the quality and training
tools) whose subject a faster default test already reaches. `pytest -m exhaustive` runs only them;
`-m "exhaustive or not exhaustive"` runs everything.
"""

from __future__ import annotations

EXHAUSTIVE = frozenset({
    # multi-process runs (one two-process equality case stays in the default run)
    "test_lost_process_ends_the_run_and_it_resumes",
    "test_two_processes_equal_one[CFG=2,U=2,R=2-4]",
    "test_ctrl_c_of_one_process",
    "test_processes_with_different_weights_are_refused",
    # serve as real processes (the in-process HTTP contract stays in the default run)
    "test_server_process_serves_concurrent_jobs_and_survives_kill_9",
    "test_two_process_server_runs_cancels_and_stops_together",
    # the measuring tools end to end
    "test_quality_default_check_passes_on_the_default_model",
    "test_quality_tiny_2x2_fp32_and_bf16",
    "test_default_model_draws_what_the_prompt_says",
    "test_default_model_draws_every_colour_and_shape_from_frame_0",  # the same 120 videos (one fixture)
    "test_tiny_i2v_continues_a_first_frame_over_65_frames",  # the 17-frame case stays
    "test_vae_training_graph_is_the_pipelines_encode_and_decode",
    "test_default_model_is_the_same_video_in_diffusers",
    "test_errors_are_the_quantizations_and_add_in_power",
    # the Wan 2.2 topology of a VAE decode or encode path whose Wan 2.1 case stays in the default run
    "test_streamed_decode_equals_decode[tiny-ti2v]",
    "test_encode_banded_equals_encode[tiny-ti2v]",
    # a causal stream's window against the reference, past the window: "global" and "window9-sink3" stay
    "test_stream_equals_self_forcing_past_its_window[window6]",
    # real-size causal forward (1.3B width, 480p token counts): minutes on 2 cores
    "test_empty_cache_slots_are_ignored_at_the_real_1_3b_480p_size",
    # further meshes of a behaviour with a default case
    "test_cfg_parallel_parity",
    "test_cli_default_size_mesh_matches_one_device",
    "test_generate_mesh_auto_and_cfg",
    "test_cfg_parallel_equals_one_device[CFG=2,U=4-True]",
    "test_mesh_invariance[R2xU4]",
    "test_parallel_decode_equals_one_device[base8-2-2-4-4]",
    "test_parallel_decode_equals_one_device[tiny-8-2-5-4]",
    "test_parallel_decode_equals_one_device[tiny-4-1-5-4]",
    "test_image_kv_once_equals_recomputing_every_step[flf2v-CFG=2,U=2,R=1]",
    "test_the_decode_runs_the_programs_compiled_ahead[U=2--0.1875-False]",
    "test_the_decode_runs_the_programs_compiled_ahead[None--0.3125-True]",
    "test_usp_kernel_every_mesh[4-2]",
    "test_usp_attention_gradient_matches_reference[2-2-pallas]",
    "test_command_resumes_an_interrupted_run",
    "test_parallel_decode_equals_one_device[tiny-2-21-5-4]",  # 21 frames; [tiny-2-1-5-4] stays
    "test_parallel_decode_parity",  # the Wan 2.2 VAE split: the split decode's default cases stay
    "test_parallel_decode_bf16",
    "test_diffusers_parity_one_device_and_mesh[flf2v]",  # i2v and a14b stay
    "test_interrupt_during_denoising_leaves_no_output",  # resume's interruptions stay
    "test_decode_compile_effort_changes_the_program_not_the_video",  # test_effort's run stays
    "test_quality_positive_control_fails",
    "test_quality_rounds_frames_as_the_pipeline_does",
    "test_a_process_failing_while_the_thread_compiles_keeps_its_exit_status",
    "test_cfg_mesh_mixes_the_unguided_expert_at_one",
    "test_kernel_path_is_differentiable[fixed_m]",  # [lse] stays
    "test_kernel_path_is_differentiable[auto]",
    "test_prompt_embeds_and_pil[U2R2]",  # [1dev] stays
    "test_the_decode_runs_the_programs_compiled_ahead[None--0.125-False]",  # the bit-for-bit run stays
    "test_sharded_matches_single_device[4-2]",
    "test_interrupted_run_resumes_to_the_same_video[2-3-U=1,R=2]",
    "test_matches_diffusers[U=2,R=2-0.5]",  # video-to-video: [U=2,R=2-0.75] stays (the CLI test runs one device)
    "test_matches_diffusers[None-0.5]",
    "test_usp_kernel_every_mesh[8-1]",  # [4-1] and [2-2] stay
    "test_cfg_parallel_equals_one_device[CFG=2,R=4-False]",  # test_cfg_parallel_collectives stays
    "test_interrupted_run_resumes_to_the_same_video[1-3-U=2,R=2]",  # [1-2-None] stays
    "test_text_kv_once_equals_recomputing_every_step[None-1.0]",  # [U=2,R=2-4.0] stays
    "test_video_mask_reference_matches_diffusers[U=2,R=2]",  # VACE: CFG=2,U=2,R=1 stays (control video)
    "test_sequence_parallel_equals_one_device[1-4-True]",  # VACE blocks: 2x2 with sharded weights stays
    # context windows: the CFG=2,W=2 case with sharded weights, the pyramid one-step blend and the
    # HLO count stay; the transformer's CFG=2,W=2 row split stays
    "test_windows_on_two_device_groups_equal_one_after_another[W=2,U=2,R=1-U=2,R=1-False]",
    "test_windows_without_overlap_are_separate_clips",
    "test_one_step_is_the_blend_of_the_windows_own_steps[flat]",
    "test_rows_split_over_windows_match_unsplit[W=2,U=2,R=1-2]",
    "test_padding_copies_count_in_no_first_block_statistic[3-windows-cfg2]",  # W=2's 3 and 4 windows stay
    "test_generate_guidance_pair_reaches_the_low_noise_expert",  # test_low_noise_expert_guides_alone stays
    "test_decode_parity[base8-2]",  # 1 and 3 frames stay
    # whole-process runs whose subject a default test reaches
    "test_every_command_prints_its_help",  # test_docs_commands runs --help of every documented command
    "test_benchmark_tiny_compare_diffusers",
    "test_command_reports_encoder_failure",  # test_video_io's encoder failures (fake ffmpeg) stay
    "test_command_writes_a_decodable_video",  # test_readme_main_job_runs runs the README command
    "test_aot_compile_denoise_step_on_cpu_mesh",
    "test_cancel_buttons_cancel_a_queued_and_a_running_job",  # the page's submit-and-play test stays
    "test_ti2v_folder_writes_its_trained_frame_rate",  # the size-grid message test stays
    "test_generate_image_first_frame_is_the_image",  # test_ti2v's generate --image stays
    # further meshes and shapes of attention checks with default cases: 1,280 tokens on U x R with
    # U R in {3, 5, 6, 7} (1, 2, 4 and 8 devices stay); the fp32 USP sweep on 2 and 4 devices (1 and
    # 8 devices and 2x2 stay); the interpret-mode Pallas twins of XLA cases; bf16 spreads 1 and 2 (4 stays)
    *(f"test_usp_1280_tokens_every_mesh[{u}-{r}]" for u, r in ((1, 3), (3, 1), (1, 5), (5, 1), (1, 6), (2, 3),
                                                                 (3, 2), (6, 1), (1, 7), (7, 1))),
    *(f"test_usp_matches_reference_fp32[{case}-{r}-{u}]" for case in ("mha", "gqa_padded")
      for r, u in ((2, 1), (1, 2), (4, 1), (1, 4), (4, 2), (2, 4))),
    "test_matches_reference_fp32[1000-1000-NK15-64-False-True-pallas]",
    "test_matches_reference_fp32[1000-1-NK12-128-True-True-pallas]",
    "test_matches_reference_fp32[1000-128-NK14-128-True-True-pallas]",
    "test_bf16_error_within_xla[1]",
    "test_bf16_error_within_xla[2]",  # spread 4 stays
})


def is_exhaustive(item) -> bool:
  """Whether a collected test runs after the default set (in the table above, or marked `large`)."""
  name = getattr(item, "originalname", None) or item.name
  return item.name in EXHAUSTIVE or name in EXHAUSTIVE or item.get_closest_marker("large") is not None
