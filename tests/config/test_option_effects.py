"""Every option of the schema changes what it should: one row per option in library/config/options.py
OPTIONS. A row either asserts here that setting the option changes the object it reaches (the
schedule's curve, the optimizer's hyperparameters, the step plan, the training set's captions, the
built network, the saved metadata, the accelerator's settings, the saves a rotation keeps), or
names the existing test that asserts its effect (checked to exist). A new option without a row
fails ``test_every_option_has_a_row``. None of the direct rows trains."""
from __future__ import annotations

import ast
import os
import types

import pytest
import torch

from library.config.options import OPTIONS
from library.config.parse import parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _opts(dataset, script="train_lora", *argv):
    return parse_args(script, ["--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir",
                               dataset, "--resolution", "64", "--max_train_steps", "8",
                               "--dry_run", *[str(a) for a in argv]])


# -- consumers: what an option reaches, built from parsed options -------------------------------

def curve(opts, steps=8):
    """The learning rates of ``steps`` optimizer steps of the run's scheduler."""
    from library.training.stepper import build_run_scheduler

    from library.training.optim import steps_of

    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=opts.learning_rate)
    sched = build_run_scheduler(opts, opt, warmup_steps=steps_of(opts.lr_warmup_steps, steps),
                                total_steps=steps)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def optimizer(opts):
    """(class name, hyperparameters of the first group) of the run's optimizer over one tensor."""
    from library.training.optim import build_optimizer

    opt = build_optimizer(opts.optimizer_type, opts.optimizer_args, [{"params": [
        torch.nn.Parameter(torch.zeros(4, 4))]}], opts.learning_rate)
    return type(opt).__name__, {k: v for k, v in opt.param_groups[0].items() if k != "params"}


def plan(opts):
    from library.training.plan import plan_run

    _, _, p = plan_run(opts, 1)
    return (p.global_batch, p.steps_per_epoch, p.epochs, p.total_steps)


def captions(opts):
    """The training set's processed captions of every sample in epochs 1 and 2."""
    from library.training.plan import plan_run

    _, tset, _ = plan_run(opts, 1)
    return [tset.caption(i, e) for e in (1, 2) for i in range(len(tset.train_items))]


def metadata(opts):
    from library.outputs import metadata as md
    from library.training.plan import plan_run

    opts, tset, p = plan_run(opts, 1)
    return md.build_metadata(opts=opts, model=md.ModelKind("sd1", False, "lora"),
                             num_train_images=p.repeats_total, num_reg_images=0,
                             train_items=tset.train_items, started_at=0.0, network_info={})


_BUNDLE = {}


def network(opts):
    """(per module: kind, rank, scale, multiplier, dropouts) and the learning rate of each
    optimizer group, of the network the method builds on tiny-sd15."""
    from library.training.methods import NetworkMethod
    from library.models.loading import load_from_options

    if "b" not in _BUNDLE:
        _BUNDLE["b"] = load_from_options(opts)
    bundle = _BUNDLE["b"]
    method = NetworkMethod(opts, bundle)
    torch.manual_seed(0)
    groups = method.setup()
    net = method.network
    try:
        mods = [(m.lora_name.split("_")[1], m.lora_dim, m.scale, m.multiplier, m.dropout,
                 m.rank_dropout, m.module_dropout) for m in net.text_encoder_loras + net.unet_loras]
        return mods, [g.get("lr") for g in groups]
    finally:
        net.remove_from() if hasattr(net, "remove_from") else None


def accelerator_timeout(opts, monkeypatch):
    from library import accelerator as distributed

    seen = {}
    monkeypatch.setattr(distributed, "make_accelerator",
                        lambda precision, timeout_s=None: seen.setdefault("timeout", timeout_s))
    distributed.accelerator_for(opts)
    return seen["timeout"]


def deepspeed_check(opts):
    """The DeepSpeed option check's verdict (None: accepted)."""
    from library.distributed import deepspeed_zero as zero

    try:
        zero.check_options(opts)
    except Exception as e:  # noqa: BLE001 - the verdict is the message
        return str(e)
    return None


def rotation(opts, tmp_path, *, epoch=None, step=None):
    """The saves and states that remain after the run's rotation at this epoch or step, from
    saves 1..epoch (every epoch) or every 2 steps up to step."""
    from library.outputs import checkpoints
    from library.files import output_file
    from library.outputs.train_state import state_dir

    out = str(tmp_path / f"rot-{len(os.listdir(tmp_path))}")
    os.makedirs(out)
    opts = opts.replace(output_dir=out)
    marks = [{"epoch": e} for e in range(1, epoch + 1)] if epoch else \
        [{"step": s} for s in range(2, step + 1, 2)]
    for m in marks:
        open(output_file(out, opts.output_name, ".safetensors", **m), "w").close()
        os.makedirs(state_dir(out, opts.output_name, **m))
    method = types.SimpleNamespace(extension=lambda: ".safetensors", companion_files=lambda p: [])
    checkpoints._rotate(opts, method, False, epoch=epoch, step=step)
    return sorted(os.listdir(out))


