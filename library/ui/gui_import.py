"""A kohya_ss GUI config (the TOML it writes for a run, or the JSON it saves / ships as a preset)
-> a run TOML of this toolkit, with one note per key that is dropped or means something
different here.

    import_config(text, script) -> (toml_text, notes)

Each key is classified by the schema's own tables (library/config/options.py: OPTIONS, ALIASES,
SD_SCRIPTS_NAMES, GUI_KEYS), the same tables the parser and docs/KOHYA_GUI.md use:
- an option of ``script``: kept (aliases under the option's name), with the GUI table's note when
  it has one;
- an sd-scripts option or GUI-only key with no effect here: dropped, noted with why;
- one that cannot be honoured (another model family, an unsupported feature): dropped when unset,
  else dropped and noted, so that the rest still imports and the user sees what is missing;
- an unknown key: dropped, noted with the closest option name.
The GUI's saved JSON (every field of its form) is first turned into the keys the GUI writes
when it writes the TOML (kohya_gui/lora_gui.py ``train_model``, kohya_ss v26):
- its field names for a few keys (``optimizer``, ``max_resolution``, ``lr_warmup`` in percent,
  ``xformers`` as a choice, ``lora_network_weights``);
- ``LoRA_type`` with its LyCORIS / LoRA / FLUX.1 fields (LyCORIS_preset, conv_dim, factor,
  use_tucker, dropouts, block dims, LoRA+ ratios, split_qkv, img_attn_dim, ...) ->
  ``network_module`` and ``network_args`` (library/ui/gui_network.py; Anima -> networks.lora_anima,
  Lumina -> networks.lora_lumina); a type of a model family not trained here (HunyuanImage-2.1)
  is a note;
- the FLUX.1 / SD3 / SDXL / Anima / Lumina fields, each written under its TOML key only with its
  model type checked (``sd3_clip_l`` -> ``clip_l``, ``flux1_cache_text_encoder_outputs`` ->
  ``cache_text_encoder_outputs``, ``anima_qwen3`` -> ``qwen3``, ``lumina_ae`` -> ``ae``, ...; where
  several types write one key, Lumina's value wins over Anima's over FLUX.1's, as the GUI's
  conditionals); the keys the GUI leaves out for Anima and Lumina (``clip_skip``,
  ``max_token_length``) are dropped; the model checkboxes themselves are dropped (the family is
  read from the weights);
- the LoRA tab's text encoder / U-Net / T5-XXL rates -> ``text_encoder_lr`` (one per encoder),
  ``unet_lr``, ``network_train_unet_only`` / ``network_train_text_encoder_only``;
- the DreamBooth / fine-tune tab's own rules for ``train_dreambooth`` / ``finetune``
  (library/ui/gui_tabs.py: text encoder rates per family, ``stop_text_encoder_training``, the
  fine-tune tab's ``in_json`` and image folder);
- ``max_train_steps`` 0: the GUI trains ``epoch`` epochs (it counts their steps from the image
  folders) -> ``max_train_epochs``; a missing ``max_resolution`` / ``max_train_steps`` is the
  GUI's default;
- a number held as a string (older presets) is the number the GUI's field loads; the keys every
  tab writes as ``value if value != 0 else None`` are unset at 0, and the LoRA tab's filter drops
  any "", false or 0.
"""
from __future__ import annotations

import difflib
import json
import tomllib

import toml

from library.config.options import (ALIASES, GUI_KEYS_BY_NAME, GUI_ONLY, OPTIONS_BY_NAME,
                                    SD_SCRIPTS_BY_NAME)
from library.errors import UserError
from library.models.families import registry
from library.ui.gui_network import NETWORK_FIELDS, OTHER_FAMILY_BOXES, gui_network
from library.ui.gui_tabs import gui_float, tab_fields

