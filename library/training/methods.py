"""What a run trains: a network (LoRA and any kohya-interface module), the model's own weights, or
the embeddings of new tokens (textual inversion).

The training loop is the same for all; a method says which parameters train, with which learning
rates, whether the text encoders need gradients, how prompts are rewritten before tokenization
(``prompt_rewrite``), how a save is written (``save``, ``companion_files``,
``saves_full_model``), its adapter network module (``network``: the kohya network a
``NetworkMethod`` builds in ``setup``, None for the others; the modules that wrap, save or
switch modes read it) and its groups' names (``group_names``, for the logged rates). Every
method declares these; nothing probes a method with ``getattr``. ``make_method`` picks the
method of an entry script.
"""
from __future__ import annotations

import importlib
import json
import logging
import os
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch

from library.config.parse import required
from library.errors import UserError
from library.files import EXTENSIONS
from library.models import flow_family, loading
from library.models.families.sd_common import embeddings
from library.models.families.sd3 import sd3
from library.models.families import registry
from library.models.placement import trained_precision
from library.training import block_lr
from library.training.network_options import MaxNormStats, base_multipliers, is_lycoris, network_module_for
from networks import lora_names
from networks.lora import load_state_dict_file, write_weights

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options

logger = logging.getLogger("sdtk")


class MethodError(UserError, ValueError):
    pass


class Method(Protocol):
    """What trains, as the trainer, the loop, the strategies, the saver and the training state
    use it (``NetworkMethod``, ``FullMethod``, ``TextualInversionMethod``)."""

    adapter: str | None          # the metadata's kind of trained file ("lora", ...; None: a model)
    saves_full_model: bool       # a save writes the whole model (VAE and text encoders too)
    network: Any                 # the kohya network module after setup() (None: no network)
    group_names: list | None     # one name per optimizer parameter group, when setup() knows them
    train_text_encoder: bool     # the text encoders need gradients (may change at a stop step)
    info: dict                   # the method's ss_* metadata, after setup()

    def setup(self) -> list[dict]: ...  # the optimizer's parameter groups

    def trainable_parameters(self) -> list: ...

    def prompt_rewrite(self) -> Callable[[str], str] | None: ...

    def set_train(self, epoch: int) -> None: ...

    def before_step(self, global_step: int) -> None: ...

    def after_step(self, device): ...  # scale_weight_norms' statistics, or None

    def extension(self) -> str: ...

    def save(self, path: str, dtype_name, metadata: dict) -> None: ...

    def companion_files(self, path: str) -> list[str]: ...


def _dtype(name):
    return {None: None, "float": torch.float32, "fp32": torch.float32, "fp16": torch.float16,
            "bf16": torch.bfloat16}[name]


