"""Anima side by side with sd-scripts' own code, on the CPU and tiny weights:

    python benchmarks/sd_scripts_anima_check.py --sd-scripts PATH [--sd-scripts-python PYTHON] [--work DIR]

Our side writes tiny-anima's DiT with its LLM adapter (every parameter random, so no
zero-initialised projection hides a path) in the released layout (``net.`` keys, weights.save_dit),
a LoRA file of networks.lora_anima with ``train_llm_adapter`` (random ups), and inputs (latents,
sigma, Qwen3 states with two caption lengths, T5 ids and masks, and an empty caption's masks:
Qwen3's tokenizer gives "" no token, T5's gives "</s>") with our outputs, without and with the
LoRA, our per-part optimizer groups and our LoRA metadata. sd-scripts' side runs in a subprocess
(cwd its checkout, its ``library`` and ``networks``; benchmarks/sd_scripts_launch.py's torchvision
workaround first):

1. forward: ``anima_models.Anima`` at tiny-anima's widths (its LLM adapter, fixed at 1024 wide and
   T5's 32128 tokens in sd-scripts' constructor, rebuilt at tiny-anima's width and token count) loads
   our file without ``net.`` (strict: every key and shape), and ``forward`` as its
   anima_train_network.py calls it equals ours;
2. empty caption: what sd-scripts' forward gives for a caption whose Qwen3 mask is all zeros (its
   adapter's cross-attention has no key: SDPA's softmax over nothing), against ours (zeros for
   that attention: a finite output). Reported as a note;
3. groups: ``anima_train_utils.get_anima_param_groups`` on its model with the same rates gives
   the same parameter names at the same learning rates as our ``param_groups``, and freezes the same;
4. lora: ``networks.lora_anima.create_network_from_weights`` builds a module for every name of our
   file, ``load_weights`` leaves no key unused, and the forward with the network applied equals ours;
5. metadata: sd-scripts' ``sai_model_spec`` architecture and implementation for Anima
   (``anima="preview"``, as anima_train_network.py asks) equal what our LoRA file says.

Prints one line per check (``ok`` or what failed) and the notes, exits 1 if a check failed.
"""
from __future__ import annotations

import json
import os
import sys

import torch
from safetensors.torch import save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import sd_scripts_launch  # noqa: E402
from library.models.families.anima import home, tiny, weights  # noqa: E402
from networks import lora_anima  # noqa: E402

# float32 forwards of the same weights: summation order only (outputs ~1); a wrong key or formula is O(1)
TOLERANCE = 1e-4
RATES = {"learning_rate": 1e-2, "self_attn_lr": 2e-2, "cross_attn_lr": None, "mlp_lr": 0.0, "mod_lr": 5e-3,
         "llm_adapter_lr": 3e-3}