# -- the table ---------------------------------------------------------------------------------
# name -> (consumer, arguments of the base, arguments that set the option), or the test that
# asserts the option's effect ("tests/file.py::test_name").
S = ["--lr_scheduler"]
DIRECT = {
    "lr_scheduler": (curve, [], S + ["linear"]),
    "lr_warmup_steps": (curve, S + ["constant_with_warmup"], ["--lr_warmup_steps", "3"]),
    "lr_decay_steps": (curve, S + ["warmup_stable_decay", "--lr_warmup_steps", "1"],
                       ["--lr_decay_steps", "4"]),
    "lr_scheduler_num_cycles": (curve, S + ["cosine_with_restarts"],
                                ["--lr_scheduler_num_cycles", "3"]),
    "lr_scheduler_power": (curve, S + ["polynomial"], ["--lr_scheduler_power", "2"]),
    "lr_scheduler_min_lr_ratio": (curve, S + ["cosine_with_min_lr", "--lr_scheduler_min_lr_ratio",
                                              "0.1"], ["--lr_scheduler_min_lr_ratio", "0.5"]),
    "lr_scheduler_timescale": (curve, S + ["inverse_sqrt", "--lr_warmup_steps", "1"],
                               ["--lr_scheduler_timescale", "2"]),
    "lr_scheduler_type": (curve, [], ["--lr_scheduler_type", "torch.optim.lr_scheduler.StepLR",
                                      "--lr_scheduler_args", "step_size=2", "gamma=0.5"]),
    "lr_scheduler_args": (curve, S + ["piecewise_constant", "--lr_scheduler_args",
                                      "step_rules=1:2,0.5"],
                          ["--lr_scheduler_args", "step_rules=1:4,0.25"]),
    "learning_rate": (optimizer, [], ["--learning_rate", "3e-4"]),
    "optimizer_type": (optimizer, [], ["--optimizer_type", "Lion"]),
    "optimizer_args": (optimizer, [], ["--optimizer_args", "weight_decay=0.3"]),
    "train_batch_size": (plan, [], ["--train_batch_size", "2"]),
    "max_train_steps": (plan, [], ["--max_train_steps", "3"]),
    "max_train_epochs": (plan, [], ["--max_train_epochs", "3"]),
    "gradient_accumulation_steps": (plan, [], ["--gradient_accumulation_steps", "2"]),
    "caption_prefix": (captions, [], ["--caption_prefix", "photo of"]),
    "caption_suffix": (captions, [], ["--caption_suffix", "best quality"]),
    "caption_extension": (captions, [], ["--caption_extension", ".txt"]),
    "shuffle_caption": (captions, [], ["--shuffle_caption", "--caption_separator", " "]),
    "keep_tokens": (captions, ["--shuffle_caption", "--caption_separator", " "],
                    ["--keep_tokens", "3"]),
    "caption_dropout_rate": (captions, [], ["--caption_dropout_rate", "0.9"]),
    "caption_tag_dropout_rate": (captions, [], ["--caption_tag_dropout_rate", "0.9"]),
    "output_name": (metadata, [], ["--output_name", "mine"]),
    "training_comment": (metadata, [], ["--training_comment", "hello"]),
    "network_dim": (network, [], ["--network_dim", "3"]),
    "network_alpha": (network, [], ["--network_alpha", "2"]),
    "network_multiplier": (network, [], ["--network_multiplier", "0.5"]),
    "network_dropout": (network, [], ["--network_dropout", "0.2"]),
    "network_args": (network, [], ["--network_args", "rank_dropout=0.1", "module_dropout=0.1"]),
    "network_train_unet_only": (network, [], ["--network_train_unet_only"]),
    "network_train_text_encoder_only": (network, [], ["--network_train_text_encoder_only"]),
    "unet_lr": (network, [], ["--unet_lr", "5e-3"]),
    "text_encoder_lr": (network, [], ["--text_encoder_lr", "5e-5"]),
    "ddp_timeout": (accelerator_timeout, [], ["--ddp_timeout", "7"]),
    "offload_param_device": (deepspeed_check, ["--deepspeed"], ["--offload_param_device", "cpu"]),
    "save_last_n_epochs": ("rotate-epoch", ["--save_every_n_epochs", "1"],
                           ["--save_last_n_epochs", "2"]),
    "save_last_n_epochs_state": ("rotate-epoch", ["--save_every_n_epochs", "1", "--save_state"],
                                 ["--save_last_n_epochs_state", "1"]),
    "save_last_n_steps": ("rotate-step", ["--save_every_n_steps", "2"],
                          ["--save_last_n_steps", "3"]),
    "save_last_n_steps_state": ("rotate-step", ["--save_every_n_steps", "2", "--save_state"],
                                ["--save_last_n_steps_state", "3"]),
}
for _key in ("title", "author", "description", "license", "tags", "usage_hint", "thumbnail",
             "merged_from", "trigger_phrase", "preprocessor", "is_negative_embedding"):
    DIRECT[f"metadata_{_key}"] = (metadata, [], [f"--metadata_{_key}", "x"])