class NetworkMethod:
    """Train an adapter network through the kohya network-module interface."""

    adapter = "lora"
    saves_full_model = False
    network: Any = None  # the kohya network module (any kohya-interface class), built by setup()
    group_names = None  # one name per optimizer parameter group, when setup() knows them
    network_params: list = []  # the network's trained parameters, fixed by setup()

    def __init__(self, opts: Options, bundle):
        self.opts = opts
        self.bundle = bundle
        self.train_unet = not opts.network_train_text_encoder_only
        self.train_text_encoder = not opts.network_train_unet_only
        self.pivotal = _pivotal_specs(opts)  # pivotal tuning: new tokens trained with the network
        self.tokens: embeddings.NewTokens | None = None  # installed by setup()
        self.stop_pivotal_at = opts.stop_pivotal_training
        try:
            # lycoris.kohya's algo=full trains through our module (networks/lycoris_full.py)
            name = network_module_for(opts.network_module, dict(opts.network_args or {}))
            self.module = importlib.import_module(name)
        except ImportError as e:
            raise MethodError(f"network_module: cannot import {opts.network_module!r} ({e})") from None
        for fn in ("create_network",):
            if not hasattr(self.module, fn):
                raise MethodError(f"network_module {opts.network_module} has no {fn}(); "
                                  "it must follow the kohya network interface")
        check = getattr(self.module, "check_network_args", None)
        if check is not None:  # our extension of the interface: fail before loading weights
            check(dict(opts.network_args or {}))
        # our extension too: a module whose network never puts a module on a text encoder (sd-scripts'
        # OFT) leaves them frozen whatever network_train_unet_only says
        if not getattr(self.module, "TRAINS_TEXT_ENCODERS", True):
            self.train_text_encoder = False

    def _te_arg(self):
        tes = self.bundle.text_encoders
        return tes if len(tes) > 1 else tes[0]

    def setup(self):
        opts, b = self.opts, self.bundle
        for m in [b.unet, *b.text_encoders, b.vae]:
            m.requires_grad_(False)
        kwargs = dict(opts.network_args or {})
        # lycoris.kohya names modules by walking the model it is given: on our diffusers models
        # its names are translated to the kohya names of networks.lora (SDXL U-Net in SAI layout,
        # text encoders under text_model) in every file written and read
        self.renames = None
        if is_lycoris(opts.network_module):
            self.renames = lora_names.plain_to_kohya_names(b.text_encoders, b.unet)
        try:
            if opts.dim_from_weights:  # the file's ranks and alphas, per module
                network, _ = self.module.create_network_from_weights(
                    opts.network_multiplier, opts.network_weights, b.vae, self._te_arg(), b.unet,
                    weights_sd=self._read_weights(opts.network_weights), **kwargs)
            else:
                # network_dim unset reaches the module as None, as in sd-scripts, so that the module
                # applies its own default (networks.lora 4, networks.oft_v2's block size 32)
                dim = opts.network_dim if "network_dim" in opts.given else None
                network = self.module.create_network(
                    opts.network_multiplier, dim, opts.network_alpha, b.vae,
                    self._te_arg(), b.unet, neuron_dropout=opts.network_dropout, **kwargs)
        except UserError:
            raise
        except KeyError as e:  # e.g. LyCORIS 3.x without the algo named in network_args
            raise MethodError(f"network_args for {opts.network_module}: the module has no {e} "
                              "(KeyError in create_network)") from None
        except (TypeError, ValueError) as e:
            raise MethodError(f"network_args for {opts.network_module}: {e}") from None
        if network is None:
            raise MethodError(f"network_module {opts.network_module}: create_network returned None")
        if self.train_text_encoder and not self.pivotal and getattr(network, "text_encoder_loras", None) == []:
            # no module on any text encoder (Chroma's T5 under networks.lora_flux): they stay frozen
            # and in eval mode, as with network_train_unet_only
            logger.info(f"{opts.network_module}: no module on the text encoders; they stay frozen")
            self.train_text_encoder = False
        if opts.scale_weight_norms is not None and not hasattr(network, "apply_max_norm_regularization"):
            raise MethodError(f"scale_weight_norms: the network of {opts.network_module} has no "
                              "apply_max_norm_regularization; drop scale_weight_norms")
        network.apply_to(self._te_arg(), b.unet, self.train_text_encoder, self.train_unet)
        if opts.network_weights:
            info = self._load_weights(network, opts.network_weights)
            logger.info(f"loaded network weights from {opts.network_weights}: {info}")
        if opts.gradient_checkpointing and hasattr(network, "enable_gradient_checkpointing"):
            network.enable_gradient_checkpointing()
        if hasattr(network, "prepare_grad_etc"):
            network.prepare_grad_etc(self._te_arg(), b.unet)
        self.network = network
        te_lr = opts.text_encoder_lr
        multi = getattr(network, "prepare_optimizer_params_with_multiple_te_lrs", None)
        if multi is not None:
            groups = multi(te_lr, opts.unet_lr, opts.learning_rate)
        else:
            if isinstance(te_lr, (list, tuple)):
                # sd-scripts: a network without multiple-rate support gets the first rate (the
                # kohya_ss GUI writes text_encoder_lr = [lr, lr]; LyCORIS takes one number)
                te_lr = te_lr[0] if te_lr else None
            groups = network.prepare_optimizer_params(te_lr, opts.unet_lr, opts.learning_rate)
        self.group_names = None  # the groups' descriptions, when the module gives them
        if isinstance(groups, tuple):  # current sd-scripts returns (groups, descriptions)
            groups, self.group_names = groups[0], list(groups[1])
        if self.pivotal:
            groups = list(groups) + [self._setup_pivotal()]
            if self.group_names is not None:
                self.group_names.append("embeddings")
        self.param_groups = groups
        # fixed here: a network may switch requires_grad per forward (networks.dylora trains one
        # unit of ranks per step), and the training state and the EMA keep one layout for the run
        self.network_params = [p for p in network.parameters() if p.requires_grad]
        self.info = {
            "ss_network_module": opts.network_module,
            "ss_network_dim": opts.network_dim,
            "ss_network_alpha": opts.network_alpha,
            "ss_network_dropout": opts.network_dropout,
            "ss_network_args": json.dumps({k: str(v) for k, v in kwargs.items()}),
            "ss_network_train_unet_only": opts.network_train_unet_only,
            "ss_network_train_text_encoder_only": opts.network_train_text_encoder_only,
        }
        if opts.scale_weight_norms is not None:
            self.info["ss_scale_weight_norms"] = opts.scale_weight_norms
        if self.pivotal:  # not in sd-scripts (it has no pivotal tuning)
            self.info["ss_pivotal_tokens"] = json.dumps(
                {s.token: {"init_word": s.init_word, "num_vectors": s.num_vectors} for s in self.pivotal})
            self.info["ss_pivotal_learning_rate"] = self._pivotal_lr()
            if self.stop_pivotal_at is not None:
                self.info["ss_stop_pivotal_training"] = self.stop_pivotal_at
        if opts.base_weights:
            # not in sd-scripts' metadata: the file's weights are relative to these merged files
            self.info["ss_base_weights"] = json.dumps([os.path.basename(p) for p in opts.base_weights])
            self.info["ss_base_weights_multiplier"] = json.dumps(base_multipliers(opts))
        return groups

    def _read_weights(self, path: str) -> dict:
        sd = load_state_dict_file(path)
        if self.renames:  # kohya names in the file -> the module's own names
            sd = lora_names.rename_keys(sd, {v: k for k, v in self.renames.items()})
        return sd

    def _load_weights(self, network, path: str):
        if self.renames is None:
            return network.load_weights(path)
        info = network.load_state_dict(self._read_weights(path), strict=False)
        if info.unexpected_keys:
            raise MethodError(f"network_weights {path}: {len(info.unexpected_keys)} key(s) match no "
                              f"module of this network, e.g. {info.unexpected_keys[0]}")
        return info

    def _pivotal_lr(self) -> float:
        lr = self.opts.pivotal_learning_rate
        return self.opts.learning_rate if lr is None else lr

    def _setup_pivotal(self) -> dict:
        """New tokens in the tokenizers and text encoders (library/models/families/sd_common/embeddings.py), their rows one
        more optimizer group. The text encoders then run with gradients (to reach the rows) even
        when the network trains only the U-Net: apply_to has already used the network's choice."""
        b = self.bundle
        self.tokens = embeddings.NewTokens(self.pivotal, "pivotal_tokens")
        self.tokens.install(b.tokenizers, b.text_encoders, self.opts.seed,
                            getattr(torch, trained_precision(self.opts)))
        self.network_trains_text_encoder = self.train_text_encoder
        self.train_text_encoder = True
        logger.info("pivotal tuning: new tokens " + ", ".join(
            f"{s.token} ({s.num_vectors} vector{'s' if s.num_vectors > 1 else ''})" for s in self.pivotal))
        return {"params": self.tokens.parameters(), "lr": self._pivotal_lr()}

    def trainable_parameters(self):
        params = list(self.network_params)
        # the embedding rows stay listed after stop_pivotal_training froze them: the training
        # state and the EMA keep one layout for the whole run
        return params + (self.tokens.parameters() if self.tokens is not None else [])

    def before_step(self, global_step: int) -> None:
        """stop_pivotal_training = N: the new rows freeze once N steps are done (from the step
        counter alone, so a resume past N freezes them the same way)."""
        if self.tokens is None or self.stop_pivotal_at is None or global_step < self.stop_pivotal_at:
            return
        params = self.tokens.parameters()
        if not params[0].requires_grad:
            return
        for p in params:
            p.requires_grad_(False)
            p.grad = None
        self.train_text_encoder = self.network_trains_text_encoder
        logger.info(f"stop_pivotal_training: the pivotal embeddings are frozen after step {global_step}")

    def prompt_rewrite(self):
        return embeddings.prompt_rewriter(self.pivotal) if self.pivotal else None

    def after_step(self, device):
        """After each optimizer step: scale_weight_norms' max-norm regularisation (sd-scripts
        applies it to the unwrapped network in every process, on identical weights). Returns
        (keys scaled, mean norm, max norm), or None when off; the toolkit's LoRA leaves them on
        the device until shown (network_options.MaxNormStats: no host read per step)."""
        if self.opts.scale_weight_norms is None:
            return None
        scale = getattr(self.network, "scale_max_norms", None)  # other networks: sd-scripts' API
        if callable(scale):
            return MaxNormStats(scale(self.opts.scale_weight_norms, device))
        return self.network.apply_max_norm_regularization(self.opts.scale_weight_norms, device)

    def set_train(self, epoch: int):
        self.network.train()
        if hasattr(self.network, "on_epoch_start"):
            self.network.on_epoch_start(self._te_arg(), self.bundle.unet)
        for te in self._untouched_text_encoders():
            te.eval()  # frozen and without LoRA (FLUX.1's T5 without train_t5xxl): no dropout

    def _untouched_text_encoders(self) -> list:
        """The text encoders the network puts no module on, while others train (the trainer sets
        all of them to train mode then); [] when the network does not list its modules."""
        loras = getattr(self.network, "text_encoder_loras", None)
        if not self.train_text_encoder or self.tokens is not None or loras is None:
            return []
        hooked = hooked_module_ids(loras)
        return [te for te in self.bundle.text_encoders if not any(id(m) in hooked for m in te.modules())]

    def save(self, path: str, dtype_name, metadata: dict):
        dtype = _dtype(dtype_name)
        md = metadata if path.endswith(".safetensors") else None
        if self.renames is None and self.tokens is None:
            self.network.save_weights(path, dtype, md)
            return

        sd = self.network.state_dict()
        if self.renames is not None:
            sd = lora_names.rename_keys(sd, self.renames)
        if self.tokens is not None:
            # A1111's bundled embeddings in the LoRA file, and each token as its own file
            for spec, emb_path in zip(self.pivotal, self.companion_files(path)):
                tensors = self.tokens.file_tensors(spec, self.bundle.family)
                sd.update(embeddings.bundle_keys(spec.token, tensors))
                write_embedding_file(emb_path, tensors, dtype, metadata)
        write_weights(path, sd, dtype, md)

    def companion_files(self, path: str) -> list[str]:
        """The files a save writes beside ``path``: pivotal tuning's embedding files."""
        stem, ext = os.path.splitext(path)
        return [f"{stem}_{s.token}{ext}" for s in self.pivotal]

    def extension(self):
        fmt = self.opts.save_model_as or "safetensors"
        if fmt not in EXTENSIONS:
            raise MethodError(f"save_model_as {fmt!r} is not available for a network; "
                              f"use one of {', '.join(EXTENSIONS)}")
        return EXTENSIONS[fmt]