DATASET_KEYS = ("general", "datasets")
# the GUI's model-type boxes of the families trained here (each family's gui_boxes)
GUI_BOXES = tuple(k for f in registry.FAMILIES.values() for k in f.gui_boxes)
# (the model type checkboxes that write it, its field in the GUI's JSON, the TOML key written)
MODEL_TYPE_FIELDS = tuple(
    (boxes, src, key or src) for boxes, names in (
        ("flux1_checkbox", "ae split_mode t5xxl_max_token_length guidance_scale mem_eff_save "
                           "apply_t5_attn_mask cpu_offload_checkpointing single_blocks_to_swap "
                           "double_blocks_to_swap fp8_base_unet discrete_flow_shift model_prediction_type "
                           "timestep_sampling clip_l t5xxl model_type blockwise_fused_optimizers "
                           "flux1_cache_text_encoder_outputs:cache_text_encoder_outputs "
                           "flux1_cache_text_encoder_outputs_to_disk:cache_text_encoder_outputs_to_disk "
                           "flux_fused_backward_pass:fused_backward_pass"),
        ("sd3_checkbox", "sd3_clip_l:clip_l sd3_t5xxl:t5xxl clip_g clip_g_dropout_rate "
                         "sd3_clip_l_dropout_rate:clip_l_dropout_rate "
                         "sd3_enable_scaled_pos_embed:enable_scaled_pos_embed logit_mean logit_std mode_scale "
                         "pos_emb_random_crop_rate save_clip save_t5xxl sd3_t5_dropout_rate:t5_dropout_rate "
                         "t5xxl_device t5xxl_dtype sd3_text_encoder_batch_size:text_encoder_batch_size "
                         "weighting_scheme sd3_disable_mmap_load_safetensors:disable_mmap_load_safetensors "
                         "sd3_fused_backward_pass:fused_backward_pass "
                         "sd3_cache_text_encoder_outputs:cache_text_encoder_outputs "
                         "sd3_cache_text_encoder_outputs_to_disk:cache_text_encoder_outputs_to_disk"),
        ("flux1_checkbox sd3_checkbox anima_checkbox lumina_checkbox",
         "blocks_to_swap show_timesteps show_timesteps_resolution"),
        ("sdxl", "sdxl_cache_text_encoder_outputs:cache_text_encoder_outputs sdxl_no_half_vae:no_half_vae"),
        # class_anima.py's fields (lora_gui.py / finetune_gui.py: ``anima_vae if anima_checkbox``
        # replaces the general vae field; attn_mode only when not "torch", the compile settings only
        # with anima_compile, compile_dynamic only when not "auto": _anima_fields)
        ("anima_checkbox", "anima_qwen3:qwen3 anima_vae:vae anima_llm_adapter_path:llm_adapter_path "
                           "anima_t5_tokenizer_path:t5_tokenizer_path anima_discrete_flow_shift:discrete_flow_shift "
                           "anima_timestep_sampling:timestep_sampling anima_sigmoid_scale:sigmoid_scale "
                           "anima_qwen3_max_token_length:qwen3_max_token_length "
                           "anima_t5_max_token_length:t5_max_token_length anima_attn_mode:attn_mode "
                           "anima_split_attn:split_attn anima_vae_chunk_size:vae_chunk_size "
                           "anima_vae_disable_cache:vae_disable_cache "
                           "anima_unsloth_offload_checkpointing:unsloth_offload_checkpointing "
                           "anima_qwen_image_vae_2d:qwen_image_vae_2d anima_compile:compile "
                           "anima_torch_compile:torch_compile anima_compile_backend:compile_backend "
                           "anima_compile_mode:compile_mode anima_compile_dynamic:compile_dynamic "
                           "anima_compile_fullgraph:compile_fullgraph "
                           "anima_compile_cache_size_limit:compile_cache_size_limit "
                           "anima_cache_text_encoder_outputs:cache_text_encoder_outputs "
                           "anima_cache_text_encoder_outputs_to_disk:cache_text_encoder_outputs_to_disk"),
        # class_lumina.py's fields (after Anima's: the GUI's `lumina_... if lumina_checkbox else anima_...`)
        ("lumina_checkbox", "lumina_gemma2:gemma2 lumina_ae:ae lumina_discrete_flow_shift:discrete_flow_shift "
                            "lumina_model_prediction_type:model_prediction_type "
                            "lumina_timestep_sampling:timestep_sampling lumina_sigmoid_scale:sigmoid_scale "
                            "lumina_gemma2_max_token_length:gemma2_max_token_length "
                            "lumina_system_prompt:system_prompt lumina_use_flash_attn:use_flash_attn "
                            "lumina_use_sage_attn:use_sage_attn "
                            "lumina_cache_text_encoder_outputs:cache_text_encoder_outputs "
                            "lumina_cache_text_encoder_outputs_to_disk:cache_text_encoder_outputs_to_disk"),
    )
    for src, _, key in (n.partition(":") for n in names.split()))
