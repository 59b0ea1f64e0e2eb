"""The captioning scripts on tiny BLIP, GIT, Florence-2, LLaVA, Qwen2-VL and Qwen2.5-VL models built offline:
every caption written equals the caption transformers' own ``generate`` makes, called here on the
same model and image with the settings the flags stand for (one image at a time, where the script
ran batches). Each check first makes sure the flag matters: the reference without it differs."""
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
import transformers
from PIL import Image

from finetune import make_captions, make_captions_by_git, make_captions_vlm
from tests.conftest import ROOT
from tests.dataset_tools import tiny_captioners as tiny


@dataclass
class Tiny:
    folder: str
    processor: object
    model: object


class QwenReference:
    """Qwen2-VL's processor by hand from transformers' parts, where transformers cannot build its
    own (without torchvision): the chat template through the tokenizer, the pixels from the image
    processor, and each image's ``<|image_pad|>`` repeated t * h * w / merge_size**2 times
    (Qwen2VLProcessor.replace_image_token), image tokens marked 1 in ``mm_token_type_ids``."""
    IMAGE = "<|image_pad|>"

    def __init__(self, folder):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(folder)
        with open(os.path.join(folder, "chat_template.jinja"), encoding="utf-8") as f:
            self.template = f.read()

    def apply_chat_template(self, messages, **kwargs):
        return self.tokenizer.apply_chat_template(messages, chat_template=self.template, **kwargs)

    def __call__(self, images, text, return_tensors=None):
        pixels = self.image_processor(images=images, return_tensors="pt")
        texts = [text] if isinstance(text, str) else list(text)
        assert len(texts) == len(images) and all(t.count(self.IMAGE) == 1 for t in texts)
        counts = [int(g.prod()) // self.image_processor.merge_size ** 2 for g in pixels["image_grid_thw"]]
        enc = self.tokenizer([t.replace(self.IMAGE, self.IMAGE * n) for t, n in zip(texts, counts)],
                             return_tensors=return_tensors)
        image_id = self.tokenizer.convert_tokens_to_ids(self.IMAGE)
        if return_tensors == "pt":
            enc["mm_token_type_ids"] = (enc["input_ids"] == image_id).long()
        return {**enc, **pixels}

    def decode(self, ids, **kwargs):
        return self.tokenizer.decode(ids, **kwargs)


def _tiny(tmp_path_factory, name, model_class) -> Tiny:
    folder = str(tmp_path_factory.mktemp(name))
    getattr(tiny, f"build_{name}")(folder)
    if name.startswith("qwen") and importlib.util.find_spec("torchvision") is None:
        processor = QwenReference(folder)
    else:
        processor = transformers.AutoProcessor.from_pretrained(folder)
    return Tiny(folder, processor, getattr(transformers, model_class).from_pretrained(folder).eval())


MODEL_CLASSES = {"blip": "BlipForConditionalGeneration", "git": "GitForCausalLM",
                 "florence2": "Florence2ForConditionalGeneration", "llava": "LlavaForConditionalGeneration",
                 "llava_next": "LlavaNextForConditionalGeneration", "qwen2_vl": "Qwen2VLForConditionalGeneration",
                 "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``built(name)``: the tiny model of that name, built once per module."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = _tiny(tmp_path_factory, name, MODEL_CLASSES[name])
        return cache[name]
    return get


@pytest.fixture
def images(tmp_path):
    return tiny.write_images(tmp_path, 3)


def caption_of(path, ext=".caption"):
    with open(os.path.splitext(path)[0] + ext, encoding="utf-8") as f:
        return f.read()


def rgb(path):
    return Image.open(path).convert("RGB")


def words(text):
    return " ".join(text.split())


# ---------------------------------------------------------------- BLIP (make_captions.py)

def blip_reference(blip, path, **generate):
    inputs = blip.processor(images=rgb(path), text="a picture of", return_tensors="pt")
    with torch.no_grad():
        ids = blip.model.generate(**inputs, **generate)
    text = blip.processor.decode(ids[0], skip_special_tokens=True)
    assert text.startswith("a picture of")
    return words(text[len("a picture of"):])


def test_blip_beam_search(built, images, tmp_path):
    blip = built("blip")
    rc = make_captions.main([str(tmp_path), "--caption_weights", blip.folder, "--beam_search", "--num_beams", "3",
                             "--max_length", "10", "--min_length", "8", "--batch_size", "2",
                             "--caption_extension", ".txt"])
    assert rc == 0
    beams = dict(do_sample=False, num_beams=3, max_length=10, min_length=8, repetition_penalty=1.0)
    want = [blip_reference(blip, p, **beams) for p in images]
    assert [caption_of(p, ".txt") for p in images] == [w + "\n" for w in want]
    for changed in (dict(num_beams=1), dict(max_length=14), dict(min_length=0)):
        assert want != [blip_reference(blip, p, **dict(beams, **changed)) for p in images], changed


def test_blip_nucleus_sampling_with_seed(built, images, tmp_path):
    """Without --beam_search: sampling with top_p and BLIP's repetition penalty 1.1, seeded once."""
    blip = built("blip")
    rc = make_captions.main([str(tmp_path), "--caption_weights", blip.folder, "--top_p", "0.8", "--seed", "7",
                             "--max_length", "12", "--min_length", "6", "--caption_extention", ".cap"])
    assert rc == 0  # sd-scripts' misspelt flag names the extension
    sampling = dict(do_sample=True, top_p=0.8, repetition_penalty=1.1, num_beams=1, max_length=12, min_length=6)
    torch.manual_seed(7)
    want = [blip_reference(blip, p, **sampling) for p in images]
    assert [caption_of(p, ".cap") for p in images] == [w + "\n" for w in want]
    torch.manual_seed(8)
    assert want != [blip_reference(blip, p, **sampling) for p in images]


# ---------------------------------------------------------------- GIT (make_captions_by_git.py)

def git_reference(git, path, max_length):
    with torch.no_grad():
        ids = git.model.generate(pixel_values=git.processor(images=rgb(path), return_tensors="pt").pixel_values,
                                 max_length=max_length)
    return words(git.processor.decode(ids[0], skip_special_tokens=True))


def test_git_as_the_kohya_gui_calls_it(built, images, tmp_path):
    """The GUI's GIT tab passes its number fields as Gradio floats ("2.0"), which sd-scripts'
    type=int refuses: they are taken when whole, and "1.5" is refused."""
    git = built("git")
    rc = make_captions_by_git.main(["--model_id", git.folder, "--batch_size", "2.0", "--max_data_loader_n_workers",
                                    "2.0", "--max_length", "7.0", "--caption_extension", ".txt", str(tmp_path)])
    assert rc == 0
    assert [caption_of(p, ".txt") for p in images] == [git_reference(git, p, 7) + "\n" for p in images]
    with pytest.raises(SystemExit) as e:
        make_captions_by_git.main([str(tmp_path), "--model_id", git.folder, "--batch_size", "1.5"])
    assert e.value.code == 2


def test_git(built, images, tmp_path, capsys):
    git = built("git")
    rc = make_captions_by_git.main([str(tmp_path), "--model_id", git.folder, "--max_length", "7",
                                    "--batch_size", "3", "--max_data_loader_n_workers", "2", "--remove_words",
                                    "--prefix", "sks, ", "--debug"])
    assert rc == 0
    want = [git_reference(git, p, 7) for p in images]
    assert [caption_of(p) for p in images] == [f"sks, {w}\n" for w in want]
    err = capsys.readouterr().err
    assert all(f"{p}: sks, {w}\n" in err for p, w in zip(images, want))  # --debug prints each caption
    assert want != [git_reference(git, p, 50) for p in images]
    assert len(set(want)) == 3  # the captions depend on the image: a mixed-up batch would show


# ---------------------------------------------------------------- Florence-2 and chat VLMs

def florence_reference(florence, path, task, **generate):
    image = rgb(path)
    inputs = florence.processor(images=image, text=task, return_tensors="pt")
    with torch.no_grad():
        ids = florence.model.generate(**inputs, do_sample=False, **generate)
    text = florence.processor.batch_decode(ids, skip_special_tokens=False)[0]
    return words(florence.processor.post_process_generation(text, task=task, image_size=image.size)[task])


def test_florence2_task(built, images, tmp_path):
    florence = built("florence2")
    rc = make_captions_vlm.main([str(tmp_path), "--model", florence.folder, "--task", "<DETAILED_CAPTION>",
                                 "--max_new_tokens", "6", "--num_beams", "2", "--batch_size", "2",
                                 "--suffix", ", photo"])
    assert rc == 0
    want = [florence_reference(florence, p, "<DETAILED_CAPTION>", max_new_tokens=6, num_beams=2) for p in images]
    assert [caption_of(p, ".txt") for p in images] == [f"{w}, photo\n" for w in want]
    assert want != [florence_reference(florence, p, "<CAPTION>", max_new_tokens=6, num_beams=2) for p in images]
    assert want != [florence_reference(florence, p, "<DETAILED_CAPTION>", max_new_tokens=6, num_beams=1)
                    for p in images]


def chat_reference(vlm, path, prompt, system=None, pixel_dtype=torch.float32, **generate):
    user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}
    system = [{"role": "system", "content": [{"type": "text", "text": system}]}] if system else []
    text = vlm.processor.apply_chat_template(system + [user], add_generation_prompt=True, tokenize=False)
    inputs = vlm.processor(images=[rgb(path)], text=[text], return_tensors="pt")
    inputs["pixel_values"] = inputs["pixel_values"].to(pixel_dtype)
    with torch.no_grad():
        ids = vlm.model.generate(**inputs, **generate)
    return words(vlm.processor.decode(ids[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))


def test_chat_vlm_prompt_and_system_prompt(built, images, tmp_path):
    """JoyCaption's architecture (LLaVA): chat template, user prompt, system message, greedy."""
    llava = built("llava")
    rc = make_captions_vlm.main([str(tmp_path), "--model", llava.folder, "--prompt", "describe this image .",
                                 "--system_prompt", "you are helpful .", "--max_new_tokens", "6",
                                 "--batch_size", "3"])
    assert rc == 0
    greedy = dict(max_new_tokens=6, do_sample=False)
    want = [chat_reference(llava, p, "describe this image .", "you are helpful .", **greedy) for p in images]
    assert [caption_of(p, ".txt") for p in images] == [w + "\n" for w in want]
    assert want != [chat_reference(llava, p, "describe this image .", **greedy) for p in images]
    assert want != [chat_reference(llava, p, "what does this image describe ?", "you are helpful .", **greedy)
                    for p in images]


def test_chat_vlm_sampling(built, images, tmp_path):
    llava = built("llava")
    rc = make_captions_vlm.main([str(tmp_path), "--model", llava.folder, "--temperature", "0.7", "--top_p", "0.9",
                                 "--seed", "3", "--max_new_tokens", "5"])
    assert rc == 0
    torch.manual_seed(3)
    sampling = dict(max_new_tokens=5, do_sample=True, temperature=0.7, top_p=0.9)
    want = [chat_reference(llava, p, make_captions_vlm.DEFAULT_PROMPT, **sampling) for p in images]
    assert [caption_of(p, ".txt") for p in images] == [w + "\n" for w in want]


@pytest.mark.parametrize("name, image_token", [
    ("llava_next", "<image>"),
    ("qwen2_vl", "<|vision_start|><|image_pad|><|vision_end|>"),
    ("qwen2_5_vl", "<|vision_start|><|image_pad|><|vision_end|>"),
])
def test_chat_vlm_batch_of_different_token_counts_is_padded_on_the_left(built, name, image_token, images, tmp_path):
    """LLaVA-NeXT, Qwen2-VL and Qwen2.5-VL give each image as many tokens as its shape asks: the
    batch's prompts differ in length, and each reply must still equal the image's own, unpadded
    one. Without torchvision the script builds Qwen's processors without their video part, and
    the reference's processor is made by hand from transformers' parts (QwenReference)."""
    vlm = built(name)
    assert len({len(vlm.processor(images=[rgb(p)], text=image_token)["input_ids"][0]) for p in images}) == 3
    rc = make_captions_vlm.main([str(tmp_path), "--model", vlm.folder, "--prompt", "describe this image .",
                                 "--max_new_tokens", "6", "--batch_size", "3"])
    assert rc == 0
    want = [chat_reference(vlm, p, "describe this image .", max_new_tokens=6, do_sample=False) for p in images]
    assert [caption_of(p, ".txt") for p in images] == [w + "\n" for w in want]


def test_chat_vlm_in_bf16(built, images, tmp_path):
    """--precision bf16 runs the weights in bfloat16 (here on the CPU): the reference is the model
    loaded in bfloat16, pixels cast likewise; its captions differ from float32's."""
    llava = built("llava")
    rc = make_captions_vlm.main([str(tmp_path), "--model", llava.folder, "--precision", "bf16", "--prompt",
                                 "describe this image .", "--max_new_tokens", "12"])
    assert rc == 0
    bf16 = Tiny(llava.folder, llava.processor,
                transformers.LlavaForConditionalGeneration.from_pretrained(llava.folder, dtype=torch.bfloat16).eval())
    greedy = dict(max_new_tokens=12, do_sample=False)
    want = [chat_reference(bf16, p, "describe this image .", pixel_dtype=torch.bfloat16, **greedy) for p in images]
    assert [caption_of(p, ".txt") for p in images] == [w + "\n" for w in want]
    assert want != [chat_reference(llava, p, "describe this image .", **greedy) for p in images]


# ---------------------------------------------------------------- bad input: one line, exit 2

def run_main(capsys, main, argv):
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return rc, [line for line in err if line.startswith("error:")]


def test_wrong_models_and_flags_are_one_line(built, images, tmp_path, capsys):
    blip, git, florence, llava = built("blip"), built("git"), built("florence2"), built("llava")
    d = str(tmp_path)
    cases = [
        (make_captions.main, [d, "--caption_weights", git.folder],
         f"--caption_weights {git.folder}: a 'git' model, not BLIP"),
        (make_captions_by_git.main, [d, "--model_id", blip.folder],
         f"--model_id {blip.folder}: a 'blip' model, not GIT"),
        (make_captions_vlm.main, [d, "--model", blip.folder],
         f"--model {blip.folder}: its processor has no chat template"),
        (make_captions_vlm.main, [d, "--model", llava.folder, "--task", "<CAPTION>"], "--task: "),
        (make_captions_vlm.main, [d, "--model", florence.folder, "--prompt", "hi"], "--prompt: "),
        (make_captions.main, [d, "--caption_weights", blip.folder, "--min_length", "9", "--max_length", "5"],
         "--min_length 9 is above --max_length 5"),
        (make_captions.main, [d, "--caption_weights", str(tmp_path / "none")], "--caption_weights"),
        (make_captions_by_git.main, [d, "--model_id", git.folder, "--device", "nowhere"], "--device nowhere: "),
        (make_captions.main, [str(tmp_path / "none"), "--caption_weights", blip.folder], "train_data_dir"),
    ]
    for main, argv, message in cases:
        rc, errors = run_main(capsys, main, argv)
        assert rc == 2 and len(errors) == 1 and errors[0].startswith(f"error: {message}"), (argv, errors)
    assert not [n for n in os.listdir(tmp_path) if not n.endswith(".png")]  # nothing written


def test_no_model_is_loaded_when_every_image_has_a_caption(tmp_path, capsys):
    tiny.write_images(tmp_path, 1)
    (tmp_path / "img0.caption").write_text("mine\n")
    rc = make_captions.main([str(tmp_path), "--caption_weights", "owner/not-downloaded"])
    assert rc == 0 and "already have a .caption file" in capsys.readouterr().err
    assert (tmp_path / "img0.caption").read_text() == "mine\n"


def test_model_folder_of_the_wrong_layout(built, images, tmp_path, capsys):
    blip = built("blip")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(open(os.path.join(blip.folder, "config.json")).read())
    rc, errors = run_main(capsys, make_captions.main, [str(tmp_path), "--caption_weights", str(broken)])
    assert rc == 2 and len(errors) == 1 and errors[0].startswith(f"error: --caption_weights {broken}: cannot load its")


def test_a_processor_that_needs_torchvision_is_one_line(built, images, tmp_path, capsys, monkeypatch):
    """What really needs torchvision (a processor whose image part has no PIL backend) stays a
    one-line refusal when torchvision is missing."""
    llava = built("llava")

    def needs_torchvision(*_, **__):
        raise ImportError("\nSomeImageProcessorFast requires the Torchvision library but it was not found in your "
                          "environment.\nCheck out the instructions ...")

    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", needs_torchvision)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchvision" else
                        importlib.machinery.PathFinder.find_spec(name))
    rc, errors = run_main(capsys, make_captions_vlm.main, [str(tmp_path), "--model", llava.folder])
    assert rc == 2 and errors == [f"error: --model {llava.folder}: cannot load its processor: it needs torchvision, "
                                  "which is not installed (install the build matching your torch)"]


def test_scripts_run_as_scripts(tmp_path):
    """python finetune/<script>.py works from any folder (the repository root made importable)."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "finetune", "make_captions.py"), str(tmp_path / "none")],
                         capture_output=True, text=True, cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 2 and out.stderr.strip() == f"error: train_data_dir {tmp_path / 'none'}: no such folder"
