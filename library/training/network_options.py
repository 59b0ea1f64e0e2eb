"""sd-scripts' train_network.py options around the network: dim_from_weights, scale_weight_norms,
base_weights / base_weights_multiplier (checks before any weight loads, and the merge).

``base_weights`` are merged right after the model loads (``Run.load``, before the trainer's dtype
placement and any fp8 cast of the frozen U-Net), in float32 when the weights are float32 as
loaded: each file adds ``multiplier * up @ down * alpha / rank`` to the U-Net's and text encoders'
own weights (networks/merge_lora.py ``merge_lora_into``), in the order given.
"""
from __future__ import annotations

import importlib
import os
from importlib.metadata import PackageNotFoundError, version

import torch

from library.errors import UserError
from library.models.families import registry
from networks import lora, lora_flux, lora_lumina, lora_names, lora_sd3, oft_flux
from networks.adapter_weights import file_kinds
from networks.merge_lora import merge_lora_into

# sd-scripts' network modules of the transformers (which family each targets: the family's
# ``network_modules``) -> (kind, module); LyCORIS (lycoris.kohya) trains them too (its targets
# include their block classes)
_DIT_KINDS = {m.__name__: (kind, m) for kind, m in (("LoRA", lora_flux), ("OFT", oft_flux), ("LoRA", lora_sd3),
                                                                  ("LoRA", lora_lumina))}
# name -> (family, kind, module)
DIT_NETWORK_MODULES = {name: (f.name, *_DIT_KINDS[name]) for f in registry.FAMILIES.values() if f.flow is not None
                       for name in f.network_modules}
FAMILY_NETWORK_MODULES = {name: registry.get(name).network_modules for name in registry.FLOW_FAMILIES}
# the LoRA of a FLUX.1 / SD3 model (sd-scripts' networks/lora_flux.py / lora_sd3.py): it also
# reads their base_weights
FAMILY_LORA_MODULES = {name: DIT_NETWORK_MODULES[registry.get(name).lora_module][2] for name in registry.FLOW_FAMILIES}
# sd-scripts' network modules of SD: they target the SD U-Net's block classes
SD_NETWORK_MODULES = tuple(dict.fromkeys(m for f in registry.FAMILIES.values() if f.flow is None
                                         for m in f.network_modules))


class NetworkOptionError(UserError, ValueError):
    pass


# LyCORIS algorithms that the kohya_ss GUI offers and the supported lycoris-lora (3.x; 4.x stops on
# diffusers U-Nets with duplicated time_embedding names, pyproject) cannot train here:
# network_args algo -> (GUI LoRA type, why, after "lycoris-lora <installed version>")
LYCORIS_UNSUPPORTED = {
    "ia3": ("LyCORIS/iA3", "has no 'ia3' algorithm in its kohya wrapper, nor has the 3.2.0.post2 the kohya_ss GUI "
                           "pins, so the GUI's iA3 presets stop in sd-scripts too (LyCORIS 2.x and 4.x have it; 4.x "
                           "stops on diffusers U-Nets, so no LyCORIS that runs here has it)"),
}
# LyCORIS algorithms trained by a module of ours over lycoris.kohya's network (its forward fixed):
# algo -> the module the run imports instead of lycoris.kohya (the file and metadata stay LyCORIS')
LYCORIS_OWN_MODULES = {"full": "networks.lycoris_full"}


def is_lycoris(network_module: str) -> bool:
    return network_module.split(".")[0] == "lycoris"


def why_not_for(network_module: str, fam: str) -> str:
    """Why ``network_module`` does not train a ``fam`` ("flux" / "sd3") transformer here (a true
    statement about what it would do)."""
    if network_module in DIT_NETWORK_MODULES:
        f, kind, _ = DIT_NETWORK_MODULES[network_module]
        return f"it is the {kind} of {registry.get(f).title} models, whose layer names it targets"
    if network_module in SD_NETWORK_MODULES:
        return ("it puts its modules in the SD U-Net's block classes (Transformer2DModel, ResnetBlock2D, ...), "
                f"which the {registry.get(fam).title} transformer does not have (sd-scripts would train none of the "
                "transformer's layers with it)")
    return "this toolkit runs only sd-scripts' and LyCORIS' network modules of these transformers"


def lycoris_algo(network_args: dict) -> str:
    """The algorithm lycoris.kohya reads from network_args (its default: lora)."""
    return str(network_args.get("algo") or "lora").strip().strip('"').lower()


def network_module_for(network_module: str, network_args: dict) -> str:
    """The module a run imports for ``network_module``: lycoris.kohya's algorithms whose module is
    ours (LYCORIS_OWN_MODULES) go there, every other name is itself."""
    if is_lycoris(network_module):
        return LYCORIS_OWN_MODULES.get(lycoris_algo(network_args), network_module)
    return network_module