# lora_gui.py's DEFAULT_TEXT_ENCODER_LR, DEFAULT_UNET_LR and its T5-XXL rate's default
LORA_RATE_DEFAULTS = (("text_encoder_lr", 0.0001), ("unet_lr", 0.0001), ("t5xxl_lr", 0.0))
# the keys every tab writes as `value if value != 0 else None` (lora_gui.py, dreambooth_gui.py,
# finetune_gui.py config_toml_data) whose default here is not None
ZERO_IS_UNSET = ("vae_batch_size", "clip_skip", "max_timestep", "min_timestep", "seed")
GUI_RESOLUTION = "512,512"  # the GUI's max_resolution field (class_basic_training.py)
GUI_MAX_TRAIN_STEPS = 1600  # the GUI's max_train_steps field (class_basic_training.py)
# the DreamBooth / fine-tune tabs' rates: their filter keeps a 0 (that encoder is not trained)
ZERO_KEPT = ("text_encoder_lr", "learning_rate_te1", "learning_rate_te2")
# the tab whose saved JSON each script imports (the LoRA tab's is told by its LoRA_type)
SCRIPT_TABS = {"train_dreambooth": "dreambooth", "finetune": "finetune"}
TAB_LETTERS = {"dreambooth": "d", "finetune": "f"}  # GuiKey.tabs
NUMBER_TYPES = ("int", "float", "float_or_list", "steps_or_fraction")
OR_KEYS = ("cache_text_encoder_outputs", "cache_text_encoder_outputs_to_disk", "fused_backward_pass")
OTHER_FAMILY_PREFIXES = ("hunyuan_",)
# keys the LoRA and fine-tune tabs leave out with these model types checked (lora_gui.py,
# finetune_gui.py config_toml_data: `clip_skip if ... not anima_checkbox and not lumina_checkbox`)
GUI_OMITTED = (("anima_checkbox lumina_checkbox", "clip_skip max_token_length"),)
# class_anima.py: written only when set off these values (attn_mode "torch", compile_dynamic "auto")
# or with anima_compile on (the compile_* settings)
ANIMA_UNWRITTEN = (("attn_mode", "torch"), ("compile_dynamic", "auto"))
ANIMA_COMPILE = ("compile_backend", "compile_mode", "compile_dynamic", "compile_fullgraph", "compile_cache_size_limit")


class ImportError_(UserError):
    pass


def _unset(v) -> bool:
    """The GUI's "not set": an empty string, None or false."""
    return v is None or v is False or v == ""


def _written_model_type(value) -> bool:
    """The GUI writes model_type only for a family its box does not select by default (kohya_gui's
    lora_gui.py: Chroma beside FLUX.1 on the flux1 box, "only emit for chroma"): the value is the
    model_type of a family that shares a box with a lower-ranked one."""
    fam = next((f for f in registry.FAMILIES.values() if f.model_type and f.model_type == value), None)
    return fam is not None and any(g.gui_rank < fam.gui_rank and set(g.gui_boxes) & set(fam.gui_boxes)
                                   for g in registry.FAMILIES.values())


def _model_type_fields(d: dict) -> None:
    """The fields of one model type (FLUX.1, SD3, SDXL, and the families not trained here): the GUI
    writes each, under its TOML key, only with that type checked (lora_gui.py config_toml_data,
    ``... if flux1_checkbox else None``); a flag several types set is true when one of them is."""
    # a family's type is checked when any of its boxes is (SDXL: sdxl or sdxl_checkbox), named by its first
    checked = {f.gui_boxes[0]: any(bool(d.get(k)) for k in f.gui_boxes)
               for f in registry.FAMILIES.values() if f.gui_boxes}
    pulled = {src: d.pop(src) for _, src, _ in MODEL_TYPE_FIELDS if src in d}
    for boxes, src, key in MODEL_TYPE_FIELDS:
        if src not in pulled or not any(checked[b] for b in boxes.split()):
            continue
        if key in OR_KEYS:
            d[key] = bool(d.get(key)) or bool(pulled[src])
        elif src != "model_type" or _written_model_type(pulled[src]):
            d[key] = pulled[src]
    for boxes, keys in GUI_OMITTED:
        if any(bool(d.get(b)) for b in boxes.split()):
            for k in keys.split():
                d.pop(k, None)
    if d.get("anima_checkbox"):
        _anima_fields(d)
    for k in [k for k in d if k.startswith(OTHER_FAMILY_PREFIXES) and k not in OTHER_FAMILY_BOXES]:
        del d[k]  # the fields of HunyuanImage (its checkbox is noted)


