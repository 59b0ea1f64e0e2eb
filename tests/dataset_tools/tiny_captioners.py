"""Tiny captioning models built offline for the tests: BLIP, GIT, Florence-2, LLaVA chat models
(JoyCaption's architecture; LLaVA-NeXT) and Qwen2-VL, each a transformers folder (config, random weights,
a word-level tokenizer made with the tokenizers library, its processor) written by
save_pretrained. Their matrices are redrawn with a large spread (0.6) so that the generated text
depends on the image: at transformers' 0.02 initialisation every image gets the same caption. The
seeds are ones under which each flag the tests check changes the reference captions (a property of
the random model, checked by each test before it compares)."""
from __future__ import annotations

import numpy as np
import torch
from PIL import Image
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

WORDS = ("a picture of the dog cat red blue green on in with and photo sign words says it is "
         "what does image describe ? detail shown paragraph system user assistant this . you are "
         "helpful tree house sky car man woman small big").split()
SIZE = 32  # image side the processors resize to
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}{{ image_markup }}{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tokenizer(specials: list[str], cls_sep: bool = False, **named) -> tuple[PreTrainedTokenizerFast, dict]:
    vocab = {t: i for i, t in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=named.get("unk_token", specials[1])))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])  # "<|im_end|>" one token
    if cls_sep:  # BERT's "[CLS] text [SEP]"
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, **named), vocab