SD_SIDE = r"""
import torch
from safetensors.torch import load_file
from library import anima_models, anima_train_utils, sai_model_spec
from networks import lora_anima

torch.set_num_threads(1)
a = cfg["adapter"]


def build():
    dit = anima_models.Anima(max_img_h=512, max_img_w=512, max_frames=128, in_channels=16, out_channels=16,
                             patch_spatial=2, patch_temporal=1, concat_padding_mask=True,
                             model_channels=cfg["model_channels"], num_blocks=cfg["num_blocks"],
                             num_heads=cfg["num_heads"], mlp_ratio=cfg["mlp_hidden"] / cfg["model_channels"],
                             crossattn_emb_channels=cfg["crossattn_dim"], pos_emb_cls="rope3d",
                             pos_emb_learnable=True, use_adaln_lora=True, adaln_lora_dim=cfg["adaln_lora_dim"],
                             rope_h_extrapolation_ratio=4.0, rope_w_extrapolation_ratio=4.0,
                             rope_t_extrapolation_ratio=1.0, rope_enable_fps_modulation=False, use_llm_adapter=False)
    dit.llm_adapter = anima_models.LLMAdapter(source_dim=a["source_dim"], target_dim=a["target_dim"],
                                              model_dim=a["model_dim"], num_layers=a["num_layers"],
                                              num_heads=a["num_heads"], self_attn=True)
    dit.llm_adapter.embed = torch.nn.Embedding(a["vocab_size"], a["target_dim"])
    dit.use_llm_adapter = True
    sd = {k[len("net."):] if k.startswith("net.") else k: v for k, v in load_file(work + "/dit.safetensors").items()}
    dit.load_state_dict(sd, strict=True)
    return dit.eval()


def run(dit, io, empty=False):
    s = "empty_" if empty else ""
    x = io["x"].unsqueeze(2)
    pad = torch.zeros(x.shape[0], 1, x.shape[-2], x.shape[-1])
    with torch.no_grad():
        return dit(x, io["sigma"], io[s + "states"], padding_mask=pad, target_input_ids=io[s + "t5_ids"].long(),
                   target_attention_mask=io[s + "t5_mask"], source_attention_mask=io[s + "q_mask"]).squeeze(2)


def line(ok, text):
    print(("ok " if ok else "FAILED ") + text)


io = load_file(work + "/io.safetensors")
dit = build()
d = float((run(dit, io) - io["out"]).abs().max())
line(d < TOL, f"forward: sd-scripts' Anima on our weights (strict load), max |diff| {d:.2e}")
empty = run(dit, io, empty=True)
print(f"note empty caption (torch {torch.__version__}, CPU): sd-scripts' output finite: "
      f"{bool(torch.isfinite(empty).all())} (NaN elements {int(torch.isnan(empty).sum())} of {empty.numel()}); "
      f"ours finite: {bool(torch.isfinite(io['empty_out']).all())}; max |diff| "
      f"{float((empty - io['empty_out']).abs().max()):.2e}")

ours = json.load(open(work + "/groups.json"))
r = ours["rates"]
groups = anima_train_utils.get_anima_param_groups(dit, base_lr=r["learning_rate"], self_attn_lr=r["self_attn_lr"],
                                                  cross_attn_lr=r["cross_attn_lr"], mlp_lr=r["mlp_lr"],
                                                  mod_lr=r["mod_lr"], llm_adapter_lr=r["llm_adapter_lr"])
names = {id(p): n for n, p in dit.named_parameters()}
theirs = {names[id(p)]: g["lr"] for g in groups for p in g["params"]}
frozen = sorted(n for n, p in dit.named_parameters() if not p.requires_grad)
diff = sorted(set(theirs.items()) ^ set(ours["lr"].items()))
line(not diff and frozen == ours["frozen"], f"groups: sd-scripts' get_anima_param_groups puts {len(theirs)} tensors "
     f"in {len(groups)} groups and freezes {len(frozen)}; ours {len(ours['lr'])} / {len(ours['frozen'])}; "
     f"first difference {diff[:1]}")

dit = build()
net, sd = lora_anima.create_network_from_weights(1.0, work + "/lora.safetensors", None, None, dit)
built = {l.lora_name for l in net.text_encoder_loras + net.unet_loras}
in_file = {k.split(".")[0] for k in sd}
net.apply_to(None, dit, False, True)
res = net.load_weights(work + "/lora.safetensors")
line(built == in_file and not res.missing_keys and not res.unexpected_keys,
     f"lora: sd-scripts' lora_anima builds {len(built)} modules for the file's {len(in_file)} names "
     f"({sum('llm_adapter' in n for n in built)} in the LLM adapter); missing {list(res.missing_keys)[:3]}, "
     f"unused {list(res.unexpected_keys)[:3]}")
d = float((run(dit, io) - io["out_lora"]).abs().max())
line(d < TOL, f"lora forward: sd-scripts' network on its Anima against ours, max |diff| {d:.2e}")

meta = json.load(open(work + "/metadata.json"))
arch = sai_model_spec.determine_architecture(False, False, False, True, False, {"anima": "preview"})
impl = sai_model_spec.determine_implementation(True, False, False, {"anima": "preview"})
line((arch, impl) == (meta["modelspec.architecture"], meta["modelspec.implementation"]),
     f"metadata: sd-scripts writes architecture {arch!r}, implementation {impl!r}; our LoRA file "
     f"{meta['modelspec.architecture']!r}, {meta['modelspec.implementation']!r}")
"""