def _anima_fields(d: dict) -> None:
    """The Anima keys the GUI writes only when they differ from class_anima.py's defaults or with
    its per-block compile on."""
    for k, default in ANIMA_UNWRITTEN:
        if d.get(k) == default:
            del d[k]
    if not d.get("compile"):
        for k in ANIMA_COMPILE:
            d.pop(k, None)


def _gui_number(text: str):
    """A number the GUI's JSON holds as a string (old presets: "1", "0.0001"): the number its
    number field loads it as (int when integral); None for an empty or unreadable one, which the
    GUI loads as 0 (common_gui.update_my_data)."""
    try:
        f = float(text)
    except ValueError:
        return None
    return int(f) if f.is_integer() else f


def _epochs(d: dict, notes: list) -> None:
    """With max_train_steps 0 and no dataset config the GUI computes the steps of ``epoch`` epochs
    from its image folders (images x repeats / batch / accumulation x epoch, x 2 with
    regularisation images): here that is max_train_epochs."""
    if "max_train_steps" not in d:  # an older preset: the GUI's field keeps its default
        d["max_train_steps"] = GUI_MAX_TRAIN_STEPS
        notes.append(f"max_train_steps: not in the file; the GUI's default {GUI_MAX_TRAIN_STEPS}")
    steps, epochs = (_gui_number(str(d.get(k) or 0)) or 0 for k in ("max_train_steps", "max_train_epochs"))
    n = 1 if d.get("epoch") is None else _gui_number(str(d["epoch"]) or "0") or 0  # (the GUI's default: 1)
    if steps == 0 and epochs == 0 and n > 0 and not d.get("dataset_config"):
        d.pop("epoch", None)
        d["max_train_epochs"] = n
        notes.append(f"epoch: max_train_steps is 0, so the GUI trains {n} epoch(s) (it counts their steps from "
                     f"the image folders) -> max_train_epochs = {n}")


def _lora_rates(d: dict) -> None:
    """The LoRA tab's text encoder / U-Net / T5-XXL rates -> the keys lora_gui.py writes: a rate of
    0 leaves that part untrained (network_train_unet_only / _text_encoder_only), the text encoder
    rate is one per encoder (T5-XXL's own when set)."""
    rates = []
    for k, default in LORA_RATE_DEFAULTS:
        v = d.pop(k, None)
        rates.append(default if v is None else gui_float(v))  # a missing field: the GUI's default
    te, unet, t5 = rates
    d["network_train_unet_only"] = te == 0 and unet != 0
    d["network_train_text_encoder_only"] = te != 0 and unet == 0
    if te > 0:
        d["text_encoder_lr"] = [te, t5 if t5 > 0 else te]
    if unet != 0:
        d["unet_lr"] = unet


def _json_fields(d: dict, tab: str | None, notes: list) -> dict:
    """The GUI's saved field names -> the TOML keys it writes for them (``tab``: the DreamBooth
    or fine-tune tab's own rules, library/ui/gui_tabs.py)."""
    d = dict(d)
    if tab is not None:
        tab_fields(d, tab, notes)
    if "optimizer" in d:
        d["optimizer_type"] = d.pop("optimizer")
    if d.get("max_resolution") is None and not d.get("dataset_config"):
        d["max_resolution"] = GUI_RESOLUTION  # a preset without it: the GUI's field default
        notes.append(f"max_resolution: not in the file; the GUI's default {GUI_RESOLUTION} -> resolution")
    if "max_resolution" in d:
        d["resolution"] = d.pop("max_resolution")
    if "lr_warmup" in d:
        pct = gui_float(d.pop("lr_warmup"))
        if pct and not d.get("lr_warmup_steps"):
            d["lr_warmup_steps"] = pct / 100  # a fraction of all steps, as the GUI computes
            notes.append(f"lr_warmup: {pct:g} % of the steps -> lr_warmup_steps = {pct / 100:g}")
    _epochs(d, notes)
    if "xformers" in d and isinstance(d["xformers"], str):
        choice = d.pop("xformers")
        if choice == "xformers":
            d["xformers"] = True
        elif choice == "sdpa":
            d["sdpa"] = True
    if d.get("LoRA_type"):
        _lora_rates(d)
        module, args, net_notes = gui_network(d)
        notes += net_notes
        for k in ("LoRA_type", *NETWORK_FIELDS):
            d.pop(k, None)
        if module:
            d["network_module"] = module
        if args:
            d["network_args"] = args
    _model_type_fields(d)
    for k in GUI_BOXES:
        if k in d and (d.pop(k) or k.startswith("sdxl")):
            notes.append(f"{k}: dropped; the model family is read from the weights")
    for k, family in OTHER_FAMILY_BOXES.items():
        if d.pop(k, None):
            notes.append(f"{k}: dropped; the GUI's {family} model type is not trained here")
    if "lora_network_weights" in d:
        d["network_weights"] = d.pop("lora_network_weights")
    return d


