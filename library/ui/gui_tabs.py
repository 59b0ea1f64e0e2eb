"""The DreamBooth and fine-tune tabs' own rules: the keys kohya_gui/dreambooth_gui.py and
kohya_gui/finetune_gui.py ``train_model`` (kohya_ss v26) compute from the saved fields rather than
copy, applied to the GUI's saved JSON before library/ui/gui_import.py reads it.

    tab_fields(d, tab, notes)   # d: the saved fields, changed in place; tab: "dreambooth" / "finetune"

- text encoder rates: ``learning_rate_te`` for SD1/SD2, ``learning_rate_te1`` / ``learning_rate_te2``
  for SDXL (written only with the SDXL box ticked; a 0 rate is written and leaves that encoder
  untrained); SD3 / FLUX.1 get ``learning_rate_te``, which sd3_train.py / flux_train.py do not read
  (dropped, noted);
- DreamBooth with SDXL: ``train_text_encoder`` is whether te1 or te2 is above 0; without SDXL the tab
  does not write it;
- DreamBooth ``stop_text_encoder_training``: the field is labelled "% of total steps" but the tab
  writes its value unchanged, which train_db.py reads as a step count (kept as such, noted); -1
  leaves train_db.py's text encoder untrained (-> ``train_text_encoder = false``); SDXL / SD3 /
  FLUX.1 scripts do not read it (dropped, noted); the fine-tune tab never writes it;
- fine-tune: ``train_data_dir`` is the image folder field, ``in_json`` is
  ``<train_dir>/<latent or caption metadata file>`` (``use_latent_files``), ``enable_bucket`` is
  always on, ``vae`` is not written; the metadata the GUI prepares before training
  (merge_captions_to_metadata.py, prepare_buckets_latents.py) is noted, as is the halving of the
  computed steps with ``flip_aug``; FLUX.1 has no ``train_text_encoder`` (flux_train.py).
"""
from __future__ import annotations

from library.models.families import registry
from library.models.families.base import Family

# finetune_gui.py's Dataset Preparation fields (their defaults), read for in_json
FT_DEFAULTS = dict(train_dir="", use_latent_files="Yes", caption_metadata_filename="meta_cap.json",
                   latent_metadata_filename="meta_lat.json")
# its preparation steps (the saved names, then train_model's names), their default: on
FT_PREP = (("create_caption", "generate_caption_database"), ("create_buckets", "generate_image_buckets"))
FT_PREP_ONLY = ("full_path", "batch_size")  # settings of the preparation scripts alone
TE_RATE_DEFAULT = 1e-5  # the tabs' learning rate fields' default (BasicTraining(learning_rate_value=1e-5))
# finetune_gui.py's widgets a file may lack: the value the GUI keeps then
FT_WIDGETS = dict(train_text_encoder=True, dataset_repeats=40)


def gui_float(v) -> float:
    """A field the GUI loads as a number (old presets hold strings); unreadable or empty: 0."""
    try:
        return float(v or 0)
    except (TypeError, ValueError):
        return 0.0


def family(d: dict) -> Family:
    """The family whose script the tab runs (train_model's run_cmd order: sdxl, sd3, flux, else
    the SD model type, whose fields are SD1's and SD2's alike)."""
    default = next(f for f in registry.FAMILIES.values() if not f.gui_boxes)
    return registry.for_gui(d) or default


def _te_rates(d: dict, fam: Family, tab: str, notes: list) -> None:
    rates = {k: d.pop(k, TE_RATE_DEFAULT) for k in ("learning_rate_te", "learning_rate_te1", "learning_rate_te2")}
    for k in fam.gui_te_rates:
        if rates[k] is not None and rates[k] != "":
            d[k] = rates[k]
    if fam.gui_db_text_encoder and tab == "dreambooth":  # dreambooth_gui.py: the rates decide, not a checkbox
        on = any(gui_float(rates[k]) > 0 for k in fam.gui_te_rates)
        if bool(d.get("train_text_encoder")) != on:
            notes.append(f"train_text_encoder: the GUI's {fam.title} DreamBooth trains the text encoders when "
                         f"{' or '.join(fam.gui_te_rates)} is above 0 -> {str(on).lower()}")
        d["train_text_encoder"] = on
    if "learning_rate_te" not in fam.gui_te_rates and gui_float(rates["learning_rate_te"]) and fam.flow is not None:
        notes.append(f"learning_rate_te: dropped; the GUI writes it for {fam.title} but "
                     f"{fam.gui_script} does not read it")


