"""The kohya_ss GUI's LoRA type -> the ``network_module`` and ``network_args`` it writes.

    gui_network(fields) -> (network_module or None, network_args, notes)

``fields`` are the GUI's saved JSON fields (its LoRA tab, or one of its shipped presets), read
over the GUI's own defaults as the GUI loads a file (lora_gui.py ``open_configuration``: a field
missing or null in the file keeps its widget's default). The translation is lora_gui.py
``train_model`` of kohya_ss v26 (commit 45088f04): one branch per ``LoRA_type``, then
``append_loraplus_network_args``; the string it builds is split as the GUI writes it
(``str(network_args).replace('"', "").split()``). A note is made only where the result cannot be
trained here, or where the GUI itself refuses the combination.
"""
from __future__ import annotations

from library.errors import UserError
from library.models.families import registry

# The GUI's defaults of the fields the translation reads (lora_gui.py's widgets, class_flux1.py
# `config.get(..., default)`; the model checkboxes are unchecked).
DEFAULTS = dict(
    LoRA_type="Standard", LyCORIS_preset="full", conv_dim=1, conv_alpha=1, factor=-1,
    bypass_mode=False, dora_wd=False, use_cp=False, use_tucker=False, use_scalar=False,
    rank_dropout_scale=False, constrain=0.0, rescaled=False, train_norm=False,
    decompose_both=False, train_on_input=True, unit=1, rank_dropout=0, module_dropout=0.0,
    down_lr_weight="", mid_lr_weight="", up_lr_weight="", block_lr_zero_threshold="",
    block_dims="", block_alphas="", conv_block_dims="", conv_block_alphas="",
    loraplus_lr_ratio=0, loraplus_unet_lr_ratio=0, loraplus_text_encoder_lr_ratio=0,
    train_lora_ggpo=False, ggpo_sigma=0.03, ggpo_beta=0.01,
    split_mode=False, train_blocks="all", split_qkv=False, train_t5xxl=False,
    enable_all_linear=False, img_attn_dim="", img_mlp_dim="", img_mod_dim="", single_dim="",
    txt_attn_dim="", txt_mlp_dim="", txt_mod_dim="", single_mod_dim="", in_dims="",
    train_double_block_indices="all", train_single_block_indices="all",
    flux1_checkbox=False, sd3_checkbox=False, hunyuan_image_checkbox=False,
    anima_checkbox=False, lumina_checkbox=False,
)
# The JSON fields that exist only to build network_module / network_args (the GUI writes none of
# them as a key of its TOML); the model checkboxes and split_mode are read, not consumed.
NETWORK_FIELDS = tuple(k for k in DEFAULTS if k not in (
    "split_mode", "flux1_checkbox", "sd3_checkbox", "hunyuan_image_checkbox",
    "anima_checkbox", "lumina_checkbox"))

# LoRA types of model families this toolkit does not train -> the GUI's model type
OTHER_FAMILY_TYPES = {"HunyuanImage-2.1": "HunyuanImage-2.1"}
OTHER_FAMILY_BOXES = {"hunyuan_image_checkbox": "HunyuanImage-2.1"}
# the LoRA types of one model type and the network module the GUI writes for each (lora_gui.py:
# rank / module dropout only)
FAMILY_LORA_TYPES = {"Anima": "networks.lora_anima", "Lumina": "networks.lora_lumina"}
# LyCORIS algorithms the GUI offers that stop here before any weight loads (the reason is in
# library/training/network_options.py LYCORIS_UNSUPPORTED, which the run's check reports: the
# supported lycoris-lora's kohya wrapper has no ia3). "LyCORIS/Native Fine-Tuning" (algo=full)
# trains (networks/lycoris_full.py).
LYCORIS_STOPS = {"LyCORIS/iA3": "ia3"}
KOHYA_LOHA_LOKR = ("Kohya LoHa", "Kohya LoKr")
# lora_gui.py's kohya_lora_var_list of Standard / Kohya LoCon / LoRA-FA (its signature's order)
BLOCK_VARS = ("down_lr_weight", "mid_lr_weight", "up_lr_weight", "block_lr_zero_threshold",
              "block_dims", "block_alphas", "conv_block_dims", "conv_block_alphas")
FLUX_VARS = ("img_attn_dim", "img_mlp_dim", "img_mod_dim", "single_dim", "txt_attn_dim",
             "txt_mlp_dim", "txt_mod_dim", "single_mod_dim", "in_dims",
             "train_double_block_indices", "train_single_block_indices")


class GuiNetworkError(UserError):
    pass