def _db_implies_text_encoder(opts: Options) -> bool:
    """train_dreambooth without an explicit train_text_encoder, given a text-encoder learning
    rate or a stop step: sd-scripts' train_db.py would train the (SD1/SD2) text encoder."""
    if opts.script != "train_dreambooth" or "train_text_encoder" in opts.given:
        return False
    if opts.cache_text_encoder_outputs or opts.cache_text_encoder_outputs_to_disk:
        return False  # cached outputs: the text encoder cannot train (train_db.py cannot cache)
    return "text_encoder_lr" in opts.given or opts.stop_text_encoder_training is not None


def block_param_lists(model) -> list[list]:
    """``model``'s parameters by block: one list per ``<list>.<index>`` module of a ModuleList
    (FLUX.1's double_blocks.N / single_blocks.N, SD3's joint_blocks.N), one for all the others
    (first), in registration order (sd-scripts' blockwise_fused_optimizers grouping)."""
    by_key: dict = {}
    for name, p in model.named_parameters():
        head, _, rest = name.partition(".")
        index = rest.split(".", 1)[0]
        key = (head, int(index)) if index.isdigit() else ("other", -1)
        by_key.setdefault(key, []).append(p)
    other = by_key.pop(("other", -1), [])
    return ([other] if other else []) + list(by_key.values())


