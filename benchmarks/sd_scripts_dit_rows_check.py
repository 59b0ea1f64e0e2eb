"""sd-scripts' side of benchmarks/gpu.py's anima-lora-b1 and lumina-lora-b1 rows, run on the CPU:

    python benchmarks/sd_scripts_dit_rows_check.py --sd-scripts PATH [--sd-scripts-python PYTHON]
                                                   [--work DIR] [--only anima lumina] [--steps 2]

For each family it writes benchmarks/dit_weights.py's files at tiny widths (float32; the same
writer and layouts as the full-size rows) and runs sd-scripts' own entry script
(anima_train_network.py / lumina_train_network.py) through benchmarks/sd_scripts_launch.py with the
command line gpu.sd_scripts_args builds for the row (its files, tokenizers and flags) and the CPU
variant of the row's training options (gpu.training_options' dry run: 64 px, no bf16), for
``--steps`` optimizer steps. sd-scripts builds its models at fixed full-size widths, so in its
process (and nowhere else) its constructors are redirected to the tiny widths first: Anima's DiT and
LLM adapter, the Qwen-Image VAE; Lumina 2's Next-DiT, Gemma-2's config, FLUX.1's autoencoder
parameters. Its loaders, tokenizers, caching, LoRA and training loop run as on the GPU.

Prints one line per family: ``ok`` with the optimizer steps sd-scripts took (all of them), its
trainable parameter count (equal to our row's LoRA on the same files), its last average loss (finite) and the loaders that logged a full key
match (Lumina 2's three load with strict=False), or ``FAILED`` with its last error line; exits 1 if
one failed, 2 for a folder that is not an sd-scripts checkout.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks import dit_weights, gpu, sd_scripts_launch  # noqa: E402
from library.models.families.anima import family_model, tiny  # noqa: E402
from library.models.families.flux import flux_ae  # noqa: E402
from library.models.families.lumina import loading, nextdit, text  # noqa: E402
from networks import lora_anima, lora_lumina  # noqa: E402
from tools.make_sample_dataset import make_sample_dataset  # noqa: E402

ROWS = {"anima": "anima-lora-b1", "lumina": "lumina-lora-b1"}
LOSS = re.compile(r"avr_loss=([-+0-9.eEnaif]+)")
# the loaders that load with strict=False and only log what did not match (sd-scripts' Anima DiT
# loader raises on a mismatch, its Qwen-Image VAE loads strictly): each must log a full match
MATCHED = re.compile(r"Loaded (\w+): <All keys matched")
FULL_MATCH = {"anima": {"VAE"}, "lumina": {"Lumina", "Gemma2", "AE"}}

# In sd-scripts' process, after CHECK_PRELUDE: the tiny widths, then the launcher's main.
SD_SIDE = r"""
import dataclasses
import torch
from transformers import Gemma2Config
from library import anima_models, flux_models, lumina_models, lumina_util, qwen_image_autoencoder_kl

if cfg["family"] == "anima":
    d, a = cfg["dit"], cfg["dit"]["adapter"]

    class TinyAnima(anima_models.Anima):
        def __init__(self, **kw):
            kw.update(model_channels=d["model_channels"], num_blocks=d["num_blocks"], num_heads=d["num_heads"],
                      mlp_ratio=d["mlp_hidden"] / d["model_channels"], crossattn_emb_channels=d["crossattn_dim"],
                      adaln_lora_dim=d["adaln_lora_dim"], use_llm_adapter=False)
            super().__init__(**kw)
            self.llm_adapter = anima_models.LLMAdapter(source_dim=a["source_dim"], target_dim=a["target_dim"],
                                                       model_dim=a["model_dim"], num_layers=a["num_layers"],
                                                       num_heads=a["num_heads"], self_attn=True)
            self.llm_adapter.embed = torch.nn.Embedding(a["vocab_size"], a["target_dim"])
            self.use_llm_adapter = True

    class TinyVAE(qwen_image_autoencoder_kl.AutoencoderKLQwenImage):
        def __init__(self, **kw):
            kw.update(cfg["vae"])
            super().__init__(**kw)

    anima_models.Anima = TinyAnima
    qwen_image_autoencoder_kl.AutoencoderKLQwenImage = TinyVAE