def loaded(fields: dict) -> dict:
    """The values the GUI holds once it has loaded ``fields`` (a null field keeps the default; a
    number field given as a string holds the number, an empty one its default; update_my_data
    renames the old LoRA_type "LoCon")."""
    d: dict = dict(DEFAULTS)
    d.update({k: v for k, v in fields.items() if v is not None})
    for k, default in DEFAULTS.items():
        if isinstance(default, (int, float)) and not isinstance(default, bool) and isinstance(d[k], str):
            if not d[k].strip():
                d[k] = default  # an empty number field: its default
                continue
            try:
                f = float(d[k])
            except ValueError:
                raise GuiNetworkError(f"{k}: expected a number (a field of the GUI's LoRA tab), got {d[k]!r}") from None
            d[k] = int(f) if f.is_integer() and "." not in d[k] else f
    if d["LoRA_type"] == "LoCon":
        d["LoRA_type"] = "LyCORIS/LoCon"
    return d


def _set_vars(d: dict, names) -> str:
    """lora_gui.py's `{key: value for key, value in vars().items() if key in names and value}`
    appended as " key=value"."""
    return "".join(f" {k}={d[k]}" for k in names if d[k])


def _dropouts(d: dict) -> str:
    """lora_gui.py append_rank_module_dropout_network_args."""
    out = ""
    for k in ("rank_dropout", "module_dropout"):
        if d[k] is not None and float(d[k]) > 0:
            out += f" {k}={d[k]}"
    return out


def _native_loha_lokr(d: dict, is_lokr: bool) -> str:
    """lora_gui.py build_native_loha_lokr_network_args: only the values that are not defaults."""
    parts = []
    if d["conv_dim"] is not None and float(d["conv_dim"]) > 0:
        parts.append(f"conv_dim={int(d['conv_dim'])}")
        a = d["conv_alpha"]
        if a is not None:
            parts.append(f"conv_alpha={int(a) if float(a) == int(a) else a}")
    if d["use_tucker"]:
        parts.append("use_tucker=True")
    if is_lokr and d["factor"] is not None and int(d["factor"]) != -1:
        parts.append(f"factor={int(d['factor'])}")
    parts += [p.strip() for p in _dropouts(d).split()]
    return (" " + " ".join(parts)) if parts else ""


def _lycoris(d: dict, t: str) -> str | None:
    """The lycoris.kohya branches of train_model (None: not a LyCORIS type)."""
    preset = f" preset={d['LyCORIS_preset']} conv_dim={d['conv_dim']} conv_alpha={d['conv_alpha']}"
    tail = (f" use_tucker={d['use_tucker']} rank_dropout={d['rank_dropout']} bypass_mode={d['bypass_mode']}"
            f" dora_wd={d['dora_wd']} module_dropout={d['module_dropout']}")
    if t == "LyCORIS/BOFT":
        return (f"{preset} module_dropout={d['module_dropout']} use_tucker={d['use_tucker']}"
                f" rank_dropout={d['rank_dropout']} rank_dropout_scale={d['rank_dropout_scale']} algo=boft"
                f" train_norm={d['train_norm']}")
    if t == "LyCORIS/Diag-OFT":
        return (f"{preset} module_dropout={d['module_dropout']} use_tucker={d['use_tucker']}"
                f" rank_dropout={d['rank_dropout']} rank_dropout_scale={d['rank_dropout_scale']}"
                f" constraint={d['constrain']} rescaled={d['rescaled']} algo=diag-oft train_norm={d['train_norm']}")
    if t == "LyCORIS/DyLoRA":
        return (f"{preset} use_tucker={d['use_tucker']} block_size={d['unit']} rank_dropout={d['rank_dropout']}"
                f' module_dropout={d["module_dropout"]} algo="dylora" train_norm={d["train_norm"]}')
    if t == "LyCORIS/GLoRA":
        return (f"{preset} use_tucker={d['use_tucker']} rank_dropout={d['rank_dropout']}"
                f" module_dropout={d['module_dropout']} rank_dropout_scale={d['rank_dropout_scale']}"
                f' algo="glora" train_norm={d["train_norm"]}')
    if t == "LyCORIS/iA3":
        return f"{preset} train_on_input={d['train_on_input']} algo=ia3"
    if t in ("LyCORIS/LoCon", "LyCORIS/LoHa"):
        algo = "locon" if t == "LyCORIS/LoCon" else "loha"
        return (f"{preset}{tail} use_tucker={d['use_tucker']} use_scalar={d['use_scalar']}"
                f" rank_dropout_scale={d['rank_dropout_scale']} algo={algo} train_norm={d['train_norm']}")
    if t == "LyCORIS/LoKr":
        return (f"{preset}{tail} factor={d['factor']} use_cp={d['use_cp']} use_scalar={d['use_scalar']}"
                f" decompose_both={d['decompose_both']} rank_dropout_scale={d['rank_dropout_scale']}"
                f" algo=lokr train_norm={d['train_norm']}")
    if t == "LyCORIS/Native Fine-Tuning":
        return (f" preset={d['LyCORIS_preset']} rank_dropout={d['rank_dropout']}"
                f" module_dropout={d['module_dropout']} rank_dropout_scale={d['rank_dropout_scale']}"
                f" algo=full train_norm={d['train_norm']}")
    return None


