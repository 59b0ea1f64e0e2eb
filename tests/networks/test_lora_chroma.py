"""A Chroma LoRA (networks/lora_flux.py on the Chroma transformer, kohya's FLUX-style keys, as
sd-scripts' flux_train_network.py --model_type chroma writes them) in the clients' loaders:
diffusers' ChromaPipeline.load_lora_weights with every key consumed and the fused weights equal to
W + up @ down * alpha / rank, and ComfyUI's key map."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from library.models.families.chroma import checkpoint, sources
from networks import lora_flux
from networks.lora import write_weights
from tests.client_key_tables import comfy_dit_shapes
from tests.helpers import load_lora_logged
from tests.networks.test_lora_flux import _expected, _randomize


@pytest.fixture(scope="module")
def parts():
    return sources.build_tiny()


def _pipeline(parts):
    """diffusers' ChromaPipeline over the tiny model's parts (the transformer through our
    diffusers-layout conversion, checked against diffusers' own in tests/models/test_chroma.py)."""
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler

    model = parts["transformer"]
    kw = {k: v for k, v in checkpoint.diffusers_config(model.config).items() if not k.startswith("_")}
    transformer = ChromaTransformer2DModel(**kw).to(torch.float64)
    transformer.load_state_dict(checkpoint.to_diffusers(model.double().state_dict(), model.config), strict=True)
    model.float()
    return ChromaPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=parts["ae"], text_encoder=parts["t5"],
                          tokenizer=parts["t5_tokenizer"], transformer=transformer)


def test_targets_are_every_block_linear(parts):
    net = lora_flux.create_network(1.0, 4, 2, None, [parts["t5"]], parts["transformer"])
    names = {m.lora_name for m in net.unet_loras}
    want = {"lora_unet_" + k[:-len(".weight")].replace(".", "_") for k, v in parts["transformer"].state_dict().items()
            if k.endswith(".weight") and v.dim() == 2 and k.startswith(("double_blocks.", "single_blocks."))}
    assert names == want and not net.text_encoder_loras
    assert not any("_mod_" in n or "modulation" in n for n in names)  # Chroma's blocks have no modulation layers


def test_file_loads_in_diffusers_chroma_every_key_consumed_and_weights_exact(parts, tmp_path):
    net = lora_flux.create_network(1.0, 4, 2, None, [parts["t5"]], parts["transformer"], split_qkv="True")
    _randomize(net)
    # diffusers' kohya converter hard-codes FLUX.1's widths for single_blocks linear1 (3072 x 3 + 12288);
    # the tiny model's linear1 leaves the file here (tests/networks/test_lora_flux.py checks that
    # conversion at full width)
    sd = {k: v for k, v in net.state_dict().items() if "_linear1." not in k}
    path = str(tmp_path / "chroma_lora.safetensors")
    write_weights(path, sd, torch.float64, {"ss_network_module": "networks.lora_flux"})
    pipe = _pipeline(parts)
    # (diffusers says it found no key for the T5 text encoder: the file has none, as sd-scripts')
    log = "\n".join(ln for ln in load_lora_logged(pipe, path).splitlines() if "t5encodermodel" not in ln)
    assert "unsupported keys" not in log and "unexpected" not in log and "incompatible" not in log, log
    file_sd = load_file(path)
    n_modules = sum(1 for k in file_sd if k.endswith(".alpha"))
    n_qkv = sum(1 for k in file_sd if k.endswith("_qkv.alpha"))  # diffusers splits each into q, k, v
    layers = [m for _, m in pipe.transformer.named_modules() if hasattr(m, "lora_A") and len(m.lora_A)]
    assert len(layers) == n_modules + 2 * n_qkv
    pipe.fuse_lora(components=["transformer"])
    pipe.unload_lora_weights()
    config = parts["transformer"].config
    fused = checkpoint.from_diffusers(pipe.transformer.state_dict(), config, "fused")
    expected = _expected(parts["transformer"].state_dict(), file_sd, "lora_unet_", lambda p: p)
    assert fused.keys() == expected.keys()
    for k in expected:
        torch.testing.assert_close(fused[k], expected[k], rtol=0, atol=1e-12, msg=k)


def test_every_name_maps_in_comfyui(parts, tmp_path):
    net = lora_flux.create_network(1.0, 4, 1, None, [parts["t5"]], parts["transformer"], in_dims="1,1,1,1,1")
    path = str(tmp_path / "all.safetensors")
    net.save_weights(path, None, {})
    table = comfy_dit_shapes(parts["transformer"])
    sd = load_file(path)
    names = {k.split(".")[0] for k in sd}
    assert {"lora_unet_img_in", "lora_unet_txt_in"} <= names
    for name in names:
        assert name in table, name
        assert (sd[name + ".lora_up.weight"].shape[0], sd[name + ".lora_down.weight"].shape[1]) == table[name][:2]
