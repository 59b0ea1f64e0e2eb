"""The model families this toolkit trains, one ``Family`` per folder of library/models/families/
(docs/FAMILIES.md). Light (no torch): option checks, messages, ``--help`` and the UI read it.

    registry.get("flux")          the Family (unknown name: ValueError, a programming error)
    registry.of(bundle)           the Family of a loaded model bundle
    registry.FAMILIES             name -> Family, in the order messages list them
    registry.FLOW_FAMILIES        the names of the rectified-flow families
    registry.titles()             "SD1, SD2, SDXL, Chroma, FLUX.1, SD3 and Anima" for messages
    registry.flow_option(opts, family, name)   a flow option with the family's own default
    registry.home(name)           the family's hooks module (base.HOOKS), imported on first use
"""
from __future__ import annotations

import importlib

from library.models.families import anima, chroma, flux, lumina, sd1, sd2, sd3, sdxl
from library.models.families.base import Family

# one registration per family: its folder's FAMILY; detection asks the homes in this order, so a
# FLUX.1 derivative (Chroma, whose files hold FLUX.1's blocks) comes before FLUX.1
FAMILIES: dict[str, Family] = {f.name: f for f in (sd1.FAMILY, sd2.FAMILY, sdxl.FAMILY, chroma.FAMILY, flux.FAMILY,
                                                   sd3.FAMILY, anima.FAMILY, lumina.FAMILY)}
FLOW_FAMILIES: tuple[str, ...] = tuple(name for name, f in FAMILIES.items() if f.flow is not None)
# the options a family's folder declares as its own (REFUSED_ELSEWHERE: option -> the reason every
# other family refuses it); read here, so that no family imports another to refuse its options
_OWNED: dict[str, dict[str, str]] = {m.FAMILY.name: getattr(m, "REFUSED_ELSEWHERE", {})
                                     for m in (sd1, sd2, sdxl, chroma, flux, sd3, anima, lumina)}


def foreign_options(fam: Family) -> dict[str, str]:
    """The options other families own, each with the reason ``fam`` refuses it (its own
    ``unsupported`` table may say more)."""
    own = _OWNED[fam.name]
    return {k: why for name, owned in _OWNED.items() if name != fam.name
            for k, why in owned.items() if k not in own}


def get(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; registered: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def home(name: str):
    """The module of a family's hooks (``Family.home``; base.HOOKS), imported on first use: it
    loads torch and the model code, which the light paths (--help, option checks) never need."""
    return importlib.import_module(get(name).home)


def of(bundle) -> Family:
    """The family of a loaded ``ModelBundle``."""
    return get(bundle.family)


def is_flow(name: str | None) -> bool:
    """Whether ``name`` is a rectified-flow family (None: a model not known before loading, SD)."""
    return name is not None and get(name).flow is not None


def flow_option(opts, name: str, option: str):
    """A flow option's value for family ``name``: the family's own default (FlowSpec.option_defaults,
    sd-scripts' per-script defaults) where the run leaves it unset or the family refuses it, else
    the run's value."""
    fam = get(name)
    own = dict(fam.flow.option_defaults) if fam.flow is not None else {}
    if option in own and (option not in opts.given or option in fam.unsupported):
        return own[option]
    return getattr(opts, option)


def titles(flow: bool | None = None, option: str | None = None) -> str:
    """The families' titles joined for a message ("SD1, SD2, SDXL, Chroma, FLUX.1, SD3 and
    Anima"); ``flow``: only the flow families (True) or only the others (False); ``option``: only
    the families that do not refuse that option (their ``unsupported`` table, another family's own
    options)."""
    names = [f.title for f in FAMILIES.values() if (flow is None or (f.flow is not None) == flow)
             and (option is None or (option not in f.unsupported and option not in foreign_options(f)))]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def for_gui(fields: dict) -> Family | None:
    """The family whose kohya_ss GUI box is ticked in the GUI's saved ``fields`` (several: the
    one the GUI's model_type field names, else the lowest ``gui_rank``, as the GUI's train_model
    picks the script); None: the GUI's SD model type (SD1 / SD2, told apart by the model itself)."""
    ticked = [f for f in FAMILIES.values() if any(fields.get(k) for k in f.gui_boxes)]
    # families sharing a box (FLUX.1 and its derivatives) are told apart by the GUI's model_type
    typed = [f for f in ticked if f.model_type and f.model_type == fields.get("model_type")]
    return min(typed or ticked, key=lambda f: f.gui_rank, default=None)
