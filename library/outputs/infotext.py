"""A1111's ``parameters`` text of a generated PNG (what A1111 / Forge's PNG Info, "Send to
txt2img" and Civitai read), and the PNG written with it.

    text = parameters(prompt, negative, fields, loras)
    save_png(image, path, text, extra)          atomic; tEXt "parameters" plus sd-scripts' keys

The text is A1111's ``create_infotext`` layout: the prompt (with each network as
``<lora:name:weight>``, as A1111 users write it), a ``Negative prompt: ...`` line when there is
one, then one line of ``Key: value`` pairs joined by ", " (Steps, Sampler, CFG scale, Seed, Size,
Model hash, Model, ..., ``Lora hashes: "name: hash, ..."``, Version). A value holding a comma, a
colon or a quote is written as a JSON string, as A1111 quotes it, so that its
``parse_generation_parameters`` reads every field back.
"""
from __future__ import annotations

import json

from PIL.PngImagePlugin import PngInfo

from library.files import atomic_path

VERSION = "sdtk"
# sd-scripts' gen_img sampler names -> A1111's (modules/sd_samplers_*.py labels)
# A1111's names where one of its samplers is the same method; sd-scripts' dpmsolver (DPM-Solver,
# not ++) and dpmsingle (DPM++ single-step, not ancestral) have none, so their names say what ran
# instead of claiming an A1111 sampler ("DPM++ 2S a" is ancestral).
A1111_SAMPLERS = {"ddim": "DDIM", "pndm": "PLMS", "lms": "LMS", "euler": "Euler", "euler_a": "Euler a",
                  "heun": "Heun", "dpm_2": "DPM2", "dpm_2_a": "DPM2 a", "dpmsolver": "DPM-Solver 2M",
                  "dpmsolver++": "DPM++ 2M", "dpmsingle": "DPM++ 2S (single-step)", "flow_euler": "Euler"}


def _value(v) -> str:
    s = str(v)
    return json.dumps(s) if any(c in s for c in ",:\"\n") else s


def lora_tag(name: str, weight: float) -> str:
    return f"<lora:{name}:{weight:g}>"


def parameters(prompt: str, negative: str, fields: dict, loras: list[tuple[str, float, str]]) -> str:
    """The ``parameters`` text: ``fields`` in order (None values left out), then the LoRAs
    ``(name, weight, hash)`` as prompt tags and ``Lora hashes``, then the version."""
    text = " ".join([prompt.strip(), *(lora_tag(n, w) for n, w, _ in loras)])
    lines = [text]
    if negative.strip():
        lines.append(f"Negative prompt: {negative.strip()}")
    pairs = {k: v for k, v in fields.items() if v is not None}
    if loras:
        pairs["Lora hashes"] = ", ".join(f"{n}: {h}" for n, _, h in loras)
    pairs["Version"] = VERSION
    lines.append(", ".join(f"{k}: {_value(v)}" for k, v in pairs.items()))
    return "\n".join(lines)


def save_png(image, path: str, text: str, extra: dict[str, object]) -> None:
    """``image`` as a PNG at ``path`` (atomically) with the tEXt chunk ``parameters`` = ``text``
    and ``extra`` (sd-scripts' gen_img keys: prompt, seed, sampler, ...; each written as text)."""
    info = PngInfo()
    info.add_text("parameters", text)
    for k, v in extra.items():
        info.add_text(k, str(v))
    with atomic_path(path) as tmp:
        image.save(tmp, format="PNG", pnginfo=info)