class FullMethod:
    """Train the U-Net (and optionally the text encoders) themselves: DreamBooth, fine-tuning.

    Learning rates: the U-Net trains at ``learning_rate``; with ``train_text_encoder`` each text
    encoder trains at ``text_encoder_lr`` (alias ``learning_rate_te``): one value for all, or one
    per text encoder (SDXL: [te1, te2]); unset = ``learning_rate``. SDXL also takes sd-scripts'
    ``learning_rate_te1`` / ``learning_rate_te2``, which override the value for that encoder. SD3
    (sd-scripts' sd3_train.py): CLIP-L and CLIP-G as SDXL's two; T5-XXL trains only with
    ``train_t5xxl``, at ``learning_rate_te3`` (else a third text_encoder_lr value, else
    learning_rate). A part whose learning rate is 0 is frozen (no gradient, not in the optimizer,
    in eval mode), as the network method does.

    ``stop_text_encoder_training = N``: the text encoders train in the first N optimizer steps
    (sd-scripts: frozen when global_step reaches N); from step N + 1 on they get no gradient, so
    the optimizer skips them (their optimizer state stays as it was), and their outputs are
    computed without autograd. ``before_step`` applies it from the step counter alone, so a
    resume past N freezes them the same way.
    """

    adapter = None
    saves_full_model = True
    network = None  # no adapter network: the model's own weights train
    group_names = None  # one name per optimizer parameter group, when setup() knows them
    te_lrs: tuple = ()  # one learning rate per text encoder, set by setup()

    def __init__(self, opts: Options, bundle):
        self.opts = opts
        self.bundle = bundle
        self.train_unet = bool(opts.learning_rate)
        # sd-scripts' flux_train.py has no train_text_encoder (a config's key is ignored there; the
        # GUI's fine-tune tab writes it true): FLUX.1's encoders stay frozen (flow_loss warns)
        fam = None if bundle is None else registry.of(bundle)
        self.flow = fam is not None and fam.flow is not None
        wants_te = opts.train_text_encoder and not (fam is not None and not fam.full_trains_text_encoders)
        may_imply = _db_implies_text_encoder(opts)
        # sd-scripts' train_db.py (SD1/SD2) has no train_text_encoder switch: it trains the text
        # encoder unless stop_text_encoder_training < 0. A config giving a text-encoder rate (or
        # a stop step) meant that; sdxl_train.py, flux_train.py and sd3_train.py train them only
        # with train_text_encoder (the GUI writes learning_rate_te for FLUX.1 / SD3 too).
        self.implied_te = may_imply and fam is not None and fam.rate_implies_text_encoder
        wants_te = wants_te or self.implied_te
        self.wants_te = wants_te
        if opts.train_t5xxl and not wants_te:
            raise MethodError("train_t5xxl needs train_text_encoder (sd-scripts' sd3_train.py trains T5-XXL "
                              "only with CLIP-L / CLIP-G)")
        te_lrs = self._te_lr_values() + [v for v in (opts.learning_rate_te1,
                                                     opts.learning_rate_te2)
                                         if v is not None]
        if opts.train_t5xxl:
            te_lrs.append(opts.learning_rate if opts.learning_rate_te3 is None else opts.learning_rate_te3)
        self.stop_te_at = opts.stop_text_encoder_training
        if self.stop_te_at is not None and not wants_te and not (may_imply and bundle is None):
            raise MethodError("stop_text_encoder_training needs train_text_encoder (the text "
                              "encoders do not train without it)")
        self.train_text_encoder = wants_te and any(te_lrs)
        self.block_lr = opts.block_lr
        if self.block_lr is not None:
            block_lr.check_count(self.block_lr)
            if bundle is None:  # the validate stage: the family now where the config tells it
                family = loading.configured_family(
                    required(opts.pretrained_model_name_or_path, "pretrained_model_name_or_path"))
                if family is not None:
                    block_lr.check_family(family)
            # sd-scripts: learning_rate 0 still freezes the U-Net; else the blocks' own rates
            self.train_unet = self.train_unet and any(self.block_lr)
        if not self.train_unet and not self.train_text_encoder:
            if not wants_te:
                why = "learning_rate is 0 and train_text_encoder is off"
            else:
                why = "learning_rate is 0 and text_encoder_lr is 0 or unset"
            raise MethodError(f"nothing to train: {why}; set a learning_rate above 0")

    def _te_lr_values(self) -> list:
        """The text-encoder learning rates as given (one or two values; unset -> learning_rate).
        sd-scripts' sd3_train.py never reads learning_rate_te (learning_rate_te1/te2/te3, else
        learning_rate): nor does an SD3 run here."""
        lr = self.opts.text_encoder_lr
        if lr is None or self.flow:
            return [self.opts.learning_rate]
        return list(lr) if isinstance(lr, (list, tuple)) else [lr]

    def text_encoder_lrs(self) -> list:
        """One learning rate per text encoder of the loaded model (0 when it does not train)."""
        n = len(self.bundle.text_encoders)
        if not self.wants_te:
            return [0.0] * n
        lrs = self._te_lr_values()
        if len(lrs) > n:
            raise MethodError(f"text_encoder_lr: {len(lrs)} values given but this "
                              f"{self.bundle.family} model has {n} text encoder(s)")
        out = [lrs[i] if i < len(lrs) else lrs[0] for i in range(n)]
        for i, name in enumerate(("learning_rate_te1", "learning_rate_te2")):
            v = getattr(self.opts, name)
            if v is None:
                continue
            if n < 2:
                raise MethodError(f"{name} is for SDXL's two text encoders; this "
                                  f"{self.bundle.family} model has one: use text_encoder_lr")
            out[i] = v
        if registry.of(self.bundle).separate_t5_rate:
            return self._sd3_t5_lr(out)
        return out

    def _sd3_t5_lr(self, lrs: list) -> list:
        """SD3's T5-XXL (the third encoder, when the model has one) trains only with train_t5xxl."""
        opts = self.opts
        if opts.train_t5xxl and len(lrs) < 3:
            raise MethodError(f"train_t5xxl: the SD3 model {opts.pretrained_model_name_or_path} has no T5-XXL "
                              "(give the t5xxl file)")
        if len(lrs) < 3:
            return lrs
        given = self._te_lr_values()
        t5 = opts.learning_rate_te3 if opts.learning_rate_te3 is not None else \
            given[2] if len(given) > 2 else opts.learning_rate
        return lrs[:2] + [t5 if opts.train_t5xxl else 0.0]

    def before_step(self, global_step: int) -> None:
        """Called before each optimizer step with the number of steps done."""
        if self.stop_te_at is None or not self.train_text_encoder or global_step < self.stop_te_at:
            return
        for te in self.bundle.text_encoders:
            te.requires_grad_(False)
            te.train(False)
            for p in te.parameters():
                p.grad = None
        self.train_text_encoder = False
        logger.info(f"stop_text_encoder_training: text encoder(s) frozen after step {global_step}")

    def setup(self):
        opts, b = self.opts, self.bundle
        for name in ("text_encoder_lr", "learning_rate_te1", "learning_rate_te2"):
            if getattr(opts, name) is None:
                continue
            if name == "text_encoder_lr" and self.flow:
                logger.warning(f"text_encoder_lr (learning_rate_te) has no effect with the {b.family} model: "
                               "sd-scripts' sd3_train.py reads learning_rate_te1 / te2 / te3 (unset: "
                               "learning_rate) and flux_train.py trains the transformer alone")
            elif not self.wants_te:
                logger.warning(f"{name} has no effect without train_text_encoder")
        if opts.learning_rate_te3 is not None and not opts.train_t5xxl:
            logger.warning("learning_rate_te3 has no effect without train_t5xxl")
        if self.implied_te and self.train_text_encoder:
            logger.info("train_dreambooth: text_encoder_lr (learning_rate_te) or "
                        "stop_text_encoder_training is set and train_text_encoder is not: the "
                        "text encoder trains, as in sd-scripts' train_db.py "
                        "(train_text_encoder = false keeps it frozen)")
        b.vae.requires_grad_(False)
        b.unet.requires_grad_(self.train_unet)
        groups, self.group_names = [], None
        if self.block_lr is not None and self.train_unet:
            # sdxl_train.py: one group per U-Net block; a block at 0 is not trained
            groups, self.group_names = block_lr.param_groups(b.unet, b.family, self.block_lr)
        elif self.train_unet and opts.blockwise_fused_optimizers:
            # FLUX.1 / SD3 (block_swap.check_options): one group per transformer block and one
            # for the rest, each its own optimizer (stepper.step_units), as sd-scripts' flux_train.py
            groups += [{"params": ps, "lr": opts.learning_rate} for ps in block_param_lists(b.unet)]
        elif self.train_unet and (own := flow_family.full_param_groups(b, opts)) is not None:
            groups, self.group_names = own  # the family's own rule (Anima: sd-scripts' per-part rates)
        elif self.train_unet:
            groups.append({"params": list(b.unet.parameters()), "lr": opts.learning_rate})
        if opts.num_last_block_to_freeze and self.train_unet:  # SD3 (flow_loss.check_options)
            groups = self._freeze_last_x_block_parameters(groups, opts.num_last_block_to_freeze)
        self.te_lrs = self.text_encoder_lrs()
        for i, (te, lr) in enumerate(zip(b.text_encoders, self.te_lrs)):
            te.requires_grad_(bool(lr))
            if lr:
                groups.append({"params": list(te.parameters()), "lr": lr})
                if self.group_names is not None:
                    self.group_names.append("textencoder" if len(b.text_encoders) == 1 else f"textencoder{i + 1}")
        self.param_groups = groups
        self.info = {"ss_train_text_encoder": self.train_text_encoder}
        if opts.learning_rate_te1 is not None or opts.learning_rate_te2 is not None or opts.train_t5xxl:
            self.info["ss_text_encoder_lr"] = [float(v) for v in self.te_lrs]
        if self.stop_te_at is not None:
            self.info["ss_stop_text_encoder_training"] = self.stop_te_at
        return groups

    def _freeze_last_x_block_parameters(self, groups: list, n: int) -> list:
        """num_last_block_to_freeze: no gradient and no optimizer slot for those tensors (a
        blockwise group left empty is dropped)."""
        names = sd3.last_x_block_parameters(self.bundle.unet, n)
        params = dict(self.bundle.unet.named_parameters())
        frozen = {id(params[name]) for name in names}
        for name in names:
            params[name].requires_grad_(False)
        logger.info(f"num_last_block_to_freeze: {len(names)} parameter tensors frozen "
                    f"({names[0]} ... {names[-1]})" if names else "num_last_block_to_freeze: nothing to freeze")
        out = []
        for g in groups:
            kept = [p for p in g["params"] if id(p) not in frozen]
            if kept:
                out.append({**g, "params": kept})
        return out

    def trainable_parameters(self):
        return [p for g in self.param_groups for p in g["params"]]

    def after_step(self, device):
        return None  # scale_weight_norms is a network option

    def set_train(self, epoch: int):
        for te, lr in zip(self.bundle.text_encoders, self.te_lrs):
            if not lr:  # a frozen encoder beside trained ones (SD3's T5 without train_t5xxl): eval mode
                te.train(False)

    def prompt_rewrite(self):
        return None

    def companion_files(self, path: str) -> list[str]:
        return []

    def trained_encoder_names(self) -> tuple[str, ...]:
        """SD3's trained text encoders by sd-scripts' component name (clip_l, clip_g, t5xxl)."""
        return tuple(name for name, lr in zip(("clip_l", "clip_g", "t5xxl"), self.te_lrs) if lr)

    FORMATS = {"safetensors": ".safetensors", "ckpt": ".ckpt", "diffusers": "",
               "diffusers_safetensors": ""}

    def extension(self):
        fmt = self.opts.save_model_as or "safetensors"
        if fmt not in self.FORMATS:
            raise MethodError(f"save_model_as {fmt!r}: use one of {', '.join(self.FORMATS)}")
        flow = None if self.bundle is None else self.bundle.flow
        if flow is not None and flow.layout == "diffusers":  # FLUX.1: a transformer folder
            return ""
        return self.FORMATS[fmt]

    def save(self, path: str, dtype_name, metadata: dict):
        dtype = _dtype(dtype_name)
        # the family's home saves in its layout (an SD family: one file, or a diffusers folder for
        # the extension-less path of save_model_as diffusers)
        fam = registry.of(self.bundle)
        trained = self.trained_encoder_names() if fam.flow is not None and fam.saves_text_encoders else ()
        flow_family.save_full(self.bundle, path, dtype, metadata, trained)


