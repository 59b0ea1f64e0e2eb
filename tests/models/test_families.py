"""The family registry (library/models/families/) and the method kinds (library/config/method_kinds.py):
every family declares every capability, consistently with the code that uses it; shown to fail
on planted violations (issue 38 items 1 and 2)."""
from __future__ import annotations

import dataclasses
import importlib
import os
import typing

import diffusers
import pytest
import torch

from library.config import method_kinds
from library.config.options import GUI_KEYS_BY_NAME, METHOD_OF_SCRIPT, OPTIONS_BY_NAME
from library.models import fake_parts, loading
from library.models.families import base, registry
from library.run import run_checks
from library.training import flow_matching, flow_sampling, methods
from library.ui import gui_import
from tests.helpers import make_opts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOMES = os.path.join(ROOT, "library", "models", "families")
# every built-in model -> its family, from the loaders' own tables (not from the registry): the SD
# loader's, and each home's BUILTIN_NAMES (the names its builders take)
BUILTIN_FAMILY = {**{n: loading.FAMILY_OF_ARCH[a] for t in (loading.TINY_BUILTINS, loading.ARCH_BUILTINS)
                     for n, a in t.items()},
                  **{n: f.name for f in registry.FAMILIES.values()
                     for n in importlib.import_module(f.home).BUILTIN_NAMES}}
SHARED_FOLDERS = ("sd_common",)  # the SD families' shared hooks (each family's home.py uses them)
MODEL_TYPE_BOXES = {b for boxes, _, _ in gui_import.MODEL_TYPE_FIELDS for b in boxes.split()}


def _type_ok(value, hint) -> bool:
    origin = typing.get_origin(hint)
    if hint is typing.Any or hint is object:
        return True
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_type_ok(v, args[0]) for v in value)
        return len(value) == len(args) and all(_type_ok(v, a) for v, a in zip(value, args))
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, origin or hint)


def problems(fam: base.Family) -> list[str]:
    """What is wrong with one family's declaration (empty: every hook declared and consistent)."""
    out = []
    for cls, obj in ((base.Family, fam), *(((base.FlowSpec, fam.flow),) if fam.flow is not None else ())):
        hints = typing.get_type_hints(cls, vars(base))
        for f in dataclasses.fields(cls):
            if not _type_ok(getattr(obj, f.name), hints[f.name]):
                out.append(f"{fam.name}: {f.name} = {getattr(obj, f.name)!r} is not {hints[f.name]}")
    if len(fam.text_encoder_components) != len(fam.text_encoder_names) or not fam.text_encoder_names:
        out.append(f"{fam.name}: text_encoder_components and text_encoder_names differ in length")
    if fam.lora_module not in fam.network_modules:
        out.append(f"{fam.name}: lora_module {fam.lora_module} is not one of its network_modules")
    if (fam.pipelines is None) != (fam.flow is not None):
        out.append(f"{fam.name}: samples with a diffusers pipeline or the flow sampler, exactly one")
    for name in fam.pipelines or ():
        if not hasattr(diffusers, name):
            out.append(f"{fam.name}: diffusers has no {name}")
    for table in ("unsupported", "no_effect"):
        for name, why in getattr(fam, table).items():
            if name not in OPTIONS_BY_NAME or not why:
                out.append(f"{fam.name}: {table} names {name!r}, not an option with a reason")
    if set(fam.unsupported) & set(fam.no_effect):
        out.append(f"{fam.name}: an option both refused and warned")
    for opt in (fam.autoencoder_option, *fam.single_file_parts):
        if opt not in OPTIONS_BY_NAME:
            out.append(f"{fam.name}: {opt!r} is not an option")
    for key in fam.gui_te_rates:
        if key not in GUI_KEYS_BY_NAME:
            out.append(f"{fam.name}: GUI key {key!r} unknown to options.GUI_KEYS")
    # the GUI's model-type boxes: a family's first box selects its fields in the GUI import
    if fam.gui_boxes and fam.gui_boxes[0] not in MODEL_TYPE_BOXES:
        out.append(f"{fam.name}: GUI box {fam.gui_boxes[0]!r} selects no model-type fields (gui_import)")
    if not fam.tiny_models or any(BUILTIN_FAMILY.get(n) != fam.name for n in (*fam.tiny_models, *fam.arch_models)):
        out.append(f"{fam.name}: tiny_models {fam.tiny_models} / arch_models {fam.arch_models} are not all its "
                   "built-in models")
    # its hooks (base.HOOKS): every family has a home providing every one
    try:
        mod = importlib.import_module(fam.home)
    except (ImportError, TypeError, AttributeError):  # no module of that name, or no name
        out.append(f"{fam.name}: home {fam.home} cannot be imported")
    else:
        for hook in base.HOOKS:
            if not callable(getattr(mod, hook, None)):
                out.append(f"{fam.name}: its home {fam.home} has no hook {hook}")
        if not isinstance(getattr(mod, "BUILTIN_NAMES", None), tuple):
            out.append(f"{fam.name}: its home {fam.home} has no BUILTIN_NAMES")
        if fam.flow is None:
            out += _ddpm_home_problems(fam, mod)
    flow = fam.flow
    if flow is not None:
        if flow.training_draw not in base.TRAINING_DRAWS or flow.sample_schedule not in base.SAMPLE_SCHEDULES:
            out.append(f"{fam.name}: unknown training_draw / sample_schedule")
        if (flow.sample_shift is None) == (flow.sample_schedule in base.SHIFTED_SCHEDULES):
            out.append(f"{fam.name}: sample_shift goes with the shifted schedules")
        if flow.t5_component not in fam.text_encoder_components:
            out.append(f"{fam.name}: t5_component {flow.t5_component} is not one of its text encoders")
        if not set(flow.metadata_options) <= set(OPTIONS_BY_NAME):
            out.append(f"{fam.name}: metadata_options name unknown options")
    return out


