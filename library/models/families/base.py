"""What a model family declares: the ``Family`` record each family's folder registers, and its
flow-matching part ``FlowSpec``. No torch import: the option checks, the UI server and ``--help``
read the registry before any model code loads (docs/FAMILIES.md).

Every field is required (no defaults), so a new family states each capability and cannot inherit
another family's schedule, sampler or refusals by omission; tests/models/test_families.py walks the
registry and checks each one. Shared code asks these capabilities (``family.flow``,
``family.size_conditioning``, ...), never the family's name.
"""
from __future__ import annotations

from dataclasses import dataclass

# FlowSpec.training_draw: how a training sample's noise level is drawn (library/training/flow_matching.py)
#   TIMESTEP_SAMPLING  sd-scripts' FLUX.1 rule: timestep_sampling (sigma / uniform / sigmoid / shift /
#                      flux_shift); "sigma" indexes the discrete_flow_shift-shifted 1000-step table;
#                      model_prediction_type is read
#   SHIFTED_BOUNDED    sd-scripts' SD3 rule: weighting_scheme's density, training_shift, then an integer
#                      timestep in [min_timestep, max_timestep); always the sigma-scaled prediction
TIMESTEP_SAMPLING = "timestep_sampling"
SHIFTED_BOUNDED = "shifted_bounded"
TRAINING_DRAWS = (TIMESTEP_SAMPLING, SHIFTED_BOUNDED)
# FlowSpec.sample_schedule: the sample images' noise levels (library/training/flow_matching.py)
#   SEQUENCE_SHIFT  FLUX.1's: time_shift by the packed image sequence length (flux_schedule)
#   FIXED_SHIFT     SD3's: a fixed shift (sample_shift) of the 1000-step table (sd3_schedule)
#   LINEAR_SHIFT    Anima's: linspace(1, 0) shifted by sample_shift (linear_shift_schedule)
SEQUENCE_SHIFT = "sequence_shift"
FIXED_SHIFT = "fixed_shift"
LINEAR_SHIFT = "linear_shift"
SAMPLE_SCHEDULES = (SEQUENCE_SHIFT, FIXED_SHIFT, LINEAR_SHIFT)
SHIFTED_SCHEDULES = (FIXED_SHIFT, LINEAR_SHIFT)  # the schedules that read sample_shift
# What a home module (``Family.home``) provides, each a module-level function (docs/FAMILIES.md):
#   claims(path) -> bool                   an existing file / folder is one of its kind (keys,
#                                          configs; no weights read)
#   load(opts) -> ModelBundle              the run's model (library/models/loading.py's record)
#   family_model(bundle, opts, rewrite)    its FamilyModel (library/models/family.py)
#   save_full(bundle, path, dtype, metadata, trained_encoders)   a full fine-tune's save
#   metadata_fields(variant, adapter)      ss_base_model_version, modelspec.architecture /
#                                          implementation (/ prediction_type) of its files
#   memory_parts(opts, header) -> dict     the memory estimate's components on fake tensors
#   memory_family_model(opts, comps, text_encoders), memory_conditioning(opts, comps, batch, dtype),
#   memory_text_tokens(opts, comps), memory_text_entry_bytes(opts, comps, dtype_bytes, partial)
#                                          one micro-step's forward and a text-cache entry's size
# and the constant BUILTIN_NAMES: the built-in names it builds (its tiny_models and arch_models)
HOOKS = ("claims", "load", "family_model", "save_full", "metadata_fields", "memory_parts", "memory_family_model",
         "memory_conditioning", "memory_text_tokens", "memory_text_entry_bytes")
# and, where a family has them:
#   check_sources(opts)                    its own checks of its parts before any weight loads
#                                          (headers, kernels), one line each
#   param_groups(unet, opts)               a full fine-tune's optimizer groups and their names,
#                                          by the family's own rates (Anima's per-part rates)
OPTIONAL_HOOKS = ("check_sources", "param_groups")