else:
    t = cfg["transformer"]
    lumina_models.NextDiT_2B_GQA_patch2_Adaln_Refiner = lambda **kw: lumina_models.NextDiT(
        patch_size=2, in_channels=16, dim=t["dim"], n_layers=t["n_layers"], n_refiner_layers=t["n_refiner_layers"],
        n_heads=t["n_heads"], n_kv_heads=t["n_kv_heads"], multiple_of=t["ffn_hidden"], qk_norm=True,
        cap_feat_dim=t["cap_feat_dim"], axes_dims=list(t["axes_dims"]), axes_lens=list(t["axes_lens"]), **kw)
    lumina_util.Gemma2Config = lambda **kw: Gemma2Config(**cfg["gemma2"])
    spec = flux_models.configs["schnell"]
    spec.ae_params = dataclasses.replace(spec.ae_params, **cfg["ae"])

sys.argv = [sys.argv[1]] + sys.argv[4:]
launch.main()
"""


def tiny_configs(family: str) -> dict:
    """dit_weights.write_files' configs at the test widths (tests/tools/test_benchmarks_smoke.py's)."""
    if family == "anima":
        return {"dit": tiny.tiny_config(len(tiny.t5.build_tiny_tokenizer())),
                "qwen3": tiny.qwen3_config(len(tiny.build_qwen3_tokenizer())).to_dict(), "vae": tiny.vae_config()}
    return {"transformer": nextdit.TINY, "gemma2": text.tiny_config(len(text.build_tiny_tokenizer()),
                                                                      nextdit.TINY.cap_feat_dim),
            "ae": flux_ae.TINY_AE_CONFIG}


def sd_side_config(family: str, configs: dict) -> dict:
    """What SD_SIDE builds sd-scripts' models with (JSON)."""
    if family == "anima":
        c = configs["dit"]
        return {"family": family, "vae": configs["vae"],
                "dit": {"model_channels": c.model_channels, "num_blocks": c.num_blocks, "num_heads": c.num_heads,
                        "mlp_hidden": c.mlp_hidden, "crossattn_dim": c.crossattn_dim,
                        "adaln_lora_dim": c.adaln_lora_dim,
                        "adapter": {k: getattr(c.adapter, k) for k in ("source_dim", "target_dim", "model_dim",
                                                                        "num_layers", "num_heads", "vocab_size")}}}
    t, ae = configs["transformer"], configs["ae"]
    blocks = ae["block_out_channels"]
    return {"family": family, "gemma2": configs["gemma2"],
            "transformer": {k: getattr(t, k) for k in ("dim", "n_layers", "n_refiner_layers", "n_heads", "n_kv_heads",
                                                       "ffn_hidden", "cap_feat_dim", "axes_dims", "axes_lens")},
            "ae": {"ch": blocks[0], "ch_mult": [b // blocks[0] for b in blocks], "num_res_blocks": ae["layers_per_block"],
                   "z_channels": ae["latent_channels"], "scale_factor": ae["scaling_factor"],
                   "shift_factor": ae["shift_factor"]}}


def our_trainable(family: str, files: dict) -> int:
    """The LoRA parameters our row trains on the same files (rank 16, the transformer only)."""
    if family == "anima":
        dit = family_model.load_anima(files["pretrained_model_name_or_path"], qwen3=files["qwen3"], vae=files["vae"],
                                      t5_tokenizer_path=files["t5_tokenizer_path"]).dit
        net = lora_anima.create_network(1.0, 16, 16, None, [], dit)
    else:
        m = loading.load_lumina(files["pretrained_model_name_or_path"], gemma2=files["gemma2"], ae=files["ae"])
        net = lora_lumina.create_network(1.0, 16, 16, None, [m.gemma2], m.transformer)
    return sum(p.numel() for lora in net.unet_loras for p in lora.parameters())


def run_row(family: str, sd_scripts: str, python: str, work: str, steps: int) -> str:
    """One family's row through sd-scripts on the CPU; the ``ok`` / ``FAILED`` line."""
    name = ROWS[family]
    files_dir = os.path.join(work, family)
    configs = tiny_configs(family)
    files = dit_weights.write_files(files_dir, family, configs=configs, dtype=torch.float32)
    data = os.path.dirname(make_sample_dataset(os.path.join(work, "data64"), n_images=4, size=64, repeats=1))
    entry, args = gpu.sd_scripts_args(name, gpu.sd_scripts_files(files_dir, family),
                                      gpu.sd_scripts_tokenizers(work), data, os.path.join(work, f"out-{family}"),
                                      steps, gpu.training_options(name, dry=True))
    code = sd_scripts_launch.CHECK_PRELUDE + SD_SIDE
    launcher = os.path.abspath(sd_scripts_launch.__file__)
    cmd = [python, "-c", code, launcher, work, json.dumps(sd_side_config(family, configs)),
           os.path.join(os.path.abspath(sd_scripts), entry), *map(str, args)]
    p = subprocess.run(cmd, cwd=sd_scripts, capture_output=True, text=True,
                       env=sd_scripts_launch.clean_env({"OMP_NUM_THREADS": "1", "COLUMNS": "400"}))
    if p.returncode != 0:
        lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
        errors = [ln for ln in lines if "Error" in ln or "error:" in ln]
        return f"FAILED {name}: sd-scripts' {entry} stopped: {((errors or lines or ['?'])[-1]).strip()[:240]}"
    out = sd_scripts_launch.parse_output(p.stdout)
    done = len(sd_scripts_launch.STEP_LINE.findall(p.stdout))
    losses = LOSS.findall(p.stderr + p.stdout)
    loss = float(losses[-1]) if losses else math.nan
    matched = set(MATCHED.findall(p.stderr + p.stdout))
    ours = our_trainable(family, files)
    ok = done == steps and math.isfinite(loss) and FULL_MATCH[family] <= matched and out["params"] == ours
    return (f"{'ok' if ok else 'FAILED'} {name}: sd-scripts' {entry} took {done} of {steps} optimizer steps on the "
            f"CPU, {out['params'] or '?'} trainable parameters (ours {ours}), last avr_loss {loss:.4g}; every key matched "
            f"loading {', '.join(sorted(matched)) or 'none'} (needed: {', '.join(sorted(FULL_MATCH[family]))})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sd-scripts", required=True, metavar="PATH", help="a kohya-ss/sd-scripts checkout")
    p.add_argument("--sd-scripts-python", metavar="PYTHON", default=sys.executable)
    p.add_argument("--work", metavar="DIR", help="where the files go (default: a temporary folder)")
    p.add_argument("--only", nargs="+", choices=sorted(ROWS), default=sorted(ROWS))
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per row (at least 2)")
    a = p.parse_args(argv)
    try:
        for family in a.only:
            sd_scripts_launch.check_paths(a.sd_scripts, a.sd_scripts_python, gpu.SD_SCRIPTS_ENTRY[("train_lora", family)])
        if a.steps < 2:
            raise sd_scripts_launch.SdScriptsError(f"--steps {a.steps}: at least 2 (a step's time needs the one before)")
    except sd_scripts_launch.SdScriptsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="sdtk-dit-rows-") as tmp:
        work = os.path.abspath(a.work or tmp)
        os.makedirs(work, exist_ok=True)
        lines = [run_row(family, a.sd_scripts, a.sd_scripts_python, work, a.steps) for family in a.only]
    print("\n".join(lines))
    return 0 if all(line.startswith("ok") for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