def _stop_te(d: dict, fam: Family, tab: str, notes: list) -> None:
    v = gui_float(d.pop("stop_text_encoder_training", 0))
    if not v:
        return
    n = int(v)
    if tab == "finetune":
        notes.append("stop_text_encoder_training: dropped; the fine-tune tab does not write it")
    elif fam.gui_boxes:  # another model type's script
        script = fam.gui_script
        notes.append(f"stop_text_encoder_training: dropped; the GUI writes it but {script} does not read it")
    elif n < 0:
        d["train_text_encoder"] = False
        notes.append(f"stop_text_encoder_training: {n}: sd-scripts' train_db.py then leaves the text "
                     "encoder untrained -> train_text_encoder = false")
    else:
        d["stop_text_encoder_training"] = n
        notes.append(f"stop_text_encoder_training: the GUI's field reads \"% of total steps\" but "
                     f"dreambooth_gui.py writes {n} unchanged, a step count for train_db.py: the text "
                     f"encoder trains the first {n} steps")


def _finetune(d: dict, fam: Family, notes: list) -> None:
    f = {k: d.pop(k, default) for k, default in FT_DEFAULTS.items()}
    for k, v in FT_WIDGETS.items():
        d.setdefault(k, v)
    if "image_folder" in d:  # finetune_gui.py: "train_data_dir": image_folder
        d["train_data_dir"] = d.pop("image_folder")
    d["enable_bucket"] = True  # finetune_gui.py writes it always on
    if d.pop("vae", None):
        notes.append("vae: dropped; the fine-tune tab does not write it (the model's own VAE is used)")
    steps = [bool(d.pop(old, True) if old in d else d.pop(new, True)) for old, new in FT_PREP]
    for k in FT_PREP_ONLY:
        d.pop(k, None)
    if not fam.full_trains_text_encoders and d.pop("train_text_encoder", False):
        notes.append(f"train_text_encoder: dropped; {fam.gui_script} does not train the text encoders")
    computed = "max_train_steps" in d and not gui_float(d["max_train_steps"]) and not gui_float(d.get("max_train_epochs"))
    if d.get("flip_aug") and computed:
        notes.append("flip_aug: the GUI halves the steps it computes from the epochs (as if flipping doubled "
                     "the images); here every epoch is trained")
    name = f["latent_metadata_filename" if f["use_latent_files"] == "Yes" else "caption_metadata_filename"]
    if d.get("dataset_config") or d.get("in_json"):
        return  # the dataset config's subsets (sd-scripts reads no in_json then), or a file given
    if not f["train_dir"]:
        notes.append(f"train_dir: empty; the GUI would read the metadata /{name} -> in_json not set")
        return
    d["in_json"] = f"{f['train_dir']}/{name}"
    what = []
    if steps[0]:
        what.append("the caption metadata from the image folder's caption files "
                    "(sd-scripts' finetune/merge_captions_to_metadata.py)")
    if steps[1]:
        what.append("the bucket / latent metadata (finetune/prepare_buckets_latents.py)")
    if what:
        notes.append(f"in_json: {d['in_json']}; the GUI writes {' and '.join(what)} before training, which "
                     "this toolkit does not: run it first (buckets and latents come from enable_bucket / "
                     "cache_latents here)")


def tab_fields(d: dict, tab: str, notes: list) -> None:
    fam = family(d)
    for k in ("cache_text_encoder_outputs", "cache_text_encoder_outputs_to_disk", "no_half_vae",
              *(("fused_backward_pass",) if fam.flow is not None else ()),
              *(("dataset_repeats",) if tab == "dreambooth" else ())):
        d.pop(k, None)  # the tabs write these from the model types' own fields (or not at all)
    if tab == "dreambooth" and not fam.gui_db_text_encoder:
        d.pop("train_text_encoder", None)  # dreambooth_gui.py: `train_text_encoder if sdxl else None`
    _te_rates(d, fam, tab, notes)
    _stop_te(d, fam, tab, notes)
    if tab == "finetune":
        _finetune(d, fam, notes)