@dataclass(frozen=True)
class FlowSpec:
    """A rectified-flow family's training and sampling rules (sd-scripts' values)."""

    timestep_scale: float       # the model's timestep input per unit of sigma (FLUX.1: 1, SD3: 1000)
    training_draw: str          # one of TRAINING_DRAWS
    input_perturbation: bool    # ip_noise_gamma perturbs the noisy input (sd-scripts: FLUX.1 only)
    sample_schedule: str        # one of SAMPLE_SCHEDULES
    sample_shift: float | None  # FIXED_SHIFT's / LINEAR_SHIFT's shift (None otherwise)
    sample_steps: int           # a sample prompt's defaults (sd-scripts' prompt-line defaults)
    sample_scale: float
    sample_guidance: float | None  # the distilled guidance input's default (None: the model has none)
    size_multiple: int          # sample sizes round down to this (FLUX.1: 8x VAE then 2x2 patches)
    packed_noise: bool          # sample noise drawn in the 2x2-packed layout (sd-scripts' FLUX.1)
    t5_component: str           # the T5-XXL's component name (memory estimate, partial cache)
    metadata_options: tuple[str, ...]  # recorded as ss_<option> (sd-scripts' update_metadata)
    weights_raw_loss: bool      # weighting_scheme also weights the raw velocity loss (sd-scripts'
                                # Anima trainer); FLUX.1's weights only the sigma-scaled prediction
    option_defaults: tuple[tuple[str, object], ...]  # flow options whose default differs for this
                                # family ((name, value); sd-scripts' per-script defaults): an unset
                                # option (or one the family refuses) takes this value
    # CFG shaping of its samples (sd-scripts' Lumina 2 sampler; None: plain CFG at every step):
    # guidance only while 1 - sigma < sample_cfg_trunc_ratio, then the guided velocity's norm
    # capped at sample_renorm_cfg x the conditional one's (0: no cap); a prompt's --ctr / --rcfg
    sample_cfg_trunc_ratio: float | None
    sample_renorm_cfg: float | None


@dataclass(frozen=True)
class Family:
    """One model family: everything shared code may ask about it."""

    name: str                   # the bundle's ``family`` key ("sd1", "flux", ...)
    title: str                  # how messages name it ("SD1", "FLUX.1", ...)
    flow: FlowSpec | None       # rectified flow (None: the DDPM schedule, epsilon / v)
    text_encoder_components: tuple[str, ...]  # diffusers component names, in the bundle's order
    text_encoder_names: tuple[str, ...]       # how messages name them, same order
    partial_cache: bool         # a text-encoder cache may hold the frozen encoders' part (T5) while
                                # the others train (sd-scripts' is_partial)
    size_conditioning: bool     # the forward takes pooled text and SDXL's size conditioning
    pipelines: tuple[str, str, str] | None  # diffusers text-to-image / inpaint / img2img pipeline classes of its
                                       # samples (None: the flow sampler)
    v2_metadata: bool           # ss_v2 = True
    block_lr: bool              # sdxl_train.py's block_lr (23 U-Net blocks)
    token_padding_option: bool  # no_token_padding applies (train_db.py: SD1/SD2)
    rate_implies_text_encoder: bool   # train_db.py: a text-encoder rate (or stop step) trains it
    full_trains_text_encoders: bool   # train_text_encoder works for DreamBooth / fine-tune
    separate_t5_rate: bool      # T5-XXL trains only with train_t5xxl, at learning_rate_te3
    saves_text_encoders: bool   # a full save writes the trained text encoders beside the backbone
    autoencoder_option: str     # the option naming a separate autoencoder file ("vae"; FLUX.1: "ae")
    single_file_parts: tuple[str, ...]  # options a single-file backbone needs beside it (FLUX.1's
                                        # BFL transformer: clip_l, t5xxl, ae)
    linear_projections: bool    # its original single-file layout holds Linear attention projections
                                # (SD2, SDXL; SD1: 1x1 convolutions): a conversion to it flattens them
    lora_module: str            # the network_module an unset one means (train_lora)
    network_modules: tuple[str, ...]  # the network modules that can target it (LyCORIS aside)
    model_type: str | None      # sd-scripts' --model_type value that names it (flux_train_network.py:
                                # "flux", "chroma"); None: the option does not apply
    gui_boxes: tuple[str, ...]  # the kohya_ss GUI keys whose ticked box selects it (none: its
                                # default SD model type)
    gui_rank: int               # with several boxes ticked, the GUI's train_model runs the lowest rank's
                                # script (kohya_gui run_cmd order: sdxl 0, sd3 1, flux 2, anima 4, lumina 5)
    gui_script: str             # the sd-scripts script the GUI's fine-tune / DreamBooth tab runs
    gui_te_rates: tuple[str, ...]  # the GUI's text-encoder rate fields that script reads
    gui_db_text_encoder: bool   # the DreamBooth tab writes train_text_encoder (from the rates)
    unsupported: dict           # option -> why it is refused with this family (before loading)
    no_effect: dict             # option -> why it is accepted with a "no effect" warning
    native_size: int            # the side of its training images, gen_img's default size
    tiny_models: tuple[str, ...]  # built-in tiny models (pretrained_model_name_or_path)
    arch_models: tuple[str, ...]  # built-in full-size models with random weights (memory checks)
    home: str                   # the module of its hooks (HOOKS: detection, loading, family model,
                                # save, metadata, memory fakes), imported when a run needs it (the
                                # SD families': their home.py over sd_common/hooks.py)
    sd_scripts: tuple[str, ...] = ()  # sd-scripts' family-specific entry scripts that train it
                                # (sdxl_train_network.py, flux_train.py, ...; those at the root
                                # here refuse a model of another family: library/models/script_family.py)