def _ddpm_home_problems(fam: base.Family, mod) -> list[str]:
    """Where a DDPM family's hooks differ from the flow homes' (sd_common/hooks.py): ``claims``
    takes nothing (the SD loader takes what no flow home claims), the memory hooks are not the
    estimate's path (Unavailable), ``metadata_fields`` takes the prediction type."""
    out = []
    if mod.claims(os.path.join(ROOT, "README.md")) or mod.claims(ROOT):
        out.append(f"{fam.name}: a DDPM home claims a path before loading")
    for hook, args in (("memory_parts", (None, None)), ("memory_family_model", (None, {}, [])),
                       ("memory_conditioning", (None, {}, 1, None)), ("memory_text_tokens", (None, {})),
                       ("memory_text_entry_bytes", (None, {}, 2, False))):
        try:
            getattr(mod, hook)(*args)
            out.append(f"{fam.name}: {hook} answered for a DDPM family")
        except fake_parts.Unavailable:
            pass
        except Exception as e:  # noqa: BLE001 - a flow home's hook on no inputs: reported
            out.append(f"{fam.name}: {hook} fails for a DDPM family ({type(e).__name__})")
    for prediction in ("epsilon", "v"):
        try:
            given = mod.metadata_fields(prediction, None).get("modelspec.prediction_type")
        except (ValueError, AttributeError):  # a flow home's variants; no such hook (reported above)
            given = None
        if given != prediction:
            out.append(f"{fam.name}: metadata_fields does not take the prediction type {prediction!r}")
    return out


def test_every_family_declares_every_hook():
    assert list(registry.FAMILIES) == [f.name for f in registry.FAMILIES.values()]
    bad = [p for f in registry.FAMILIES.values() for p in problems(f)]
    assert not bad, "\n".join(bad)


def test_every_folder_is_one_registered_family():
    folders = sorted(d for d in os.listdir(HOMES) if os.path.isdir(os.path.join(HOMES, d)) and d != "__pycache__")
    # one folder per family, beside SHARED_FOLDERS: code several homes share, no FAMILY of its own
    assert folders == sorted([*registry.FAMILIES, *SHARED_FOLDERS])
    for name in SHARED_FOLDERS:
        assert not hasattr(importlib.import_module(f"library.models.families.{name}"), "FAMILY")
    for name in registry.FAMILIES:
        assert importlib.import_module(f"library.models.families.{name}").FAMILY is registry.get(name)
    # every built-in model belongs to a registered family, and each family lists its own
    assert sorted(BUILTIN_FAMILY) == sorted(n for f in registry.FAMILIES.values() for n in (*f.tiny_models, *f.arch_models))