def _scrambled(model_class, config, seed: int, std: float = 0.6):
    """``model_class(config)`` with its matrices drawn from N(0, std) and the rest initialised as
    transformers does, all from ``seed`` (the global generator is left as it was): the same
    weights whatever ran before."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_class(config)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, std)
    return model.eval()


def _chat_template(image_markup: str) -> str:
    return CHAT_TEMPLATE.replace("{{ image_markup }}", image_markup)


def build_blip(folder: str) -> str:
    from transformers import BlipConfig, BlipForConditionalGeneration, BlipImageProcessorPil, BlipProcessor

    tok, v = _tokenizer(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[DEC]", "[MASK]"], cls_sep=True,
                        pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                        bos_token="[DEC]", mask_token="[MASK]")
    BlipProcessor(BlipImageProcessorPil(size={"height": SIZE, "width": SIZE}), tok).save_pretrained(folder)
    config = BlipConfig(
        text_config=dict(vocab_size=len(v), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, encoder_hidden_size=16, max_position_embeddings=64,
                         bos_token_id=v["[DEC]"], eos_token_id=v["[SEP]"], sep_token_id=v["[SEP]"],
                         pad_token_id=v["[PAD]"]),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=SIZE, patch_size=8), projection_dim=16)
    model = _scrambled(BlipForConditionalGeneration, config, 4)
    with torch.no_grad():  # as a trained BLIP: no special token but [SEP], which ends some captions early
        bias = model.text_decoder.cls.predictions.decoder.bias
        bias[[v[t] for t in ("[PAD]", "[UNK]", "[CLS]", "[DEC]", "[MASK]")]] = -20.0
        bias[v["[SEP]"]] = 3.0  # so that --min_length matters
    model.save_pretrained(folder)
    return folder


def build_git(folder: str) -> str:
    from transformers import CLIPImageProcessorPil, GitConfig, GitForCausalLM, GitProcessor

    tok, v = _tokenizer(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], cls_sep=True, pad_token="[PAD]",
                        unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE})
    GitProcessor(image_processor, tok).save_pretrained(folder)
    config = GitConfig(
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=SIZE, patch_size=8),
        vocab_size=len(v), hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=64, bos_token_id=v["[CLS]"], eos_token_id=v["[SEP]"], pad_token_id=v["[PAD]"])
    _scrambled(GitForCausalLM, config, 2).save_pretrained(folder)
    return folder


def build_florence2(folder: str) -> str:
    from transformers import (CLIPImageProcessorPil, Florence2Config, Florence2ForConditionalGeneration,
                              Florence2Processor)

    tok, v = _tokenizer(["<pad>", "<unk>", "<s>", "</s>", "<image>"], pad_token="<pad>", unk_token="<unk>",
                        bos_token="<s>", eos_token="</s>", extra_special_tokens={"image_token": "<image>"})
    # two DaViT stages (strides 4, 2) on 32 px: 4 x 4 image features + their average = 17 tokens
    image_processor = CLIPImageProcessorPil(size={"height": SIZE, "width": SIZE}, do_center_crop=False,
                                            image_seq_length=17)
    Florence2Processor(image_processor, tok, post_processor_config={"pure_text": {}}).save_pretrained(folder)
    config = Florence2Config(
        vision_config=dict(depths=[1, 1], patch_size=[7, 3], patch_stride=[4, 2], patch_padding=[3, 1],
                           patch_prenorm=[False, True], embed_dim=[8, 16], num_heads=[2, 2], num_groups=[2, 2],
                           window_size=2, projection_dim=16, max_position_embeddings=8, max_temporal_embeddings=4),
        text_config=dict(model_type="bart", vocab_size=len(v), d_model=16, encoder_layers=1, decoder_layers=1,
                         encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                         decoder_ffn_dim=32, max_position_embeddings=64, bos_token_id=v["<s>"],
                         eos_token_id=v["</s>"], pad_token_id=v["<pad>"], decoder_start_token_id=v["</s>"],
                         forced_bos_token_id=None, forced_eos_token_id=None),
        image_token_id=v["<image>"])
    model = _scrambled(Florence2ForConditionalGeneration, config, 3)
    # as a trained Florence-2, which writes no <pad>, <unk> or <image> inside a caption
    model.generation_config.suppress_tokens = [v[t] for t in ("<pad>", "<unk>", "<image>")]
    model.save_pretrained(folder)
    return folder


def _llava_parts(max_positions: int) -> tuple[dict, dict]:
    """LLaVA's and LLaVA-NeXT's shared keywords: the processor's (tokenizer, chat template) and the
    model config's (a CLIP vision tower, a Llama decoder)."""
    tok, v = _tokenizer(["<pad>", "<unk>", "<s>", "<image>", "<|im_start|>", "<|im_end|>"], pad_token="<pad>",
                        unk_token="<unk>", bos_token="<s>", eos_token="<|im_end|>",
                        extra_special_tokens={"image_token": "<image>"})
    config = dict(
        vision_config=dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2, image_size=SIZE, patch_size=8),
        text_config=dict(model_type="llama", vocab_size=len(v), hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=max_positions, bos_token_id=v["<s>"],
                         eos_token_id=v["<|im_end|>"], pad_token_id=v["<pad>"]),
        image_token_id=v["<image>"], vision_feature_layer=-1, vision_feature_select_strategy="default")
    processor = dict(tokenizer=tok, chat_template=_chat_template("<image>"), patch_size=8,
                     vision_feature_select_strategy="default", num_additional_image_tokens=1)
    return processor, config


def build_llava(folder: str) -> str:
    """A LLaVA chat model (CLIP vision tower, Llama decoder): JoyCaption's architecture."""
    from transformers import CLIPImageProcessorPil, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    processor, config = _llava_parts(256)
    image_processor = CLIPImageProcessorPil(size={"height": SIZE, "width": SIZE}, do_center_crop=False)
    LlavaProcessor(image_processor=image_processor, **processor).save_pretrained(folder)
    _scrambled(LlavaForConditionalGeneration, LlavaConfig(**config), 5).save_pretrained(folder)
    return folder


def build_llava_next(folder: str) -> str:
    """A LLaVA-NeXT chat model: its image-token count follows the image's aspect ratio (tiles of a
    grid of pinpoints), so a batch of differently shaped images is padded, as Qwen2-VL's is."""
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    processor, config = _llava_parts(512)
    pinpoints = [[SIZE, SIZE], [SIZE, 2 * SIZE], [2 * SIZE, SIZE]]
    image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": SIZE}, image_grid_pinpoints=pinpoints,
                                                 crop_size={"height": SIZE, "width": SIZE})
    LlavaNextProcessor(image_processor=image_processor, **processor).save_pretrained(folder)
    config = LlavaNextConfig(image_grid_pinpoints=pinpoints, **config)
    _scrambled(LlavaNextForConditionalGeneration, config, 6).save_pretrained(folder)
    return folder