def import_config(text: str, script: str) -> tuple[str, list[str]]:
    text = text.strip()
    if not text:
        raise ImportError_("text: empty; paste a kohya_ss GUI config (JSON or TOML)")
    notes: list[str] = []
    from_json = text.startswith("{")
    lora_tab = False  # the LoRA tab's saved JSON
    tab = None  # the DreamBooth / fine-tune tab's saved JSON
    if from_json:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ImportError_(f"text: invalid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ImportError_("text: expected a JSON object of GUI fields")
        lora_tab = bool(data.get("LoRA_type"))
        tab = None if lora_tab else SCRIPT_TABS.get(script)
        data = _json_fields(data, tab, notes)
    else:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ImportError_(f"text: invalid TOML: {e}") from None
    flat: dict = {}
    for key, value in data.items():
        if key in DATASET_KEYS:
            continue
        if isinstance(value, dict) and not (OPTIONS_BY_NAME.get(ALIASES.get(key, key))
                                            and OPTIONS_BY_NAME[ALIASES.get(key, key)].type.startswith("kv")):
            flat.update(value)  # a free-form grouping table ([model_arguments], ...)
        else:
            flat[key] = value
    out: dict = {}
    for key, value in flat.items():
        name = ALIASES.get(key, key)
        gui = GUI_KEYS_BY_NAME.get(key)
        if tab and gui is not None and TAB_LETTERS[tab] not in gui.tabs:
            continue  # a field of the form that this tab does not write (finetune_gui.py: max_grad_norm, ...)
        if name in OPTIONS_BY_NAME:
            opt = OPTIONS_BY_NAME[name]
            if _unset(value) and opt.type in ("path", "str", "path_list") or value is None or \
                    tab and value == "":
                continue  # the GUI's empty field (the DreamBooth / fine-tune tabs drop every "")
            if from_json and opt.type in NUMBER_TYPES and isinstance(value, str):
                value = _gui_number(value)  # the GUI's number field holds a number
                if value is None:
                    continue
            if from_json and value == 0 and not isinstance(value, bool) and (opt.default is None or
                                                                            name in ZERO_IS_UNSET) \
                    and not (tab and name in ZERO_KEPT):
                continue  # the GUI writes its 0 fields as unset (`value or None`)
            if lora_tab and value in ("", False, None):
                continue  # lora_gui.py's filter `value not in ["", False, None]` (0 == False)
            if script not in opt.scripts:
                notes.append(f"{key}: dropped; not an option of {script} (it applies to: "
                             f"{', '.join(opt.scripts)})")
                continue
            if opt.cli_only:
                notes.append(f"{key}: dropped; command line only")
                continue
            out[name] = value
            if key != name:
                notes.append(f"{key}: written as {name}")
            if gui is not None and gui.why and not (from_json and key == "network_args"):  # ours
                notes.append(f"{key}: {gui.why}")
        elif name in SD_SCRIPTS_BY_NAME:
            entry = SD_SCRIPTS_BY_NAME[name]
            off = value in entry.off or _unset(value) or value == []
            if not off:
                what = "no effect here" if entry.action == "ignore" else "not supported yet"
                notes.append(f"{key}: dropped; {what} ({entry.why})")
        elif key in GUI_ONLY:
            gui_only = GUI_ONLY[key]
            if not _unset(value) and not (isinstance(value, (int, float)) and value == 0):
                what = "no effect" if gui_only.action == "ignore" else "cannot be used here"
                notes.append(f"{key}: dropped; {what} ({gui_only.why})")
        else:
            if from_json and (_unset(value) or value == 0):
                continue  # a GUI form field left empty (the GUI's JSON holds every field)
            cands = list(OPTIONS_BY_NAME) + list(ALIASES)
            hint = difflib.get_close_matches(key, cands, n=1, cutoff=0.6)
            notes.append(f"{key}: dropped; unknown key" + (f" (did you mean {hint[0]}?)" if hint else ""))
    for k in DATASET_KEYS:
        if k in data:
            out[k] = data[k]
    return toml.dumps(out), notes