def _pivotal_specs(opts: Options) -> list:
    """pivotal_tokens with their init words and vector counts (one value, or one per token),
    checked before any weight loads."""
    tokens = opts.pivotal_tokens or []
    if not tokens:
        given = {"pivotal_init_words": opts.pivotal_init_words,
                 "pivotal_num_vectors": opts.pivotal_num_vectors,
                 "pivotal_learning_rate": opts.pivotal_learning_rate,
                 "stop_pivotal_training": opts.stop_pivotal_training}
        for name, value in given.items():
            if value is not None:
                raise MethodError(f"{name} needs pivotal_tokens (the new tokens to train)")
        return []

    def per_token(name, values, default):
        if values is None:
            return [default] * len(tokens)
        if len(values) == 1:
            return list(values) * len(tokens)
        if len(values) != len(tokens):
            raise MethodError(f"{name}: {len(values)} values for {len(tokens)} pivotal_tokens "
                              "(give one per token, or one for all)")
        return list(values)

    words = per_token("pivotal_init_words", opts.pivotal_init_words, None)
    counts = per_token("pivotal_num_vectors", opts.pivotal_num_vectors, 1)
    specs = [embeddings.TokenSpec(t, w, n) for t, w, n in zip(tokens, words, counts)]
    embeddings.check_specs(specs, "pivotal_tokens")
    if opts.cache_text_encoder_outputs or opts.cache_text_encoder_outputs_to_disk:
        raise MethodError("cache_text_encoder_outputs cannot be combined with pivotal_tokens: the "
                          "new embeddings train, so the text encoders' outputs change every step")
    if opts.deepspeed:
        raise MethodError("deepspeed cannot be combined with pivotal_tokens: the ZeRO engine wraps "
                          "the network only, not the new embedding rows")
    return specs