def build_qwen2_vl(folder: str) -> str:
    """A Qwen2-VL chat model. Its processor holds a video processor, which needs torchvision:
    without it the processor's parts and processor_config.json are written one by one, as a hub
    repository holds them (transformers' AutoProcessor then cannot load it)."""
    from transformers import Qwen2VLForConditionalGeneration

    return _build_qwen(folder, "Qwen2VLProcessor", Qwen2VLForConditionalGeneration, qwen2_vl_config)


def build_qwen2_5_vl(folder: str) -> str:
    """A Qwen2.5-VL chat model (windowed vision attention, an output projection), written as
    build_qwen2_vl writes its folder."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    return _build_qwen(folder, "Qwen2_5_VLProcessor", Qwen2_5_VLForConditionalGeneration, qwen2_5_vl_config)


def _build_qwen(folder: str, processor_class: str, model_class, config) -> str:
    import importlib.util
    import json

    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    specials = ["<|endoftext|>", "<unk>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|image_pad|>", "<|video_pad|>"]
    tok, v = _tokenizer(specials, pad_token="<|endoftext|>", unk_token="<unk>", eos_token="<|im_end|>")
    image_processor = Qwen2VLImageProcessorPil(size={"shortest_edge": 16 * 16, "longest_edge": 64 * 64},
                                               patch_size=8, temporal_patch_size=2, merge_size=2)
    template = _chat_template("<|vision_start|><|image_pad|><|vision_end|>")
    if importlib.util.find_spec("torchvision") is not None:
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

        getattr(transformers, processor_class)(image_processor=image_processor, tokenizer=tok,
                                               video_processor=Qwen2VLVideoProcessor(),
                                               chat_template=template).save_pretrained(folder)
    else:
        tok.save_pretrained(folder)
        image_processor.save_pretrained(folder)
        with open(f"{folder}/processor_config.json", "w") as f:
            json.dump({"processor_class": processor_class}, f)
        with open(f"{folder}/chat_template.jinja", "w") as f:
            f.write(template)
    _scrambled(model_class, config(v), 7).save_pretrained(folder)
    return folder


def qwen2_vl_config(v: dict):
    from transformers import Qwen2VLConfig

    return Qwen2VLConfig(
        vision_config=dict(depth=1, embed_dim=16, hidden_size=16, num_heads=2, patch_size=8,
                           spatial_merge_size=2, temporal_patch_size=2),
        text_config=dict(vocab_size=len(v), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         bos_token_id=None, eos_token_id=v["<|im_end|>"], pad_token_id=v["<|endoftext|>"],
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}),
        image_token_id=v["<|image_pad|>"], video_token_id=v["<|video_pad|>"],
        vision_start_token_id=v["<|vision_start|>"], vision_end_token_id=v["<|vision_end|>"])


def qwen2_5_vl_config(v: dict):
    from transformers import Qwen2_5_VLConfig

    text = qwen2_vl_config(v).text_config.to_dict()
    return Qwen2_5_VLConfig(
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=8,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=16, window_size=32,
                           fullatt_block_indexes=[1]),
        text_config=text, image_token_id=v["<|image_pad|>"], video_token_id=v["<|video_pad|>"],
        vision_start_token_id=v["<|vision_start|>"], vision_end_token_id=v["<|vision_end|>"])


def write_images(folder, n: int = 3, seed: int = 0, size: int | None = None) -> list[str]:
    """``n`` PNG images of different content and, unless ``size`` makes them square, of three
    shapes that LLaVA-NeXT and Qwen2-VL give different token counts."""
    rng = np.random.RandomState(seed)
    paths = []
    for i in range(n):
        h, w = (size, size) if size else ((32, 32), (48, 32), (24, 56))[i % 3]
        pixels = (rng.rand(h, w, 3) * 255).astype("uint8")
        path = f"{folder}/img{i}.png"
        Image.fromarray(pixels).save(path)
        paths.append(path)
    return paths