def _randomise(module, g: torch.Generator) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.2 if p.dim() > 1 else 0.1) + (1.0 if p.dim() == 1 else 0.0))


def write_inputs(work: str) -> dict:
    """Our side's files; returns the configuration sd-scripts' model is built with."""
    g = torch.Generator().manual_seed(0)
    dit = tiny.build()["dit"]
    _randomise(dit, g)
    weights.save_dit(dit, os.path.join(work, "dit.safetensors"))
    cfg = dit.config
    b, lq, lt = 2, 7, 6
    x = torch.randn(b, 16, 8, 8, generator=g)
    sigma = torch.tensor([0.25, 0.8])
    q_mask = torch.tensor([[1] * lq, [1] * 4 + [0] * 3])
    states = torch.randn(b, lq, cfg.adapter.source_dim, generator=g) * q_mask[..., None]  # zero at padding
    t5_ids = torch.randint(2, cfg.adapter.vocab_size, (b, lt), generator=g)
    t5_mask = torch.tensor([[1] * lt, [1] * 3 + [0] * 3])
    # "": Qwen3's tokenizer gives no token (all padding, states zero); T5's gives "</s>" (id 1)
    e_mask, e_states = torch.zeros(b, lq, dtype=torch.long), torch.zeros(b, lq, cfg.adapter.source_dim)
    e_ids, e_t5_mask = torch.zeros(b, lt, dtype=torch.long), torch.zeros(b, lt, dtype=torch.long)
    e_ids[:, 0], e_t5_mask[:, 0] = 1, 1

    def ours():
        with torch.no_grad():
            return dit(x, sigma, states, t5_ids, t5_mask, q_mask)

    out = ours()
    with torch.no_grad():
        empty_out = dit(x, sigma, e_states, e_ids, e_t5_mask, e_mask)
    net = lora_anima.create_network(1.0, 4, 2, None, [], dit, train_llm_adapter="true")
    _randomise(net, g)
    meta = {**lora_anima.file_metadata(), **home.metadata_fields("preview", "lora")}
    net.save_weights(os.path.join(work, "lora.safetensors"), None, meta)
    net.apply_to([], dit, False, True)
    out_lora = ours()
    save_file({"x": x, "sigma": sigma, "states": states, "q_mask": q_mask, "t5_ids": t5_ids, "t5_mask": t5_mask,
               "empty_states": e_states, "empty_q_mask": e_mask, "empty_t5_ids": e_ids, "empty_t5_mask": e_t5_mask,
               "out": out, "empty_out": empty_out, "out_lora": out_lora}, os.path.join(work, "io.safetensors"))
    fresh = tiny.build()["dit"]
    groups, _ = home.param_groups(fresh, _Rates(RATES))
    names = {id(p): n for n, p in fresh.named_parameters()}
    with open(os.path.join(work, "groups.json"), "w") as f:
        json.dump({"rates": RATES, "lr": {names[id(p)]: gr["lr"] for gr in groups for p in gr["params"]},
                   "frozen": sorted(n for n, p in fresh.named_parameters() if not p.requires_grad)}, f)
    with open(os.path.join(work, "metadata.json"), "w") as f:
        json.dump(meta, f)
    return {"model_channels": cfg.model_channels, "num_blocks": cfg.num_blocks, "num_heads": cfg.num_heads,
            "mlp_hidden": cfg.mlp_hidden, "crossattn_dim": cfg.crossattn_dim, "adaln_lora_dim": cfg.adaln_lora_dim,
            "adapter": {k: getattr(cfg.adapter, k) for k in ("source_dim", "target_dim", "model_dim", "num_layers",
                                                              "num_heads", "vocab_size")}}


class _Rates:
    """The options home.param_groups reads (the same rates as the sd-scripts side's call)."""

    def __init__(self, rates: dict):
        self.__dict__.update(rates)


def main(argv=None) -> int:
    return sd_scripts_launch.run_check(argv, __doc__, "Anima", "anima_models.py", write_inputs,
                                       SD_SIDE.replace("TOL", repr(TOLERANCE)))


if __name__ == "__main__":
    sys.exit(main())