def check_lycoris_algo(network_module: str, network_args: dict, network_dropout=None) -> None:
    """One line for a LyCORIS algorithm, or an option of one, that cannot train here (before any
    weight loads)."""
    if not is_lycoris(network_module):
        return
    algo = lycoris_algo(network_args)
    if algo in LYCORIS_UNSUPPORTED:
        try:
            installed = f"lycoris-lora {version('lycoris-lora')}"
        except PackageNotFoundError:
            installed = "lycoris-lora (not installed; the supported 3.x)"
        gui_type, why = LYCORIS_UNSUPPORTED[algo]
        raise NetworkOptionError(f"network_args algo={algo} (kohya_ss GUI LoRA type {gui_type}) cannot train "
                                 f"here: {installed} {why}")
    if algo == "full":
        if float(network_args.get("rank_dropout") or 0):
            raise NetworkOptionError("network_args rank_dropout with algo=full: a full layer has no rank to drop "
                                     "(LyCORIS' FullModule would drop output rows on the wrong axis); set it to 0")
        if network_dropout:
            raise NetworkOptionError("network_dropout with algo=full: LyCORIS' FullModule has no neuron dropout "
                                     "(it would be ignored); leave network_dropout out")


def check_options(opts) -> None:
    """Before any weight loads."""
    if opts.script != "train_lora":
        return
    check_lycoris_algo(opts.network_module, dict(opts.network_args or {}), opts.network_dropout)
    if opts.dim_from_weights and network_module_for(opts.network_module, dict(opts.network_args or {})) in \
            LYCORIS_OWN_MODULES.values():
        raise NetworkOptionError("dim_from_weights with algo=full: a full fine-tuning file has no ranks or alphas "
                                 "to read; use network_weights alone")
    if opts.dim_from_weights and not opts.network_weights:
        raise NetworkOptionError("dim_from_weights needs network_weights (the file whose ranks and "
                                 "alphas shape the network)")
    files = list(opts.base_weights or [])
    for f in files:
        if not os.path.isfile(f):
            raise NetworkOptionError(f"base_weights: file not found: {f}")
    mults = opts.base_weights_multiplier
    if mults is not None and len(mults) != len(files):
        raise NetworkOptionError(f"base_weights_multiplier: {len(mults)} value(s) for {len(files)} "
                                 "base_weights file(s); give one multiplier per file")
    if opts.scale_weight_norms is not None and opts.deepspeed:
        # ZeRO steps float32 master copies (and partitions them): an in-place rescale of the
        # module weights would be overwritten by the next step
        raise NetworkOptionError("scale_weight_norms cannot be combined with deepspeed (ZeRO's master "
                                 "weights would undo the rescaling); drop one of them")


def base_multipliers(opts) -> list[float]:
    files = list(opts.base_weights or [])
    return list(opts.base_weights_multiplier) if opts.base_weights_multiplier is not None else [1.0] * len(files)


def merge_base_weights(bundle, opts, log) -> None:
    """Merge each base_weights file, with its multiplier, into the loaded model (in place)."""
    if not opts.base_weights:
        return

    for path, m in zip(opts.base_weights, base_multipliers(opts)):
        try:
            n = _merge(bundle, lora.load_state_dict_file(path), m, opts.network_module)
        except lora.LoRAError as e:
            raise NetworkOptionError(f"base_weights: {path}: {e}") from None
        log.info(f"base_weights: merged {path} (multiplier {m}): {n} modules")


def _merge(bundle, weights_sd: dict, multiplier: float, network_module: str) -> int:
    """One base_weights file into the model: on FLUX.1 / SD3 a LyCORIS file (LoHa, LoKr, ...:
    ``lycoris.kohya`` on these transformers) through LyCORIS (_merge_lycoris), any other through
    the run's network module when it is sd-scripts' one of the family (networks.oft_flux: an OFT
    file), else the family's LoRA (as sd-scripts' train_network.py merges with network_module's
    create_network_from_weights); any SD adapter file through merge_lora. Returns the number of
    modules merged."""
    module = FAMILY_LORA_MODULES.get(bundle.family)
    if module is None:
        return merge_lora_into(bundle.text_encoders, bundle.unet, weights_sd, multiplier)
    lycoris_kinds = sorted(k.removeprefix("LyCORIS ") for k in set(file_kinds(weights_sd)) - {"LoRA"})
    if lycoris_kinds:
        return _merge_lycoris(bundle, weights_sd, multiplier, lycoris_kinds)
    if network_module in FAMILY_NETWORK_MODULES.get(bundle.family, ()):
        module = DIT_NETWORK_MODULES[network_module][2]
    network, _ = module.create_network_from_weights(multiplier, None, None, bundle.text_encoders, bundle.unet,
                                                    weights_sd=weights_sd)
    network.merge_to(bundle.text_encoders, bundle.unet, weights_sd)
    return len(network.text_encoder_loras) + len(network.unet_loras)


