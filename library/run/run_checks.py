"""What a run checks before any weight loads (the trainer's validate stage; a dry run too): each
module's option combinations, in this order (an error names the first problem)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from library import accelerator
from library.distributed import ddp, deepspeed_zero, fsdp
from library.models import family, inpainting, loading, placement
from library.outputs import metadata, tracking
from library.training import block_swap, flow_loss, network_options, nonfinite, partial_text_cache
from library.training.compile_unet import check_options as check_compile
from library.training.losses import check_options as check_loss_options
from library.training.methods import make_method
from library.training.optim import check_optimizer, check_scheduler
from library.training.stepper import check_stepper_options

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options


def resolve_options(opts: Options, method_name: str):
    """The options as the run holds them, with what the model decides before loading: an unset
    network_module means the family's LoRA (flow_loss.with_family_network)."""
    return flow_loss.with_family_network(opts, method_name)


def check_before_loading(opts: Options, method_name: str, plan) -> None:
    """Checks that need imports but no weights: optimizer, scheduler, network module, and the
    combinations of every module's options."""
    fam = flow_loss.check_options(opts, method_name)  # FLUX.1 / SD3 options, or none with an SD model
    check_optimizer(opts.optimizer_type, opts.optimizer_args, probe=True,
                    learning_rate=opts.learning_rate)
    check_scheduler(opts, warmup_steps=plan.warmup_steps,
                    total_steps=plan.total_steps)  # lr_scheduler and the lr_* options
    check_stepper_options(opts)  # fused_backward_pass / fused_optimizer_groups combinations
    fsdp.check_options(opts)  # fsdp combinations; Accelerate-FSDP launch configs
    deepspeed_zero.check_options(opts)  # deepspeed combinations and optimizer

    ddp.check_options(opts, plan.processes)  # ddp_comm_hook, ddp_static_graph combinations
    check_loss_options(opts)  # noise / loss variant combinations
    tracking.check_options(opts)  # logging_dir / log_with, validation and sample options
    network_options.check_options(opts)  # dim_from_weights, base_weights, scale_weight_norms
    placement.check_options(opts, fam)  # fp8_base / fp8_base_unet need mixed precision
    block_swap.check_options(opts, plan.processes)  # blocks_to_swap, cpu_offload_checkpointing
    inpainting.check_options(opts)  # train_inpainting vs latent caching, samples, validation
    metadata.check_options(opts)  # metadata_thumbnail exists

    check_compile(opts)  # torch_compile / dynamo_backend combinations
    family.check_token_padding(opts, loading.configured_family)  # no_token_padding
    nonfinite.check_options(opts)  # on_nonfinite; network_weights / base_weights finite
    accelerator.accelerator_precision(opts)  # fp16 needs CUDA (after the combinations naming it)
    method = make_method(method_name, opts, None)  # e.g. nothing to train: fail before loading weights
    partial_text_cache.check_options(opts, method_name, fam, method)  # the text-encoder cache and trained encoders