DIRECT["metadata_thumbnail"] = (metadata, [], ["--metadata_thumbnail", "{dataset}/2_sks shape/shape_00.png"])

T = "tests/"
REFERENCE = {
    "config": T + "config/test_config.py::test_cli_beats_toml_and_given_records_both",
    "timestep_sampling": T + "training/test_flux_train.py::test_flux_loss_options_change_the_loss",
    "sigmoid_scale": T + "training/test_flux_train.py::test_flux_loss_options_change_the_loss",
    "discrete_flow_shift": T + "training/test_flux_train.py::test_flux_loss_options_change_the_loss",
    "model_prediction_type": T + "training/test_flux_train.py::test_flux_loss_options_change_the_loss",
    "weighting_scheme": T + "training/test_flux_train.py::test_flux_loss_options_change_the_loss",
    "logit_mean": T + "training/test_flux_train.py::test_flux_loss_options_change_the_loss",
    "logit_std": T + "training/test_flux_train.py::test_flux_loss_options_change_the_loss",
    "mode_scale": T + "training/test_flux_train.py::test_flux_loss_options_change_the_loss",
    "guidance_scale": T + "training/test_flux_train.py::test_flux_text_and_guidance_options_change_the_prediction",
    "t5xxl_max_token_length": T + "training/test_flux_train.py::test_flux_text_and_guidance_options_change_the_prediction",
    "apply_t5_attn_mask": T + "training/test_flux_train.py::test_flux_text_and_guidance_options_change_the_prediction",
    "clip_l": T + "training/test_flux_train.py::test_flux_trains_from_single_files",
    "t5xxl": T + "training/test_flux_train.py::test_flux_trains_from_single_files",
    "qwen3": T + "training/test_anima_lora.py::test_anima_trains_from_files_and_its_text_lengths_matter",
    "llm_adapter_path": T + "training/test_anima_lora.py::test_anima_trains_from_files_and_its_text_lengths_matter",
    "t5_tokenizer_path": T + "training/test_anima_lora.py::test_anima_trains_from_files_and_its_text_lengths_matter",
    "qwen3_max_token_length": T + "training/test_anima_lora.py::test_anima_trains_from_files_and_its_text_lengths_matter",
    "t5_max_token_length": T + "training/test_anima_lora.py::test_anima_trains_from_files_and_its_text_lengths_matter",
    "attn_mode": T + "training/test_anima_train.py::test_memory_options_reach_the_model_and_keep_the_loss",
    "split_attn": T + "training/test_anima_train.py::test_memory_options_reach_the_model_and_keep_the_loss",
    "vae_chunk_size": T + "training/test_anima_train.py::test_memory_options_reach_the_model_and_keep_the_loss",
    "vae_disable_cache": T + "training/test_anima_train.py::test_memory_options_reach_the_model_and_keep_the_loss",
    "unsloth_offload_checkpointing": T + "training/test_block_swap.py::"
                                         "test_anima_unsloth_offload_same_weights_only_hidden_state_on_host",
    **{name: T + "training/test_anima_train.py::test_two_sgd_steps_are_plain_sgd_per_part"
       for name in ("llm_adapter_lr", "self_attn_lr", "cross_attn_lr", "mlp_lr", "mod_lr")},
    "model_type": T + "config/test_sd_scripts_flow_options.py::test_model_type_names_the_family_the_weights_must_be",
    "ae": T + "training/test_flux_train.py::test_flux_trains_from_single_files",
    "clip_g": T + "training/test_flux_train.py::test_flux_unsupported_options_fail_before_loading",  # refused for FLUX
    "training_shift": T + "training/test_sd3_train.py::test_sd3_options_change_the_loss_or_the_encoding",
    "apply_lg_attn_mask": T + "training/test_sd3_train.py::test_sd3_options_change_the_loss_or_the_encoding",
    # sd-scripts' --model_type: checked against the weights' family before loading
    "model_type": T + "config/test_sd_scripts_flow_options.py::test_model_type_names_the_family_the_weights_must_be",
    # Lumina 2
    "gemma2": T + "models/test_lumina_loading.py::test_single_file_with_gemma2_and_ae",
    "gemma2_max_token_length": T + "training/test_lumina_train.py::test_text_options_change_the_encoding",
    "system_prompt": T + "training/test_lumina_train.py::test_text_options_change_the_encoding",
    "sample_batch_size": T + "training/test_lumina_sampling.py::test_sample_batch_size_groups_like_prompts_and_keeps_each_images_seed",
    "use_flash_attn": T + "models/test_lumina.py::test_attention_options_refused_without_the_kernel",
    "use_sage_attn": T + "models/test_lumina.py::test_attention_options_refused_without_the_kernel",
    # SD3's text-encoder dropout (flow-te)
    "clip_l_dropout_rate": T + "training/test_sd3_train.py::test_sd3_text_encoder_dropout_against_a_seeded_hand_computation",
    "clip_g_dropout_rate": T + "training/test_sd3_train.py::test_sd3_every_encoder_dropped_trains_on_zero_text",
    "t5_dropout_rate": T + "training/test_sd3_train.py::test_sd3_text_encoder_dropout_against_a_seeded_hand_computation",
    # SD3.5's position embedding and FLUX.1's deprecated block-swap names (sd3-posemb)
    "pos_emb_random_crop_rate": T + "training/test_sd3_train.py::test_sd3_position_options_first_loss_against_hand_computation",
    "enable_scaled_pos_embed": T + "training/test_sd3_train.py::test_sd3_position_options_first_loss_against_hand_computation",
    "split_mode": T + "config/test_kohya_gui.py::test_flux_deprecated_block_swap_keys",
    "double_blocks_to_swap": T + "config/test_kohya_gui.py::test_flux_deprecated_block_swap_keys",
    "single_blocks_to_swap": T + "config/test_kohya_gui.py::test_flux_deprecated_block_swap_keys",
    # sd-scripts' FLUX.1 / SD3 option audit (optaudit)
    "num_last_block_to_freeze": T + "training/test_flow_sd_scripts_options.py::"
                                    "test_num_last_block_to_freeze_freezes_the_last_x_block_tensors",
    "text_encoder_batch_size": T + "training/test_flow_text_cache.py::test_text_encoder_batch_size_sets_the_caching_batches",
    "train_t5xxl": T + "training/test_sd3_text_encoder_train.py::"
                       "test_first_step_updates_each_encoder_at_its_rate_and_the_file_holds_them",
    "learning_rate_te3": T + "training/test_sd3_text_encoder_train.py::"
                             "test_first_step_updates_each_encoder_at_its_rate_and_the_file_holds_them",
    "use_t5xxl_cache_only": T + "training/test_partial_text_cache.py::"
                                "test_use_t5xxl_cache_only_implies_a_partial_cache_even_with_frozen_clip",
    "dataset_config": T + "config/test_config.py::test_separate_dataset_config_file_and_not_both",
    "dry_run": T + "config/test_bad_input.py::test_dry_run_imports_no_model_code",
    "pretrained_model_name_or_path": T + "training/test_train_lora_e2e.py::test_tiny_overfit_lowers_the_loss",
    "v2": T + "models/test_models.py::test_v_parameterization_flag_and_v2_check",
    "v_parameterization": T + "models/test_models.py::test_v_parameterization_flag_and_v2_check",
    "vae": T + "models/test_models.py::test_vae_override",
    "no_half_vae": T + "models/test_precision_e2e.py::test_no_half_vae_keeps_the_vae_and_its_latents_in_float32",
    "clip_skip": T + "data/test_text_cache_clip_skip.py::"
                     "test_cached_encodings_with_clip_skip_2_are_keyed_and_equal_an_uncached_encode",
    "max_token_length": T + "data/test_long_prompts.py::test_text_cache_key_depends_on_max_token_length",
    "no_token_padding": T + "data/test_no_token_padding.py::test_train_dreambooth_two_steps_unet_sees_the_unpadded_context",
    "weighted_captions": T + "data/test_weighted_captions.py::test_train_lora_weighted_cached_equals_uncached",
    "tokenizer_path": T + "models/test_models.py::test_missing_tokenizer_names_the_option",
    "allow_pickle": T + "models/test_models.py::test_pickled_ckpt_needs_allow_pickle",
    "sdpa": T + "training/test_train_lora_e2e.py::test_plain_attention_matches_sdpa",
    "xformers": T + "config/test_kohya_gui.py::test_xformers_without_the_package_falls_back_to_sdpa",
    "train_data_dir": T + "data/test_data.py::test_folder_convention_repeats_class_tokens_and_captions",
    "reg_data_dir": T + "training/test_train_dreambooth_e2e.py::test_reg_images_with_prior_loss_weight",
    "num_class_images": T + "training/test_class_images.py::test_made_once_reused_equal_to_gen_img",
    "class_image_steps": T + "training/test_class_images.py::test_key_names_every_setting",
    "class_image_scale": T + "training/test_class_images.py::test_key_names_every_setting",
    "class_image_sampler": T + "training/test_class_images.py::test_key_names_every_setting",
    "in_json": T + "training/test_finetune_e2e.py::test_finetune_in_json_equals_the_same_data_as_folders",
    "dataset_repeats": T + "training/test_finetune_e2e.py::test_finetune_in_json_equals_the_same_data_as_folders",
    "resolution": T + "config/test_config.py::test_resolution_shapes",
    "cache_latents": T + "training/test_train_lora_e2e.py::test_uncached_loading_with_workers_matches_cached",
    "cache_latents_to_disk": T + "data/test_disk_cache.py::test_tool_fills_the_cache_and_training_then_encodes_nothing",
    "cache_dir": T + "data/test_disk_cache.py::test_cache_dir_and_flip_variants",
    "cache_text_encoder_outputs": T + "data/test_text_cache_clip_skip.py::"
                                      "test_cached_encodings_with_clip_skip_2_are_keyed_and_equal_an_uncached_encode",
    "cache_text_encoder_outputs_to_disk": T + "data/test_disk_cache.py::test_text_encoder_cache_with_shuffle_and_dropout",
    "text_encoder_cache_variants": T + "data/test_disk_cache.py::test_text_encoder_cache_with_shuffle_and_dropout",
    "flip_aug": T + "config/test_dataset_config.py::test_caption_and_flip_augmentation_is_keyed_to_seed_epoch_and_sample",
    "random_crop": T + "data/test_images.py::test_random_crop_is_keyed_to_the_generator",
    "color_aug": T + "data/test_color_aug.py::test_train_lora_two_steps_with_color_aug",
    "alpha_mask": T + "training/test_masked_loss.py::test_alpha_mask_reaches_the_loss_cached_and_uncached",
    "conditioning_data_dir": T + "training/test_masked_loss.py::test_conditioning_data_dir_masks_reach_the_loss",
    "caption_separator": T + "config/test_dataset_config.py::test_process_caption_rules",
    "keep_tokens_separator": T + "config/test_dataset_config.py::test_process_caption_rules",
    "enable_wildcard": T + "data/test_caption_options.py::test_wildcards_and_warmup_are_keyed_to_seed_epoch_and_sample",
    "token_warmup_min": T + "data/test_caption_options.py::test_token_warmup_formula",
    "token_warmup_step": T + "data/test_caption_options.py::test_token_warmup_formula",
    "secondary_separator": T + "data/test_caption_options.py::test_secondary_separator",
    "debug_dataset": T + "data/test_debug_dataset.py::test_debug_dataset_writes_a_contact_sheet_and_exits",
    "train_inpainting": T + "training/test_inpainting_e2e.py::test_unet_input_is_latents_mask_and_masked_image_latents",
    "prompts_file": T + "training/test_leco.py::test_leco_target_and_loss_match_a_hand_computation",
    "max_denoising_steps": T + "training/test_leco.py::test_partial_denoising_follows_the_guidance_and_the_step_count",
    "leco_denoise_guidance_scale": T + "training/test_leco.py::test_partial_denoising_follows_the_guidance_and_the_step_count",
    "caption_dropout_every_n_epochs": T + "config/test_dataset_config.py::test_process_caption_rules",
    "enable_bucket": T + "data/test_buckets.py::test_gui_resolution_rules_as_sd_scripts",
    "min_bucket_reso": T + "config/test_config.py::test_bucket_rules",
    "max_bucket_reso": T + "config/test_config.py::test_bucket_rules",
    "bucket_reso_steps": T + "data/test_buckets.py::test_bucket_steps_below_the_latent_grid_round_up",
    "bucket_no_upscale": T + "data/test_data.py::test_small_images_are_upscaled_or_skipped_and_skips_are_counted",
    "vae_batch_size": T + "data/test_disk_cache.py::test_two_processes_split_the_caching_work",
    "torch_compile": T + "training/test_compile.py::test_the_options_reach_the_compile_of_the_training_unet",
    "dynamo_backend": T + "training/test_compile.py::test_the_options_reach_the_compile_of_the_training_unet",
    "persistent_data_loader_workers": T + "training/test_loader_workers.py::"
                                          "test_two_persistent_workers_train_the_same_weights_as_none",
    "max_data_loader_n_workers": T + "training/test_train_lora_e2e.py::test_uncached_loading_with_workers_matches_cached",
    "network_module": T + "training/test_train_lora_e2e.py::test_lycoris_loha_trains_and_saves",
    "network_weights": T + "training/test_train_lora_e2e.py::test_network_weights_continue_from_a_file",
    "dim_from_weights": T + "training/test_network_options.py::test_dim_from_weights_takes_ranks_and_alphas_from_the_file",
    "scale_weight_norms": T + "training/test_network_options.py::test_scale_weight_norms_trains_bounded",
    "base_weights": T + "training/test_network_options.py::test_base_weights_are_merged_before_training",
    "base_weights_multiplier": T + "training/test_network_options.py::test_base_weights_are_merged_before_training",
    "learning_rate_te1": T + "training/test_train_dreambooth_e2e.py::test_sdxl_learning_rate_te1_te2",
    "learning_rate_te2": T + "training/test_train_dreambooth_e2e.py::test_sdxl_learning_rate_te1_te2",
    "block_lr": T + "training/test_network_options.py::test_block_lr_groups_sdxl_unet_by_block",
    "max_grad_norm": T + "training/test_fused.py::test_per_parameter_clipping",
    "fused_backward_pass": T + "training/test_fused.py::test_fused_backward_pass_equals_plain",
    "fused_optimizer_groups": T + "training/test_fused.py::test_optimizer_groups_equal_plain",
    "fused_reductions_in_flight": T + "training/test_fused_async.py::"
                                      "test_sums_overlap_the_backward_within_the_bounds",
    "highvram": T + "training/test_frozen.py::test_full_finetune_releases_and_writes_the_same_model_samples_and_validation",
    "gradient_checkpointing": T + "models/test_precision_e2e.py::test_gradient_checkpointing_does_not_change_the_math",
    "mixed_precision": T + "models/test_precision_e2e.py::test_bf16_mixed_precision_trains_and_saves_a_lora",
    "full_bf16": T + "models/test_full_precision.py::test_full_bf16_lora_trains_and_saves",
    "full_fp16": T + "models/test_full_precision.py::test_full_fp16_dreambooth_trains_and_saves_on_cpu",
    "fp8_base": T + "models/test_fp8.py::test_lora_trains_on_an_fp8_base_close_to_a_bf16_base",
    "fp8_base_unet": T + "models/test_fp8.py::test_fp8_base_unet_keeps_the_text_encoders_in_bf16",
    "blocks_to_swap": T + "training/test_block_swap.py::test_flux_finetune_with_block_swap_equals_without",
    "cpu_offload_checkpointing": T + "training/test_block_swap.py::test_flux_finetune_with_block_swap_equals_without",
    "blockwise_fused_optimizers": T + "training/test_block_swap.py::test_flux_blockwise_fused_optimizers_equal_one_optimizer",
    "fsdp": T + "distributed/test_fsdp.py::test_two_processes_are_one_gloo_job",
    "ddp_gradient_as_bucket_view": T + "distributed/test_ddp.py::"
                                       "test_static_graph_bucket_view_and_bucket_size_reach_ddp",
    "ddp_static_graph": T + "distributed/test_ddp.py::"
                            "test_static_graph_bucket_view_and_bucket_size_reach_ddp",
    "ddp_bucket_cap_mb": T + "distributed/test_ddp.py::"
                             "test_static_graph_bucket_view_and_bucket_size_reach_ddp",
    "ddp_comm_hook": T + "distributed/test_ddp.py::test_bf16_compression_trains_within_tolerance",
    "deepspeed": T + "distributed/test_deepspeed.py::test_config_file_from_the_options",
    "zero_stage": T + "distributed/test_deepspeed.py::test_config_file_from_the_options",
    "offload_optimizer_device": T + "distributed/test_deepspeed.py::test_accepted_options_reach_loading",
    "deepspeed_config_file": T + "distributed/test_deepspeed.py::test_deepspeed_config_file",
    "seed": T + "training/test_equivalence.py::test_other_seed_differs",
    "train_text_encoder": T + "training/test_train_dreambooth_e2e.py::test_train_text_encoder_trains_every_text_encoder",
    "stop_text_encoder_training": T + "training/test_train_dreambooth_e2e.py::test_stop_text_encoder_training",
    "ema_decay": T + "training/test_ema.py::test_lora_ema_file_is_the_decay_formula",
    "ema_device": T + "training/test_ema.py::test_lora_ema_file_is_the_decay_formula",
    "prior_loss_weight": T + "training/test_train_dreambooth_e2e.py::test_reg_sample_loss_is_weighted_by_prior_loss_weight",
    "on_nonfinite": T + "training/test_faults_nonfinite.py::test_skip_drops_the_update_and_the_schedule_steps",
    "noise_offset": T + "training/test_losses.py::test_noise_offset",
    "noise_offset_random_strength": T + "training/test_losses.py::test_noise_offset",
    "adaptive_noise_scale": T + "training/test_losses.py::test_noise_offset_adaptive_clamp_removes_the_offset",
    "multires_noise_iterations": T + "training/test_losses.py::test_multires_noise",
    "multires_noise_discount": T + "training/test_losses.py::test_multires_noise",
    "ip_noise_gamma": T + "training/test_losses.py::test_ip_noise_gamma",
    "ip_noise_gamma_random_strength": T + "training/test_losses.py::test_ip_noise_gamma",
    "zero_terminal_snr": T + "training/test_losses.py::test_zero_terminal_snr_schedule",
    "min_timestep": T + "training/test_losses.py::test_timestep_range",
    "max_timestep": T + "training/test_losses.py::test_timestep_range",
    "loss_type": T + "training/test_losses.py::test_loss_types",
    "huber_schedule": T + "training/test_losses.py::test_huber_schedules_end_points",
    "huber_c": T + "training/test_losses.py::test_huber_schedules_end_points",
    "huber_scale": T + "training/test_losses.py::test_huber_schedules_end_points",
    "min_snr_gamma": T + "training/test_losses.py::test_lora_trains_and_saves_with_variants",
    "scale_v_pred_loss_like_noise_pred": T + "training/test_losses.py::test_lora_trains_and_saves_with_variants",
    "v_pred_like_loss": T + "training/test_losses.py::test_model_dependent_combinations_accepted",
    "debiased_estimation_loss": T + "training/test_losses.py::test_lora_trains_and_saves_with_variants",
    "masked_loss": T + "training/test_masked_loss.py::test_masked_loss_matches_a_reference_computation",
    "output_dir": T + "training/test_train_lora_e2e.py::test_epoch_and_step_saves_use_sd_scripts_names",
    "save_model_as": T + "training/test_train_dreambooth_e2e.py::test_save_model_as_other_formats_loads_back",
    "save_precision": T + "training/test_train_dreambooth_e2e.py::test_save_precision_fp16",
    "save_every_n_epochs": T + "training/test_train_lora_e2e.py::test_epoch_and_step_saves_use_sd_scripts_names",
    "save_every_n_steps": T + "training/test_train_lora_e2e.py::test_epoch_and_step_saves_use_sd_scripts_names",
    "save_state": T + "outputs/test_resume.py",
    "save_state_on_train_end": T + "training/test_optimizers.py::test_adafactor_schedule_survives_resume",
    "resume": T + "training/test_fused.py::test_fused_resume_continues_exactly",
    "logging_dir": T + "outputs/test_tracking.py::test_tensorboard_holds_loss_and_lr_scalars",
    "log_with": T + "outputs/test_wandb.py::test_wandb_logs_the_tensorboard_tags",
    "log_tracker_name": T + "outputs/test_wandb.py::test_wandb_logs_the_tensorboard_tags",
    "log_tracker_config": T + "outputs/test_wandb.py::test_wandb_without_logging_dir_and_tracker_config",
    "wandb_run_name": T + "outputs/test_wandb.py::test_wandb_logs_the_tensorboard_tags",
    "wandb_api_key": T + "outputs/test_wandb.py::test_wandb_logs_the_tensorboard_tags",
    "huggingface_repo_id": T + "outputs/test_hub.py::test_a_run_uploads_each_save_and_state_after_it_and_resumes_from_the_hub",
    "huggingface_path_in_repo": T + "outputs/test_hub.py::test_a_run_uploads_each_save_and_state_after_it_and_resumes_from_the_hub",
    "huggingface_token": T + "outputs/test_hub.py::test_the_default_client_is_huggingface_hubs_with_the_token",
    "huggingface_repo_type": T + "outputs/test_hub.py::test_visibility_and_repo_type_as_sd_scripts",
    "huggingface_repo_visibility": T + "outputs/test_hub.py::test_visibility_and_repo_type_as_sd_scripts",
    "save_state_to_huggingface": T + "outputs/test_hub.py::test_a_run_uploads_each_save_and_state_after_it_and_resumes_from_the_hub",
    "resume_from_huggingface": T + "outputs/test_hub.py::test_a_run_uploads_each_save_and_state_after_it_and_resumes_from_the_hub",
    "async_upload": T + "outputs/test_hub.py::test_async_upload_does_not_hold_the_steps_and_rotation_waits_for_it",
    "log_prefix": T + "outputs/test_tracking.py::test_tensorboard_holds_loss_and_lr_scalars",
    "validation_split": T + "training/test_validation.py::test_split_is_keyed_by_seed_and_path",
    "validation_seed": T + "training/test_validation.py::test_split_is_keyed_by_seed_and_path",
    "validate_every_n_steps": T + "training/test_validation.py::test_one_and_two_processes_give_the_same_validation_loss",
    "validate_every_n_epochs": T + "training/test_validation.py::test_lora_validation_is_reproducible_and_leaves_training_untouched",
    "sample_prompts": T + "training/test_sampling.py::test_samples_are_deterministic_show_the_lora_and_leave_training_untouched",
    "sample_every_n_steps": T + "data/test_long_prompts.py::test_train_lora_with_long_captions",
    "sample_every_n_epochs": T + "outputs/test_tracking.py::test_tensorboard_holds_loss_and_lr_scalars",
    "sample_at_first": T + "training/test_sampling.py::test_samples_are_deterministic_show_the_lora_and_leave_training_untouched",
    "sample_sampler": T + "training/test_sampling.py::test_prompt_files",
    "progress_file": T + "outputs/test_progress_stream.py::test_stream_and_control_on_a_three_step_run",
    "control_file": T + "outputs/test_progress_stream.py::test_stream_and_control_on_a_three_step_run",
    "token_string": T + "training/test_textual_inversion.py::"
                        "test_sd15_embedding_loads_in_diffusers_frozen_parts_identical_loss_falls_resume_exact",
    "init_word": T + "training/test_textual_inversion.py::"
                     "test_sd15_embedding_loads_in_diffusers_frozen_parts_identical_loss_falls_resume_exact",
    "num_vectors_per_token": T + "training/test_textual_inversion.py::"
                                 "test_sd15_embedding_loads_in_diffusers_frozen_parts_identical_loss_falls_resume_exact",
    "weights": T + "training/test_textual_inversion.py::"
                   "test_weights_file_starts_the_rows_and_templates_replace_the_captions",
    "use_object_template": T + "training/test_textual_inversion.py::"
                               "test_weights_file_starts_the_rows_and_templates_replace_the_captions",
    "use_style_template": T + "training/test_textual_inversion.py::"
                              "test_weights_file_starts_the_rows_and_templates_replace_the_captions",
    "pivotal_tokens": T + "training/test_textual_inversion.py::"
                          "test_pivotal_tuning_bundles_embeddings_a1111_layout_and_loads_in_diffusers",
    "pivotal_init_words": T + "training/test_textual_inversion.py::"
                              "test_pivotal_tuning_bundles_embeddings_a1111_layout_and_loads_in_diffusers",
    "pivotal_num_vectors": T + "training/test_textual_inversion.py::"
                               "test_pivotal_tuning_bundles_embeddings_a1111_layout_and_loads_in_diffusers",
    "pivotal_learning_rate": T + "training/test_textual_inversion.py::"
                                 "test_pivotal_tuning_bundles_embeddings_a1111_layout_and_loads_in_diffusers",
    "stop_pivotal_training": T + "training/test_textual_inversion.py::"
                                 "test_pivotal_tuning_bundles_embeddings_a1111_layout_and_loads_in_diffusers",
}
# Options whose only effect is their absence (none today): name -> why.
NO_EFFECT: dict = {}


