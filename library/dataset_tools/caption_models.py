"""The captioning models, through transformers: BLIP (finetune/make_captions.py), GIT
(finetune/make_captions_by_git.py), Florence-2 and chat VLMs such as Qwen2.5-VL, Qwen3-VL or
JoyCaption's LLaVA (finetune/make_captions_vlm.py). Each captioner turns a batch of PIL images
into one caption each (library/dataset_tools/captioning.py ``Captioner``).

A model is a local transformers folder or a hub id; a missing folder, a folder that is not a
transformers model, a model of the wrong kind for the script, or one transformers cannot load is
one ``ModelError`` line naming the option. On CUDA the weights run in bf16 (fp16 where the GPU
has no bf16) unless ``precision`` says otherwise; on the CPU in float32.
"""
from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from library.errors import ModelError, first_line

# an "owner/name" hub id (a path that does not exist on disk is read as one)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
BLIP_PROMPT = "a picture of "  # the prompt BLIP's captioning weights were fine-tuned with
FLORENCE_TASKS = ("<CAPTION>", "<DETAILED_CAPTION>", "<MORE_DETAILED_CAPTION>")


# the .pth files of Salesforce's BLIP repository that sd-scripts downloads (the kohya_ss GUI passes
# the first as --caption_weights), and the hub repositories holding the same weights converted
BLIP_PTH_ON_HUB = {
    "https://storage.googleapis.com/sfr-vision-language-research/BLIP/models/model_large_caption.pth":
        "Salesforce/blip-image-captioning-large",
    "https://storage.googleapis.com/sfr-vision-language-research/BLIP/models/model_base_caption_capfilt_large.pth":
        "Salesforce/blip-image-captioning-base",
}


def model_source(source: str, option: str) -> str:
    """``source`` checked: a local model folder (with its config.json) or a hub id; one of
    ``BLIP_PTH_ON_HUB``'s URLs becomes its hub id."""
    if source in BLIP_PTH_ON_HUB:
        return BLIP_PTH_ON_HUB[source]
    if os.path.isdir(source):
        if not os.path.isfile(os.path.join(source, "config.json")):
            raise ModelError(f"{option} {source}: not a transformers model folder (no config.json); "
                             "give the folder save_pretrained wrote, or a hub id")
        return source
    if source.lower().endswith(".pth"):
        raise ModelError(f"{option} {source}: a .pth checkpoint is not read here; give a transformers "
                         "model folder or hub id (sd-scripts' BLIP model_large_caption.pth is "
                         "Salesforce/blip-image-captioning-large)")
    if os.path.exists(source):
        raise ModelError(f"{option} {source}: a file, not a model folder; give a transformers model "
                         "folder or a hub id")
    if _HUB_ID.match(source) and not source.startswith("."):
        return source
    raise ModelError(f"{option} {source}: no such model folder (nor an owner/name hub id)")


