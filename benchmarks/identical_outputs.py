"""Nothing changes for the families: fixed tiny runs of every family and method write the same
files before and after a redesign (issue 38; the family / method registry).

    python benchmarks/identical_outputs.py run --out /tmp/same-before [--only sd1_lora leco]
    python benchmarks/identical_outputs.py compare /tmp/same-before/manifest.json /tmp/same-after/manifest.json

``run`` trains twelve fixed runs, each in its own process with one CPU thread and seed 7 (64 px
generated images, 2 steps, the final save), and prints one SHA-256 per output file; ``manifest.json``
holds what benchmarks/identity.py compares (every tensor's dtype, shape and SHA-256 of its bytes,
and the metadata without its time stamps ss_training_started_at / modelspec.date, which no two
runs share). The printed SHA-256 is that of this description, so equal lines mean equal tensor
bytes and equal metadata. The runs:
  sd1_lora            train_lora, tiny-sd15
  sd2v_lora           train_lora, tiny-sd2 (v-prediction)
  sdxl_fused_finetune finetune, tiny-sdxl, fused_backward_pass
  flux_lora           train_lora, tiny-flux, networks.lora_flux
  chroma_lora         train_lora, tiny-chroma, networks.lora_flux
  sd3_finetune        finetune, tiny-sd3
  anima_lora          train_lora, tiny-anima, networks.lora_anima
  lumina_lora         train_lora, tiny-lumina, networks.lora_lumina, a system prompt
  sd1_dreambooth      train_dreambooth, tiny-sd15, its text encoder too
  ti                  train_textual_inversion, tiny-sd15, 2 vectors
  leco                train_leco, tiny-sd15, the shipped configs/leco/prompts.toml (erase, slider)
  inpaint_lora        train_lora, tiny-sd15-inpaint, train_inpainting
  dop                 train_lora, tiny-sd15, a diff_output_preservation subset beside a plain one
``compare`` prints every difference and exits 1 if there is one (benchmarks/identity.py's rule).
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import identity  # noqa: E402
from tools.make_sample_dataset import make_sample_dataset  # noqa: E402

COMMON = ["--max_train_steps", "2", "--seed", "7"]  # LECO's resolution is its prompts'; the others' 64
LECO_PROMPTS = os.path.join(ROOT, "configs", "leco", "prompts.toml")  # the shipped example (64 px)
DOP = "custom_attributes = {diff_output_preservation = true}\nclass_tokens = \"shape\""


def runs(data: str, prompts: str, dop_config: str) -> dict[str, tuple[str, list[str]]]:
    """name -> (entry script, its arguments without --output_dir)."""
    folder = ["--train_data_dir", data, "--cache_latents", "--resolution", "64"]
    lora = ["--network_dim", "4", "--network_alpha", "4", "--learning_rate", "1e-2"]
    full = ["--learning_rate", "1e-3"]

    def model(name):
        return ["--pretrained_model_name_or_path", name, *COMMON]

    return {
        "sd1_lora": ("train_lora.py", [*model("tiny-sd15"), *folder, *lora]),
        "sd2v_lora": ("train_lora.py", [*model("tiny-sd2"), *folder, *lora]),
        "sdxl_fused_finetune": ("finetune.py", [*model("tiny-sdxl"), *folder, *full, "--fused_backward_pass",
                                                "--max_grad_norm", "0"]),
        "flux_lora": ("train_lora.py", [*model("tiny-flux"), *folder, *lora, "--network_module",
                                        "networks.lora_flux"]),
        "chroma_lora": ("train_lora.py", [*model("tiny-chroma"), *folder, *lora, "--network_module",
                                          "networks.lora_flux"]),
        "sd3_finetune": ("finetune.py", [*model("tiny-sd3"), *folder, *full]),
        "anima_lora": ("train_lora.py", [*model("tiny-anima"), *folder, *lora, "--network_module",
                                         "networks.lora_anima"]),
        "lumina_lora": ("train_lora.py", [*model("tiny-lumina"), *folder, *lora, "--network_module",
                                          "networks.lora_lumina", "--system_prompt", "You are an assistant"]),
        "sd1_dreambooth": ("train_dreambooth.py", [*model("tiny-sd15"), *folder, *full, "--train_text_encoder"]),
        "ti": ("train_textual_inversion.py", [*model("tiny-sd15"), *folder, "--token_string", "mytok",
                                              "--init_word", "shape", "--caption_prefix", "mytok",
                                              "--num_vectors_per_token", "2", "--learning_rate", "1e-2"]),
        "leco": ("train_leco.py", [*model("tiny-sd15"), "--prompts_file", prompts, "--max_denoising_steps",
                                   "4", "--network_dim", "4", "--network_alpha", "2", "--learning_rate",
                                   "1e-3"]),
        # (its masked image's latents are encoded every step: no latent cache)
        "inpaint_lora": ("train_lora.py", [*model("tiny-sd15-inpaint"), "--train_data_dir", data, "--resolution", "64",
                                           *lora, "--train_inpainting"]),
        "dop": ("train_lora.py", ["--config", dop_config, *model("tiny-sd15"), "--cache_latents", *lora]),
    }


def file_hash(description) -> str:
    """SHA-256 of a file's comparable description (identity.describe)."""
    text = description if isinstance(description, str) else json.dumps(description, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def cmd_run(a) -> None:
    os.makedirs(a.out, exist_ok=True)
    data = os.path.join(a.out, "data")
    make_sample_dataset(data, n_images=2, size=64, repeats=2)
    concept = os.path.join(data, "2_sks shape")
    dop_config = os.path.join(a.out, "dop.toml")
    with open(dop_config, "w", encoding="utf-8") as f:
        f.write("[general]\nresolution = 64\ncaption_extension = \".caption\"\n[[datasets]]\n"
                f"[[datasets.subsets]]\nimage_dir = {json.dumps(concept)}\n"
                f"[[datasets.subsets]]\nimage_dir = {json.dumps(concept)}\n{DOP}\n")
    manifest = {}
    for name, (script, args) in runs(data, LECO_PROMPTS, dop_config).items():
        if a.only and name not in a.only:
            continue
        out = os.path.join(a.out, name)
        t0 = time.perf_counter()
        identity.launch(script, args, 1, out)
        files = {rel: d for rel, d in identity.manifest_of(out, a.out).items()
                 if rel.endswith((".safetensors", ".pt", ".bin"))}
        manifest[name] = files
        for rel, d in sorted(files.items()):
            print(f"{file_hash(d)}  {name}/{rel}", flush=True)
        print(f"# {name}: {len(files)} files, {time.perf_counter() - t0:.0f} s", flush=True)
    with open(os.path.join(a.out, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)


def main(argv=None) -> int:
    return identity.main(argv, run=cmd_run, doc=__doc__)


if __name__ == "__main__":
    sys.exit(main())