def test_flow_families_are_written_once():
    assert registry.FLOW_FAMILIES == tuple(n for n, f in registry.FAMILIES.items() if f.flow is not None)
    assert flow_matching.FAMILIES is registry.FLOW_FAMILIES
    assert registry.titles() == ", ".join(f.title for f in list(registry.FAMILIES.values())[:-1]) + \
        " and " + list(registry.FAMILIES.values())[-1].title


@pytest.mark.parametrize("change", [
    dict(text_encoder_names=("CLIP-L",)),               # one name for two encoders
    dict(lora_module="networks.lora"),                  # a LoRA that cannot target it
    dict(pipelines=("StableDiffusionPipeline", "StableDiffusionInpaintPipeline")),  # a flow family's pipeline
    dict(unsupported={"no_such_option": "why"}),
    dict(tiny_models=("tiny-sdxl",)),                   # another family's built-in
    dict(gui_boxes=("flux2_checkbox",)),
    dict(partial_cache="yes"),                          # a capability of the wrong type
    dict(home=None),                                    # a family without hooks
    dict(home="library.models.families.flux"),          # a module without the hooks
])
def test_the_walk_reports_a_planted_bad_family(change):
    planted = dataclasses.replace(registry.get("flux"), **change)
    assert problems(planted), change


@pytest.mark.parametrize("home", ["library.models.families.flux.home",   # a DDPM family with a flow home
                                  "library.models.families.sd_common.hooks"])  # claims / metadata fields fit, no BUILTIN_NAMES
def test_the_walk_reports_a_planted_bad_ddpm_home(home):
    planted = dataclasses.replace(registry.get("sd1"), home=home)
    assert problems(planted), home


@pytest.mark.parametrize("change", [dict(training_draw="sd3_like"), dict(sample_shift=None, sample_schedule=base.FIXED_SHIFT),
                                    dict(t5_component="text_encoder_3")])
def test_the_walk_reports_a_planted_bad_flow_spec(change):
    planted = dataclasses.replace(registry.get("flux"), flow=dataclasses.replace(registry.get("flux").flow, **change))
    assert problems(planted), change


def test_a_family_cannot_leave_a_capability_out():
    """No field has a default: a declaration without one is a TypeError, not SD3's value."""
    kw = {f.name: getattr(registry.get("sd3"), f.name) for f in dataclasses.fields(base.Family)}
    del kw["flow"]
    with pytest.raises(TypeError, match="flow"):
        base.Family(**kw)
    assert all(f.default is dataclasses.MISSING for f in dataclasses.fields(base.FlowSpec))


def test_a_new_flow_family_gets_its_own_rules_not_sd3s(monkeypatch):
    """A third flow family with its own FlowSpec: the formulas read its timestep scale, sample
    defaults and schedule; an unknown training_draw is an error, never SD3's draw."""
    spec = dataclasses.replace(registry.get("sd3").flow, timestep_scale=4.0, sample_steps=9, size_multiple=32,
                               sample_shift=2.0)
    third = dataclasses.replace(registry.get("sd3"), name="third", title="Third", flow=spec)
    monkeypatch.setitem(registry.FAMILIES, "third", third)
    s = torch.tensor([0.25, 1.0], dtype=torch.float64)
    assert flow_matching.model_timesteps("third", s).tolist() == [1.0, 4.0]
    p = {"sample_steps": None, "scale": None, "guidance_scale": None, "height": 100, "width": 70}
    assert flow_sampling.settings(p, "third") == (9, 7.5, None)
    assert flow_sampling.image_size(p, "third") == (96, 64)
    # shift 2 (its own), not SD3's 3: shift(t) = 2t / (1 + t) at the first level
    assert flow_sampling.schedule("third", 2, (8, 8))[0] == pytest.approx(1.0)
    lowest = 2 * 0.001 / (1 + 0.001)
    assert flow_sampling.schedule("third", 2, (8, 8))[1] == pytest.approx(2 * lowest / (1 + lowest), rel=1e-12)
    monkeypatch.setitem(registry.FAMILIES, "third", dataclasses.replace(third, flow=dataclasses.replace(spec, training_draw="new")))
    with pytest.raises(ValueError, match="training_draw"):
        flow_matching.check_flow_options(flow_matching.FlowOptions("third"))