def placement(device: str | None, precision: str) -> tuple[torch.device, torch.dtype]:
    """The device (CUDA when present) and the weights' dtype: ``auto`` is bf16 on CUDA (fp16 where
    the GPU has no bf16) and float32 on the CPU."""
    try:
        dev = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    except RuntimeError as e:
        raise ModelError(f"--device {device}: {first_line(e)}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"--device {device}: CUDA is not available on this machine")
    if precision == "auto":
        if dev.type != "cuda":
            return dev, torch.float32
        return dev, torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if precision not in PRECISIONS:
        raise ModelError(f"--precision {precision}: one of auto, {', '.join(PRECISIONS)}")
    return dev, PRECISIONS[precision]


def _loaded(option: str, source: str, what: str, load):
    """``load()``, any failure one line naming the option (transformers raises OSError,
    ValueError, KeyError, AttributeError, ImportError ... for a folder it cannot read)."""
    try:
        return load()
    except Exception as e:
        reason = first_line(e)
        if "torchvision" in str(e).lower() and importlib.util.find_spec("torchvision") is None:
            reason = "it needs torchvision, which is not installed (install the build matching your torch)"
        raise ModelError(f"{option} {source}: cannot load its {what}: {reason}") from None


def model_type(source: str, option: str) -> str:
    from transformers import AutoConfig  # lazy: transformers takes seconds to import; --help must not wait

    config = _loaded(option, source, "config", lambda: AutoConfig.from_pretrained(source))
    return config.model_type


@dataclass
class Loaded:
    """A model, its processor and where they run."""
    model: Any  # a transformers model (imported when a captioner loads)
    processor: Any
    device: torch.device
    dtype: torch.dtype
    pin_memory: bool = False

    def inputs(self, batch) -> dict:
        """The processor's tensors on the device, floating ones in the model's dtype."""
        out = {}
        for k, v in batch.items():
            if not isinstance(v, torch.Tensor):
                continue
            if self.pin_memory and self.device.type == "cuda":
                v = v.pin_memory()
            dtype = self.dtype if v.is_floating_point() else None
            out[k] = v.to(self.device, dtype=dtype, non_blocking=self.pin_memory)
        return out

    @torch.inference_mode()
    def generate(self, inputs: dict, **kwargs) -> torch.Tensor:
        return self.model.generate(**inputs, **kwargs)

    def decode(self, ids: torch.Tensor) -> list[str]:
        return [t.strip() for t in self.processor.batch_decode(ids, skip_special_tokens=True)]


def load(source: str, option: str, model_class: str, *, device: str | None = None,
         precision: str = "auto", pin_memory: bool = False, check_processor=None) -> Loaded:
    """The model (transformers' ``model_class``, e.g. "AutoModelForImageTextToText") and its
    processor from ``source``, on the device in the chosen dtype, in eval mode;
    ``check_processor(processor)`` runs before the weights load."""
    import transformers  # lazy: transformers takes seconds to import; --help must not wait

    dev, dtype = placement(device, precision)
    cls = getattr(transformers, model_class)
    processor = _loaded(option, source, "processor", lambda: _processor(source, option))
    if check_processor is not None:
        check_processor(processor)
    model = _loaded(option, source, "weights", lambda: cls.from_pretrained(source, dtype=dtype))
    return Loaded(model.to(dev).eval(), processor, dev, dtype, pin_memory)


def _processor(source: str, option: str):
    """transformers' processor of ``source``; without torchvision, a processor whose video part
    needs it (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: transformers builds their video processor only with
    torchvision) is built without that part: its image processor (the PIL backend, which
    transformers picks when torchvision is missing), tokenizer and chat template, all captioning
    uses. What needs torchvision for images too still fails, with ``_loaded``'s one line."""
    import transformers  # lazy: as in load
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES  # lazy: as above

    if importlib.util.find_spec("torchvision") is None:
        cls = getattr(transformers, PROCESSOR_MAPPING_NAMES.get(model_type(source, option)) or "", None)
        if cls is not None and "video_processor" in cls.get_attributes():
            return _images_only(cls).from_pretrained(source)
    return transformers.AutoProcessor.from_pretrained(source)


def _images_only(cls):
    """``cls`` (a processor of images, text and video) without its video processor: transformers
    takes a processor's parts from its ``__init__`` signature, so this one loads and calls only
    the image processor and the tokenizer."""
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        kwargs.pop("video_processor", None)
        cls.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)
    return type(cls.__name__, (cls,), {"__init__": __init__, "__doc__": _images_only.__doc__})