# the LyCORIS kinds (networks/adapter_weights.py file_kinds) whose run-time delta base_weights merges
LYCORIS_MERGED = {"LoHa", "LoKr"}


def _merge_lycoris(bundle, weights_sd: dict, multiplier: float, lycoris_kinds: list[str]) -> int:
    """A LyCORIS file into a FLUX.1 / SD3 model, as the LyCORIS training path builds its network
    (library/training/methods.py): lycoris.kohya's create_network_from_weights on the transformer
    and the text encoders as one list, the file's kohya names translated to the names LyCORIS'
    walk gives (networks/lora_names.py); each layer then gets multiplier x the delta its module
    adds at run time (the forward's ``get_weight(shape) x scalar``: LyCORIS 3.4's own merge_to
    merges at 1 whatever the multiplier, and its get_diff_weight scales LoHa and LoKr by alpha /
    rank twice). LoHa and LoKr files merge (LoRA / LoCon ones go through the family's LoRA); the
    other LyCORIS kinds and a module of the file that names no layer of this model are errors
    (LyCORIS would skip the latter)."""
    kinds = "/".join(lycoris_kinds)  # file_kinds' names without "LyCORIS "
    unmerged = sorted(set(lycoris_kinds) - LYCORIS_MERGED)
    if unmerged:
        raise lora.LoRAError(f"a LyCORIS {kinds} file: base_weights merges LyCORIS LoHa and LoKr files (and "
                             f"LoRA / LoCon ones) into {registry.of(bundle).title} models, not "
                             f"{'/'.join(unmerged)}")
    try:
        # lazy: lycoris-lora is an optional extra (pyproject), needed only for its files
        lycoris_kohya = importlib.import_module("lycoris.kohya")
    except ImportError:
        raise lora.LoRAError(f"a LyCORIS {kinds} file: merging it needs lycoris-lora (pip install "
                             "'lycoris-lora>=3.4,<4', the lycoris extra)") from None
    tes = list(bundle.text_encoders)
    kohya = lora_names.plain_to_kohya_names(tes, bundle.unet)
    sd = lora_names.rename_keys(weights_sd, {v: k for k, v in kohya.items()})
    network, _ = lycoris_kohya.create_network_from_weights(multiplier, None, None, tes, bundle.unet, weights_sd=sd)
    modules = network.text_encoder_loras + network.unet_loras
    missing = sorted({k.split(".")[0] for k in sd} - {m.lora_name for m in modules})
    if missing:
        raise lora.LoRAError(f"a LyCORIS {kinds} file: {len(missing)} module(s) name no layer of this "
                             f"{registry.of(bundle).title} model that LyCORIS can merge (wrong base "
                             f"model?), e.g. {kohya.get(missing[0], missing[0])}")
    with torch.no_grad():
        for m in modules:
            layer = m.org_module[0]
            delta = m.get_weight(tuple(layer.weight.shape)).float() * m.scalar.float()
            layer.weight.copy_((layer.weight.float() + multiplier * delta).to(layer.weight.dtype))
    return len(modules)


class MaxNormStats:
    """scale_weight_norms' statistics of one step, left on the device (networks/lora.py
    ``scale_max_norms``) until the progress bar or a tracker shows them; read once."""

    def __init__(self, stacked):
        self._stacked, self._host = stacked, None

    def host(self) -> tuple[int, float, float]:
        if self._host is None:
            self._host = lora.max_norm_summary(self._stacked)
        return self._host


def host_stats(stats) -> tuple[int, float, float]:
    """(keys scaled, mean norm, max norm): a network's own tuple, or MaxNormStats read."""
    return stats.host() if isinstance(stats, MaxNormStats) else stats


def max_norm_postfix(stats) -> dict:
    """sd-scripts' progress-bar entries for scale_weight_norms."""
    keys_scaled, mean_norm, _ = host_stats(stats)
    return {"Keys Scaled": keys_scaled, "Average key norm": f"{mean_norm:.4f}"}


def max_norm_scalars(stats) -> dict:
    """sd-scripts' tracker scalars for scale_weight_norms (generate_step_logs)."""
    keys_scaled, mean_norm, max_norm = host_stats(stats)
    return {"max_norm/keys_scaled": keys_scaled, "max_norm/max_key_norm": max_norm,
            "norm/avg_key_norm": mean_norm}