def _flux1(d: dict) -> str:
    # the GUI collects them in its signature's order: ggpo_* come before the FLUX.1 fields
    args = _set_vars(d, (("ggpo_sigma", "ggpo_beta") if d["train_lora_ggpo"] else ()) + FLUX_VARS)
    if d["split_mode"]:
        args += " train_blocks=single"  # the GUI forces it, whatever train_blocks says
    if d["split_qkv"]:
        args += " split_qkv=True"
    if d["train_t5xxl"] and d["flux1_checkbox"]:
        args += " train_t5xxl=True"
    return args + _dropouts(d)


def _module_and_args(d: dict) -> tuple[str | None, str]:
    t = d["LoRA_type"]
    lyco = _lycoris(d, t)
    if lyco is not None:
        return "lycoris.kohya", lyco
    if t == "Flux1":
        return "networks.lora_flux", _flux1(d)
    if t == "Flux1 OFT":
        return "networks.oft_flux", _set_vars(d, ("enable_all_linear",))
    if t in FAMILY_LORA_TYPES:
        return FAMILY_LORA_TYPES[t], _dropouts(d)
    if t in KOHYA_LOHA_LOKR:
        return ("networks.lokr" if t == "Kohya LoKr" else "networks.loha"), _native_loha_lokr(d, t == "Kohya LoKr")
    if t in ("Standard", "Kohya LoCon"):
        args = f' conv_dim="{d["conv_dim"]}" conv_alpha="{d["conv_alpha"]}"' if t == "Kohya LoCon" else ""
        module = "networks.lora_sd3" if d["sd3_checkbox"] else "networks.lora"
        return module, args + _set_vars(d, (*BLOCK_VARS, "rank_dropout", "module_dropout"))
    if t == "LoRA-FA":
        return "networks.lora_fa", _set_vars(d, (*BLOCK_VARS, "rank_dropout", "module_dropout"))
    if t == "Kohya DyLoRA":
        return "networks.dylora", _set_vars(d, ("conv_dim", "conv_alpha", *BLOCK_VARS, "unit", "rank_dropout",
                                                "module_dropout"))
    return None, ""


def _gui_refusal(d: dict) -> str | None:
    """The combinations lora_gui.py train_model refuses before it writes the TOML."""
    t = d["LoRA_type"]
    if d["flux1_checkbox"] and t not in ("Flux1", "Flux1 OFT") and "LyCORIS" not in t:
        return "the GUI requires LoRA type Flux1, Flux1 OFT or a LyCORIS type with its Flux1 checkbox"
    if t in KOHYA_LOHA_LOKR and (d["flux1_checkbox"] or d["sd3_checkbox"] or d["lumina_checkbox"]):
        return "the GUI runs it with SDXL or Anima only, not with Flux1, SD3 or Lumina"
    if d["anima_checkbox"] != (t == "Anima") and t not in KOHYA_LOHA_LOKR:
        return ("the GUI requires LoRA type Anima (or Kohya LoHa / LoKr) with its Anima checkbox, and that "
                "checkbox with LoRA type Anima")
    if d["lumina_checkbox"] != (t == "Lumina"):
        return "the GUI requires LoRA type Lumina with its Lumina checkbox, and that checkbox with LoRA type Lumina"
    return None


def gui_network(fields: dict) -> tuple[str | None, list[str], list[str]]:
    d = loaded(fields)
    t = d["LoRA_type"]
    notes = []
    family = OTHER_FAMILY_TYPES.get(t) or next((f for k, f in OTHER_FAMILY_BOXES.items() if d[k]), None)
    if family:
        return None, [], [f"LoRA_type {t!r}: network_module not set; a LoRA of the GUI's {family} model type, "
                          f"which this toolkit does not train (it trains {registry.titles()})"]
    module, args = _module_and_args(d)
    if module is None:
        return None, [], [f"LoRA_type {t!r}: not a LoRA type of the kohya_ss GUI (v26); network_module not set"]
    args += "".join(f" {k}={d[k]}" for k in ("loraplus_lr_ratio", "loraplus_unet_lr_ratio",
                                              "loraplus_text_encoder_lr_ratio") if d[k])
    refusal = _gui_refusal(d)
    if refusal:
        notes.append(f"LoRA_type {t!r}: translated, but {refusal}")
    if t in LYCORIS_STOPS:
        notes.append(f"LoRA_type {t!r}: translated (algo={LYCORIS_STOPS[t]}), but a run stops on it here before "
                     "any weight loads: the supported lycoris-lora cannot train it (docs/KOHYA_GUI.md, LoRA types)")
    if t == "Flux1" and d["train_lora_ggpo"]:
        notes.append("train_lora_ggpo: written as network_args ggpo_sigma / ggpo_beta as the GUI does, but "
                     "networks.lora_flux refuses them here (sd-scripts' LoRA-GGPO is not built)")
    return module, str(args).replace('"', "").split(), notes