def is_florence(source: str, option: str) -> bool:
    """Whether ``source`` is Florence-2 (else a chat VLM); from its config alone, so that the
    options are checked before the weights load."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES  # lazy: as above

    found = model_type(source, option)
    if found not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        raise ModelError(f"{option} {source}: a {found!r} model, not an image-text-to-text model "
                         "(Florence-2, Qwen2.5-VL, Qwen3-VL, LLaVA, ...)")
    return found == "florence2"


def load_vlm(source: str, option: str, florence: bool, **placement_args) -> Loaded:
    """A Florence-2 model or a chat VLM (whose processor must have a chat template)."""
    def check(processor):
        if not florence and getattr(processor, "chat_template", None) is None:
            raise ModelError(f"{option} {source}: its processor has no chat template, so it takes no "
                             "prompt (BLIP: finetune/make_captions.py, GIT: finetune/make_captions_by_git.py)")
    return load(source, option, "AutoModelForImageTextToText", check_processor=check, **placement_args)


def check_kind(source: str, option: str, kind: str, expected: tuple[str, ...], hint: str) -> str:
    """The model type of ``source``, which must be one of ``expected``; else one line."""
    found = model_type(source, option)
    if found not in expected:
        raise ModelError(f"{option} {source}: a {found!r} model, not {kind} (model_type "
                         f"{' / '.join(map(repr, expected))}){hint}")
    return found


@dataclass
class BlipCaptioner:
    """sd-scripts' make_captions.py: BLIP's decoder prompted with "a picture of ", the prompt cut
    from the caption; nucleus sampling (``top_p``, repetition penalty 1.1, as BLIP's own
    ``generate(sample=True)``) or, with ``beam_search``, ``num_beams`` beams (penalty 1.0)."""
    loaded: Loaded
    beam_search: bool = False
    num_beams: int = 1
    top_p: float = 0.9
    max_length: int = 75
    min_length: int = 5

    def generate_kwargs(self) -> dict:
        lengths = dict(max_length=self.max_length, min_length=self.min_length)
        if self.beam_search:
            return dict(do_sample=False, num_beams=self.num_beams, repetition_penalty=1.0, **lengths)
        return dict(do_sample=True, top_p=self.top_p, num_beams=1, repetition_penalty=1.1, **lengths)

    def caption(self, images: list) -> list[str]:
        batch = self.loaded.processor(images=images, text=[BLIP_PROMPT.strip()] * len(images),
                                      return_tensors="pt")
        ids = self.loaded.generate(self.loaded.inputs(batch), **self.generate_kwargs())
        return [strip_prompt(t, BLIP_PROMPT) for t in self.loaded.decode(ids)]


def strip_prompt(text: str, prompt: str) -> str:
    """``text`` without the leading ``prompt`` (compared without case and surrounding spaces)."""
    p = prompt.strip()
    return text[len(p):].strip() if text.lower().startswith(p.lower()) else text


# The phrases sd-scripts' make_captions_by_git.py --remove_words deletes, in its order: GIT
# trained on TextCaps reads text in images ("a sign that says 'open'") and often invents it.
_WORD = r"\w+"
_DQ = r'" ?[^"]*"'
_SQ = r"' ?(?:i'm)?[^']*'"
REMOVED_PHRASES = tuple(re.compile(p) for p in (
    rf"(?:has|with|and) the (?:words?|letters?|name) (?:{_DQ}|{_WORD})"
    rf"(?: ?(?:is )?(?:on|in) (?:the |her |their |him )?{_WORD})?",
    rf"(?:with a sign )?that says ?(?:{_DQ}|{_WORD})(?: ?on it)?",
    rf"(?:with a sign )?that says ?(?:{_SQ}|{_WORD})(?: ?on it)?",
    rf"with the number \d+ on (?:it|{_WORD} {_WORD})",
    r'with the words "',
    rf"word {_WORD} on it",
    rf"that says the word {_WORD} on it",
    r"that says'the word \"(?: on it)?",
))


def remove_words(caption: str) -> str:
    for pattern in REMOVED_PHRASES:
        caption = pattern.sub("", caption)
    return caption


@dataclass
class GitCaptioner:
    """sd-scripts' make_captions_by_git.py: GIT's greedy caption of the image alone, at most
    ``max_length`` tokens; ``remove_words`` drops "with the words ..." phrases."""
    loaded: Loaded
    max_length: int = 50
    remove_words: bool = False

    def caption(self, images: list) -> list[str]:
        batch = self.loaded.processor(images=images, return_tensors="pt")
        pixels = self.loaded.inputs(batch)["pixel_values"]
        texts = self.loaded.decode(self.loaded.generate({"pixel_values": pixels}, max_length=self.max_length))
        return [remove_words(t) for t in texts] if self.remove_words else texts


@dataclass(frozen=True)
class Sampling:
    """Generation settings of finetune/make_captions_vlm.py: greedy (or ``num_beams`` beams) at
    temperature 0, else sampling at ``temperature`` with ``top_p``."""
    max_new_tokens: int = 512
    num_beams: int = 1
    temperature: float = 0.0
    top_p: float = 0.9

    def kwargs(self) -> dict:
        out = dict(max_new_tokens=self.max_new_tokens, num_beams=self.num_beams)
        if self.temperature > 0:
            return dict(out, do_sample=True, temperature=self.temperature, top_p=self.top_p)
        return dict(out, do_sample=False)


@dataclass
class FlorenceCaptioner:
    """Florence-2 (transformers' Florence2ForConditionalGeneration) with a caption task token."""
    loaded: Loaded
    task: str = "<CAPTION>"
    sampling: Sampling = Sampling(num_beams=3)

    def caption(self, images: list) -> list[str]:
        batch = self.loaded.processor(images=images, text=[self.task] * len(images), return_tensors="pt")
        ids = self.loaded.generate(self.loaded.inputs(batch), **self.sampling.kwargs())
        return self.loaded.decode(ids)


@dataclass
class ChatCaptioner:
    """An image-text-to-text chat model (Qwen2.5-VL, Qwen3-VL, LLaVA / JoyCaption, Gemma 3, ...):
    its chat template with one image and the user ``prompt`` (after an optional ``system``
    message), the reply decoded from the tokens after the prompt. Prompts are padded on the left
    so that a batch's replies start together."""
    loaded: Loaded
    prompt: str
    system: str | None = None
    sampling: Sampling = Sampling()

    def __post_init__(self):
        self.loaded.processor.tokenizer.padding_side = "left"

    def messages(self) -> list[dict]:
        user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": self.prompt}]}
        if self.system:
            return [{"role": "system", "content": [{"type": "text", "text": self.system}]}, user]
        return [user]

    def caption(self, images: list) -> list[str]:
        proc = self.loaded.processor
        text = proc.apply_chat_template(self.messages(), add_generation_prompt=True, tokenize=False)
        batch = proc(images=images, text=[text] * len(images), padding=True, return_tensors="pt")
        inputs = self.loaded.inputs(batch)
        ids = self.loaded.generate(inputs, **self.sampling.kwargs())
        return self.loaded.decode(ids[:, inputs["input_ids"].shape[1]:])
