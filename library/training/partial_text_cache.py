"""What the text-encoder output cache (``cache_text_encoder_outputs``, ``..._to_disk``) holds when
text encoders train, as sd-scripts decides it.

- SD1 / SD2 / SDXL: all outputs or none. A trained text encoder's outputs change every step, so
  the cache is refused with one (a LoRA needs ``network_train_unet_only``; ``train_text_encoder``
  is off), as sd-scripts refuses it.
- FLUX.1 and SD3 (sd-scripts' ``is_partial`` in flux_train_network.py, sd3_train_network.py and
  sd3_train.py): while CLIP-L (FLUX.1's LoRA) or CLIP-L / CLIP-G (SD3's LoRA or
  ``train_text_encoder``) train and T5-XXL does not, the cache holds the frozen T5's part only
  and the CLIP encoders run at every step on the same captions, with gradients
  (library/data/text_cache.py ``batch``). T5 (4.7 B parameters in FLUX.1 / SD3) then never runs
  during training. sd3_train.py asks for ``use_t5xxl_cache_only`` to cache T5 beside trained
  CLIP encoders; the combination has that one meaning, so here it needs no extra option. Given,
  ``use_t5xxl_cache_only`` (SD3 fine-tune) implies the cache (library/training/plan.py) and makes
  it partial even when the CLIP encoders are frozen (they then run without gradients), as there.
- T5 trained (``train_t5xxl``, ``network_args`` ``train_t5xxl``, or a ``network_weights`` file
  with T5 modules read with ``dim_from_weights``): refused, as sd-scripts refuses it.

    check_options(opts, method_name, family)            before any weight loads
    is_partial(method, text_encoders, family_model, log) at the cache stage: True = a partial cache
    trained_text_encoders(method, text_encoders)        which encoders the method trains
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from library.config import method_kinds
from library.errors import UserError
from library.models.families import registry
from library.training import methods, network_options

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options

logger = logging.getLogger("sdtk")


class TextCacheError(UserError, ValueError):
    """A text-encoder cache that cannot hold what the run needs; one line naming the options."""


def caching(opts: Options) -> bool:
    return bool(opts.cache_text_encoder_outputs or opts.cache_text_encoder_outputs_to_disk)


def check_options(opts: Options, method_name: str, family: str | None, method) -> None:
    """Before loading: the combinations of the cache with trained text encoders that cannot
    work (``family``: "flux" / "sd3", or None for a model whose family is known only once it loads; ``method``: the run's method as
    the checks build it, which knows whether its network module trains text encoders: sd-scripts'
    OFT puts no module on them)."""
    if not caching(opts):
        return
    network = method_kinds.get(method_name).trains_network
    lora_te = network and method.train_text_encoder
    if family is not None and registry.get(family).partial_cache:
        how = None
        if lora_te and opts.network_module == network_options.FAMILY_LORA_MODULES[family].__name__:
            args = network_options.FAMILY_LORA_MODULES[family].parse_network_args(dict(opts.network_args or {}))
            how = "network_args train_t5xxl" if args.get("train_t5xxl") else None
        elif not network and opts.train_text_encoder and opts.train_t5xxl:
            how = "train_t5xxl"
        if how:
            cache = "use_t5xxl_cache_only" if opts.use_t5xxl_cache_only else "cache_text_encoder_outputs"
            raise TextCacheError(f"{cache} cannot be combined with {how}: T5-XXL's "
                                 "outputs change every step (sd-scripts refuses it too); trained CLIP "
                                 "encoders alone keep the cache of T5's outputs")
        return
    if lora_te:
        raise TextCacheError("cache_text_encoder_outputs: the LoRA would train the text encoder "
                             "too; add network_train_unet_only (as sd-scripts requires)")
    if opts.script != "train_lora" and opts.train_text_encoder:
        raise TextCacheError("cache_text_encoder_outputs cannot be combined with train_text_encoder: "
                             "a trained text encoder's outputs change every step")


def trained_text_encoders(method, text_encoders) -> list[bool]:
    """Per text encoder: whether the ``method`` trains it now (a parameter of its own that
    requires a gradient, or a module of the method's network on it). A network that does not
    list its text-encoder modules counts as training every encoder."""
    if not method.train_text_encoder:
        return [False] * len(text_encoders)
    net = method.network
    loras = None if net is None else getattr(net, "text_encoder_loras", None)
    hooked = methods.hooked_module_ids(loras or ())
    out = []
    for te in text_encoders:
        own = any(p.requires_grad for p in te.parameters())
        on = any(id(m) in hooked for m in te.modules())
        out.append(own or on or (net is not None and loras is None))
    return out


def is_partial(method, text_encoders, family_model, log: logging.Logger = logger,
               t5_only: bool = False) -> bool:
    """At the cache stage (the method set up): True when the cache holds the frozen encoders'
    part only (family_model.partial_cache_encoders) and the trained ones run at each step; False
    for a full cache (no encoder trains, ``t5_only`` (use_t5xxl_cache_only) off). A trained
    encoder whose outputs the cache would hold is refused in one line."""
    trained = trained_text_encoders(method, text_encoders)
    if not any(trained) and not t5_only:
        return False
    held = [i for i in family_model.partial_cache_encoders if i < len(trained)]
    family = family_model.family
    names = registry.get(family).text_encoder_names
    if not family_model.partial_cache_encoders:
        raise TextCacheError("cache_text_encoder_outputs: the text encoder trains, so its outputs change "
                             "every step; add network_train_unet_only or drop the cache")
    bad = [names[i] for i in held if trained[i]]
    if bad:
        raise TextCacheError(f"cache_text_encoder_outputs cannot be combined with a trained {bad[0]} (its "
                             "network_weights file holds T5 modules, sd-scripts' train_t5xxl): its outputs "
                             "change every step; drop the cache")
    now = [n for n, t in zip(names, trained) if t]
    why = (f"cache_text_encoder_outputs with {registry.get(family).title}'s {' and '.join(now)} training" if now
           else "use_t5xxl_cache_only")
    frozen = " and ".join(f"the frozen {names[i]}'s outputs" for i in held) or \
        "the zero tokens in T5-XXL's place (the model has none)"
    log.info(f"{why}: the cache holds {frozen}; the CLIP encoder(s) run at every step (sd-scripts' "
             "partial cache)")
    return True