def test_method_kinds_agree_with_the_methods():
    assert set(METHOD_OF_SCRIPT.values()) | {"leco"} == set(method_kinds.KINDS)
    assert set(methods.METHODS) == {n for n in method_kinds.KINDS if n != "leco"}
    for name, cls in methods.METHODS.items():
        kind = method_kinds.get(name)
        assert kind.trains_model == cls.saves_full_model, name
        assert kind.trains_network == (cls.adapter == "lora"), name
        assert kind.trains_embeddings == (cls.adapter == "textual-inversion"), name
        assert sum((kind.trains_network, kind.trains_model, kind.trains_embeddings)) == 1, name
    with pytest.raises(ValueError, match="unknown training method"):
        method_kinds.get("inpainting")


@pytest.mark.parametrize("model, expected", [("tiny-flux", "networks.lora_flux"), ("tiny-sd3", "networks.lora_sd3"),
                                             ("tiny-sd15", "networks.lora"), ("tiny-sdxl", "networks.lora")])
def test_an_unset_network_module_is_the_familys_lora(model, expected):
    """train_lora is one entry for every family: network_module unset means the family's LoRA (an
    explicit one is kept, and refused when it cannot target the family: test_flow_lora)."""
    opts = make_opts("train_lora", pretrained_model_name_or_path=model)
    assert "network_module" not in opts.given
    resolved = run_checks.resolve_options(opts, "lora")
    assert resolved.network_module == expected
    given = make_opts("train_lora", pretrained_model_name_or_path=model, network_module="networks.lora")
    assert run_checks.resolve_options(given, "lora").network_module == "networks.lora"
    # full fine-tunes have no network
    assert run_checks.resolve_options(opts, "finetune").network_module == opts.network_module


@pytest.mark.parametrize("name, prediction, expected", [
    # sd-scripts' library/sai_model_spec.py (ARCH_SD_V1, ARCH_SD_V2_512 / _768_V, ARCH_SD_XL_V1_BASE,
    # IMPL_*) and train_util's ss_base_model_version
    ("sd1", "v", ("sd_v1", "stable-diffusion-v1/lora", "diffusers")),
    ("sd2", "epsilon", ("sd_v2", "stable-diffusion-v2-512/lora", "diffusers")),
    ("sd2", "v", ("sd_v2", "stable-diffusion-v2-768-v/lora", "diffusers")),
    ("sdxl", "epsilon", ("sdxl_base_v1-0", "stable-diffusion-xl-v1-base/lora",
                         "https://github.com/Stability-AI/generative-models")),
])
def test_the_sd_homes_metadata_are_sd_scripts_strings(name, prediction, expected):
    base, arch, impl = expected
    assert registry.home(name).metadata_fields(prediction, "lora") == {
        "ss_base_model_version": base, "modelspec.architecture": arch, "modelspec.implementation": impl,
        "modelspec.prediction_type": prediction}
    assert registry.home(name).metadata_fields(prediction, None)["modelspec.architecture"] == arch[:-len("/lora")]
    with pytest.raises(ValueError, match="prediction type"):
        registry.home(name).metadata_fields("flow", None)


def test_any_sd_home_loads_the_family_the_weights_say():
    """The SD homes claim nothing before loading: SD's loader tells the family from the model, so
    SD2's home given SD1 weights loads an SD1 bundle, and its family model is SD1's."""
    from library.models import flow_family

    opts = make_opts("train_lora", pretrained_model_name_or_path="tiny-sd15")
    assert flow_family.family_before_loading("tiny-sd15") is None
    bundle = registry.home("sd2").load(opts)
    assert bundle.family == "sd1" and len(bundle.text_encoders) == 1
    assert type(flow_family.family_model_for(bundle, opts)).__name__ == "SD1Model"