def test_every_option_has_a_row():
    names = {o.name for o in OPTIONS}
    rows = set(DIRECT) | set(REFERENCE) | set(NO_EFFECT)
    assert not set(DIRECT) & set(REFERENCE), "an option has two rows"
    assert names - rows == set(), "options without a row in tests/config/test_option_effects.py"
    assert rows - names == set(), "rows for options that are not in the schema"


def _test_functions(path: str) -> set:
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_referenced_test_exists(name):
    path, _, func = REFERENCE[name].partition("::")
    assert os.path.isfile(os.path.join(ROOT, path)), REFERENCE[name]
    if func:
        assert func in _test_functions(path), REFERENCE[name]
        # the named test sets the option (or names it), so it can observe its effect
        src = open(os.path.join(ROOT, path)).read()
        tree = ast.parse(src)
        body = next(ast.get_source_segment(src, n) for n in tree.body
                    if isinstance(n, ast.FunctionDef) and n.name == func)
        assert name in body or name in src, REFERENCE[name]


@pytest.mark.parametrize("name", sorted(DIRECT))
def test_option_changes_what_it_reaches(name, dataset, tmp_path, monkeypatch):
    consumer, base, change = DIRECT[name]
    assert f"--{name}" in change
    change = [c.replace("{dataset}", dataset) for c in change]
    a, b = _opts(dataset, "train_lora", *base), _opts(dataset, "train_lora", *base, *change)
    if consumer == "rotate-epoch":
        got = rotation(a, tmp_path, epoch=4), rotation(b, tmp_path, epoch=4)
    elif consumer == "rotate-step":
        got = rotation(a, tmp_path, step=10), rotation(b, tmp_path, step=10)
    elif consumer is accelerator_timeout:
        got = consumer(a, monkeypatch), consumer(b, monkeypatch)
    else:
        got = consumer(a), consumer(b)
    assert got[0] != got[1], f"{name}: {change} did not change {getattr(consumer, '__name__', consumer)}"