class TextualInversionMethod:
    """Textual inversion: only the new tokens' embedding rows train (SDXL: in both text encoders);
    the U-Net, VAE and text encoders are frozen and stay bit-identical (library/models/families/sd_common/embeddings.py:
    the rows are a parameter of their own, the loaded matrices are not in the optimizer).

    The text encoders run with autograd every step (gradients flow through them to the rows),
    so their outputs are never cached. A save writes the embedding file: SD1/SD2 ``emb_params``,
    SDXL ``clip_l`` / ``clip_g``.
    """

    adapter = "textual-inversion"
    saves_full_model = False
    network = None  # no adapter network: the new embedding rows train
    group_names = None  # one name per optimizer parameter group, when setup() knows them

    def __init__(self, opts: Options, bundle):
        self.opts = opts
        self.bundle = bundle
        if not opts.token_string:
            raise MethodError("token_string is required: the new token to learn (e.g. "
                              "token_string = \"sks_toy\")")
        self.spec = embeddings.TokenSpec(opts.token_string, opts.init_word, opts.num_vectors_per_token)
        embeddings.check_specs([self.spec], "token_string")
        if opts.weights and not os.path.isfile(opts.weights):
            raise MethodError(f"weights {opts.weights}: file not found")
        if not opts.learning_rate:
            raise MethodError("nothing to train: learning_rate is 0")
        if opts.deepspeed:  # not an option here: only an Accelerate DeepSpeed launch config sets it
            raise MethodError("train_textual_inversion does not run under DeepSpeed (the launch "
                              "config turned it on): launch without a DeepSpeed config")
        self.train_unet = False
        self.train_text_encoder = True  # with gradients, to reach the rows; its weights are frozen
        self.tokens: embeddings.NewTokens | None = None  # installed by setup()

    def setup(self):
        opts, b = self.opts, self.bundle
        for m in [b.unet, *b.text_encoders, b.vae]:
            m.requires_grad_(False)
        self.tokens = embeddings.NewTokens([self.spec], "token_string")
        self.tokens.install(b.tokenizers, b.text_encoders, opts.seed,
                            getattr(torch, trained_precision(opts)))
        if opts.weights:
            self.tokens.load_rows(self.spec, embeddings.read_embedding_file(opts.weights, b.family),
                                  opts.weights)
            logger.info(f"textual inversion: vectors of {self.spec.token} loaded from {opts.weights}")
        logger.info(f"textual inversion: token {self.spec.token}, {self.spec.num_vectors} vector(s) "
                    f"({', '.join(self.spec.strings())})")
        self.param_groups = [{"params": self.tokens.parameters(), "lr": opts.learning_rate}]
        self.group_names = None
        self.info = {"ss_token_string": self.spec.token, "ss_init_word": str(self.spec.init_word),
                     "ss_num_vectors_per_token": self.spec.num_vectors,
                     "ss_use_object_template": bool(opts.use_object_template),
                     "ss_use_style_template": bool(opts.use_style_template)}
        return self.param_groups

    def trainable_parameters(self):
        return self.tokens.parameters()

    def before_step(self, global_step: int) -> None:
        pass

    def after_step(self, device):
        return None

    def set_train(self, epoch: int):
        pass

    def prompt_rewrite(self):
        return embeddings.prompt_rewriter([self.spec])

    def extension(self):
        return EXTENSIONS[self.opts.save_model_as or "safetensors"]

    def save(self, path: str, dtype_name, metadata: dict):
        if self.tokens is None:
            raise RuntimeError("save() before setup(): no embedding to write")
        write_embedding_file(path, self.tokens.file_tensors(self.spec, self.bundle.family),
                                        _dtype(dtype_name), metadata)

    def companion_files(self, path: str) -> list[str]:
        return []


METHODS = {"lora": NetworkMethod, "dreambooth": FullMethod, "finetune": FullMethod,
           "textual_inversion": TextualInversionMethod}


def hooked_module_ids(loras) -> set[int]:
    """The ids of the layers a network's modules (``text_encoder_loras`` / ``unet_loras``) sit on.
    LyCORIS and sd-scripts' OFT keep the layer in a one-item list (out of the module tree)."""
    return {id(m[0] if isinstance(m, list) else m) for m in (lora.org_module for lora in loras)}


def make_method(method_name: str, opts: Options, bundle):
    """The method of a run (bundle None: the checks before loading)."""
    return METHODS[method_name](opts, bundle)


def write_embedding_file(path: str, tensors: dict, dtype, metadata: dict | None) -> None:
    """Atomic write: .safetensors with metadata, else torch.save of the same dictionary (what
    sd-scripts writes for .pt / .ckpt, which A1111 also reads); ``tensors``: name -> tensor."""
    write_weights(path, tensors, dtype, metadata if path.lower().endswith(".safetensors") else None)
