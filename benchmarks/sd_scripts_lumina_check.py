"""Lumina Image 2.0 side by side with sd-scripts' own code, on the CPU and tiny weights:

    python benchmarks/sd_scripts_lumina_check.py --sd-scripts PATH [--sd-scripts-python PYTHON] [--work DIR]

Our side writes tiny-lumina's transformer (every tensor random, so no zero-initialised projection
hides a path), its Gemma-2 (a transformers folder), a LoRA file of networks.lora_lumina on both
(embedder_dims too, random ups) and inputs (latents, t, caption states with two caption lengths)
with our outputs, without and with the LoRA. sd-scripts' side runs in a subprocess (cwd its
checkout, its ``library`` and ``networks``; benchmarks/sd_scripts_launch.py's torchvision
workaround first):

1. forward: ``lumina_models.NextDiT`` with tiny-lumina's shape loads our transformer file
   (strict: every key and shape) and its output equals ours;
2. lora: ``networks.lora_lumina.create_network_from_weights`` on that model and Gemma-2 builds a
   module for every name of our file, ``load_weights`` leaves no key unused, and the forward with
   the network applied equals ours with our network applied.

Prints one line per check (``ok`` or what failed), exits 1 if any failed.
"""
from __future__ import annotations

import os
import sys

import torch
from safetensors.torch import save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import sd_scripts_launch  # noqa: E402
from library.models.families.lumina import nextdit, tiny  # noqa: E402
from networks import lora_lumina  # noqa: E402

# float32 forwards of the same weights: summation order only (outputs ~10); a wrong key or
# formula is O(1)
TOLERANCE = 1e-3

SD_SIDE = r"""
import torch
from safetensors.torch import load_file
from transformers import Gemma2Model
from library import lumina_models
from networks import lora_lumina

torch.set_num_threads(1)
dit = lumina_models.NextDiT(patch_size=2, in_channels=16, dim=cfg["dim"], n_layers=cfg["n_layers"],
                            n_refiner_layers=cfg["n_refiner_layers"], n_heads=cfg["n_heads"], n_kv_heads=cfg["n_kv_heads"],
                            multiple_of=cfg["ffn_hidden"], qk_norm=True, cap_feat_dim=cfg["cap_feat_dim"],
                            axes_dims=list(cfg["axes_dims"]), axes_lens=list(cfg["axes_lens"])).eval()
info = dit.load_state_dict(load_file(work + "/transformer.safetensors"), strict=True)
io = load_file(work + "/io.safetensors")
with torch.no_grad():
    out = dit(io["x"], io["t"], io["cap"], io["mask"].to(torch.int32))
d = float((out - io["out"]).abs().max())
print(("ok" if d < TOL else "FAILED") + f" forward: sd-scripts' NextDiT on our weights, max |diff| {d:.2e}")
gemma = Gemma2Model.from_pretrained(work + "/gemma2").eval()
net, sd = lora_lumina.create_network_from_weights(1.0, work + "/lora.safetensors", None, [gemma], dit)
names = {l.lora_name for l in net.text_encoder_loras + net.unet_loras}
file_names = {k.split(".")[0] for k in sd}
net.apply_to([gemma], dit, True, True)  # (sd-scripts registers the modules here, then loads)
res = net.load_weights(work + "/lora.safetensors")
ok = names == file_names and not res.unexpected_keys and not res.missing_keys
print(("ok" if ok else "FAILED") + f" lora: sd-scripts' lora_lumina builds {len(names)} modules for the file's "
      f"{len(file_names)} names; missing {list(res.missing_keys)[:3]}, unused {list(res.unexpected_keys)[:3]}")
with torch.no_grad():
    out = dit(io["x"], io["t"], io["cap"], io["mask"].to(torch.int32))
d = float((out - io["out_lora"]).abs().max())
print(("ok" if d < TOL else "FAILED") + f" lora forward: sd-scripts' network on its NextDiT against ours, max |diff| {d:.2e}")
"""


def write_inputs(work: str) -> dict:
    """Our side's files; returns the config sd-scripts' model is built with."""
    torch.manual_seed(0)
    parts = tiny.build_tiny_lumina()
    model = parts["transformer"]
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() > 1 else 0.3) + (1.0 if p.dim() == 1 else 0.0))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(work, "transformer.safetensors"))
    parts["gemma2"].save_pretrained(os.path.join(work, "gemma2"))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 16, 8, 8, generator=g)
    cap = torch.randn(2, 7, nextdit.TINY.cap_feat_dim, generator=g)
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    t = torch.tensor([0.25, 0.8])
    with torch.no_grad():
        out = model(x, t, cap, mask)
    net = lora_lumina.create_network(1.0, 4, 2, None, [parts["gemma2"]], model, embedder_dims="1,1,1")
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    net.save_weights(os.path.join(work, "lora.safetensors"), None, lora_lumina.file_metadata())
    net.apply_to([parts["gemma2"]], model, True, True)
    with torch.no_grad():
        out_lora = model(x, t, cap, mask)
    save_file({"x": x, "t": t, "cap": cap, "mask": mask, "out": out, "out_lora": out_lora},
              os.path.join(work, "io.safetensors"))
    cfg = nextdit.TINY
    return {k: getattr(cfg, k) for k in ("dim", "n_layers", "n_refiner_layers", "n_heads", "n_kv_heads", "ffn_hidden",
                                       "cap_feat_dim", "axes_dims", "axes_lens")}


def main(argv=None) -> int:
    return sd_scripts_launch.run_check(argv, __doc__, "Lumina 2", "lumina_models.py", write_inputs,
                                       SD_SIDE.replace("TOL", repr(TOLERANCE)))


if __name__ == "__main__":
    sys.exit(main())
