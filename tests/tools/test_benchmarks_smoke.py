"""benchmarks/sd_scripts_tools_check.py stays runnable without sd-scripts: its argument parsing, its
refusal of a folder that is not a checkout, and its comparison of two LoRA files (hand-built, known
answers)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "sd_scripts_tools_check.py")


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("sd_scripts_tools_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_help_from_a_plain_checkout():
    proc = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--sd_scripts", "--work", "--archs", "--steps"):
        assert flag in proc.stdout


def test_parsing_and_a_folder_that_is_not_sd_scripts(check, tmp_path, capsys):
    args = check.build_parser().parse_args(["--sd_scripts", "x", "--archs", "sdxl", "--steps", "3"])
    assert (args.sd_scripts, args.archs, args.steps) == ("x", ["sdxl"], 3)
    with pytest.raises(SystemExit):
        check.build_parser().parse_args(["--archs", "sd15"])  # --sd_scripts is required
    capsys.readouterr()
    assert check.main(["--sd_scripts", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --sd_scripts") and "\n" not in err


def test_compare_hand_built_files(check, tmp_path):
    from safetensors.torch import save_file
    down = torch.tensor([[1.0, 0.0, 2.0], [0.0, 1.0, 0.0]])
    up = torch.tensor([[1.0, 0.0], [0.0, 3.0]])
    a = {"lora_unet_m.lora_down.weight": down, "lora_unet_m.lora_up.weight": up, "lora_unet_m.alpha": torch.tensor(1.0),
         "lora_unet_n.lora_down.weight": down.clone(), "lora_unet_n.lora_up.weight": up.clone()}
    # m: alpha 2 instead of 1 -> delta doubled, relative difference |2D - D| / |2D| = 0.5
    # n: same factors, no alpha key (alpha = rank) -> identical
    b = {k: v.clone() for k, v in a.items()}
    b["lora_unet_m.alpha"] = torch.tensor(2.0)
    b["lora_unet_x.lora_down.weight"] = down[:1].clone()  # only in b, rank 1
    b["lora_unet_x.lora_up.weight"] = up[:, :1].clone()
    save_file(a, str(tmp_path / "a.safetensors"), {"ss_network_dim": "2", "mine": "1"})
    save_file(b, str(tmp_path / "b.safetensors"), {"ss_network_dim": "2", "theirs": "1"})
    c = check.compare(str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"))
    assert c["keys"] == "ours-only 0, theirs-only 2" and c["modules"] == 2 and c["ranks"] == "equal"
    assert c["worst"] == pytest.approx(0.5) and c["mean"] == pytest.approx(0.25)
    assert c["md_ours_only"] == ["mine"] and c["md_theirs_only"] == ["theirs"]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_benchmark_dry_run(capsys, tmp_path):
    """benchmarks/gpu.py --dry-run on the cheapest case (tiny SD1.5 LoRA, 1 step): the code path
    through the trainer, step timing, the FLOP count and the table; every case's options (SDXL
    fused Adafactor, torch_compile, the GPU-only bf16 flags) parse, so none can rot unnoticed."""
    from library.config.parse import parse_args

    gpu = _load("gpu")
    flux_files = gpu.flux_weights.paths(str(tmp_path))
    for path in flux_files.values():  # the options name them; their content is not read here
        open(path, "wb").close()
    dit_files = {arch: gpu.dit_weights.paths(str(tmp_path), arch) for arch in gpu.DIT_ARCHS}
    for files in dit_files.values():
        for option, path in files.items():
            os.makedirs(path) if option in ("qwen3", "vae", "t5_tokenizer_path") else open(path, "wb").close()
    for name in gpu.CASES:
        for dry in (True, False):
            script, args = gpu.case_args(name, str(tmp_path), str(tmp_path / "o"), 3, dry, str(tmp_path))
            opts = parse_args(script, [str(a) for a in args] + ["--torch_compile"])
            assert opts.torch_compile and opts.cache_latents and opts.train_batch_size == gpu.CASES[name][3]
            assert opts.fused_backward_pass == (name in ("sdxl-full-b1", "flux-full-swap-b1"))
            assert opts.blocks_to_swap == ((2 if dry else 8) if name == "flux-full-swap-b1" else None)
            if name.startswith("flux") and not dry:
                assert opts.pretrained_model_name_or_path == flux_files["model"]
                assert (opts.clip_l, opts.t5xxl, opts.ae) == (flux_files["clip_l"], flux_files["t5xxl"],
                                                              flux_files["ae"])
                assert opts.fp8_base == (name == "flux-lora-b1")
            arch = gpu.CASES[name][1]
            if arch in gpu.DIT_ARCHS:  # the family's LoRA; full size: the random files of dit_weights
                assert opts.network_module == f"networks.lora_{arch}" and opts.network_train_unet_only
                given = {o: getattr(opts, o) for o in dit_files[arch]}
                assert given == (dit_files[arch] if not dry else
                                 {o: (f"tiny-{arch}" if o == "pretrained_model_name_or_path" else None) for o in given})
    out = tmp_path / "rows.json"
    assert gpu.main(["--dry-run", "--no-compile", "--only", "sd15-lora-b1", "flux-full-swap-b1",
                     "--json", str(out), "--work", str(tmp_path / "w")]) == 0
    text = capsys.readouterr().out
    import json

    rows = json.loads(out.read_text())["rows"]
    assert [r["case"] for r in rows] == ["sd15-lora-b1", "flux-full-swap-b1"]  # the FLUX.1 one ran (tiny-flux)
    for row in rows:
        assert row["steps"] == 1 and row["it_s"] > 0 and not row["compile"] and row["flops"] > 0
    assert os.path.isdir(tmp_path / "w" / "data64")  # the outputs went once their rows were taken
    assert not os.path.exists(tmp_path / "w" / "sd15-lora-b1-e") and not os.path.exists(tmp_path / "w" / "flux-full-swap-b1-e")
    assert "sd15-lora-b1" in text and "% peak" in text and "n/a" in text  # no peak on the CPU


def test_flux_benchmark_weights_load(tmp_path):
    """benchmarks/flux_weights.py at tiny widths (T5 with T5-XXL's 32128-token vocabulary, as the
    full-size file): the four files load through the trainer's FLUX.1 loader (BFL layout, the
    autoencoder in BFL/LDM names, the config from the shapes and metadata), the T5 with the tiny
    tokenizer whose ids stay below the vocabulary; the headers file_states computes on the meta
    device are what the writer wrote (names, shapes, dtypes). At full size the same code writes
    FLUX.1 dev's shapes."""
    from safetensors import safe_open

    from library.models import t5
    from library.models.families.sd_common import tiny_models
    from library.models.families.flux import flux, flux_ae, flux_loading

    weights = _load("flux_weights")
    configs = dict(transformer=flux.TINY_FLUX_DEV, clip_config=tiny_models.text_encoder_configs("sd15")[0],
                   t5_config=t5.tiny_config(32128), ae_config=flux_ae.TINY_AE_CONFIG)
    files = weights.write_flux_files(str(tmp_path / "w"), **configs)
    m = flux_loading.load_flux(files["model"], clip_l=files["clip_l"], t5xxl=files["t5xxl"], ae=files["ae"])
    assert m.variant == "dev" and m.config == flux.TINY_FLUX_DEV and m.layout == "bfl"
    assert m.t5.config.vocab_size == 32128 and len(m.t5_tokenizer) == len(t5.build_tiny_tokenizer()) < 32128
    ids, mask = t5.tokenize(m.t5_tokenizer, ["a photo of sks dog"], 16)
    assert int(ids.max()) < len(m.t5_tokenizer) and t5.encode(m.t5, ids, mask, True).shape == (1, 16, 32)
    assert weights.paths(str(tmp_path / "w")) == files
    for name, (state, _) in weights.file_states(**configs).items():
        with safe_open(files[name], framework="pt") as f:
            written = {k: (list(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
        dtypes = {torch.bfloat16: "BF16", torch.int64: "I64"}
        assert written == {k: (list(v.shape), dtypes[v.dtype]) for k, v in state.items()}, name
    with torch.device("meta"):  # the full-size default: FLUX.1 dev's 11.9 B transformer parameters
        assert sum(p.numel() for p in flux.Flux(flux.FLUX_DEV).parameters()) == 11_901_408_320


def test_dit_benchmark_weights_load(tmp_path):
    """benchmarks/dit_weights.py at tiny widths: the Anima files (DiT with its adapter, a Qwen3
    folder with its tokenizer, a Qwen-Image VAE folder, the T5 tokenizer folder) and the Lumina 2
    files (original-layout transformer, a gemma2 file carrying its tokenizer, the ae) load through
    the trainer's loaders with the configs written; at full size the defaults are Anima's 2.09 B DiT
    and Lumina 2's 2.61 B Next-DiT."""
    from library.models.families.flux import flux_ae
    from library.models.families.anima import family_model, tiny
    from library.models.families.anima import model as anima_model
    from library.models.families.lumina import loading, nextdit, text

    weights = _load("dit_weights")
    t5_vocab = len(tiny.t5.build_tiny_tokenizer())
    qwen3 = tiny.qwen3_config(len(tiny.build_qwen3_tokenizer())).to_dict()
    a = weights.write_files(str(tmp_path / "a"), "anima", {"dit": tiny.tiny_config(t5_vocab), "qwen3": qwen3,
                                                           "vae": tiny.vae_config()})
    m = family_model.load_anima(a["pretrained_model_name_or_path"], qwen3=a["qwen3"], vae=a["vae"],
                                t5_tokenizer_path=a["t5_tokenizer_path"])
    assert m.dit.config == tiny.tiny_config(t5_vocab) and m.qwen3.config.hidden_size == 32
    assert m.vae.config.base_dim == 16 and len(m.t5_tokenizer) == t5_vocab
    gemma = text.tiny_config(len(text.build_tiny_tokenizer()), nextdit.TINY.cap_feat_dim)
    lum = weights.write_files(str(tmp_path / "l"), "lumina", {"transformer": nextdit.TINY, "gemma2": gemma,
                                                               "ae": flux_ae.TINY_AE_CONFIG})
    m = loading.load_lumina(lum["pretrained_model_name_or_path"], gemma2=lum["gemma2"], ae=lum["ae"])
    assert m.config == nextdit.TINY and m.gemma2.config.num_hidden_layers == 3
    assert len(m.tokenizer) == len(text.build_tiny_tokenizer())
    with torch.device("meta"):
        assert sum(p.numel() for p in anima_model.Anima(anima_model.FULL).parameters()) == 2_091_068_928
        assert sum(p.numel() for p in nextdit.NextDiT(nextdit.LUMINA2_2B).parameters()) == 2_609_771_456


def test_flux_benchmark_weights_full_size_headers():
    """The full-size files' headers (meta tensors, nothing written) in the layouts of the released
    files sd-scripts' flux_utils and our loaders read: their tensor counts (flux1-dev 780,
    clip_l 196, t5xxl 219 = 24 blocks x 9 + shared + relative bias + final norm, ae 244) and
    a few names and shapes of each (BFL transformer; CLIP-L under text_model.; T5-XXL's 32128 x
    4096 embedding stored once; the autoencoder in BFL names with 1x1-conv attention, 2 x 16
    moment channels, no quant convs)."""
    weights = _load("flux_weights")
    st = {name: state for name, (state, _) in weights.file_states().items()}
    assert {name: len(s) for name, s in st.items()} == {"model": 780, "clip_l": 196, "t5xxl": 219, "ae": 244}
    shapes = {
        "model": {"img_in.weight": (3072, 64), "txt_in.weight": (3072, 4096), "guidance_in.in_layer.weight": (3072, 256),
                  "double_blocks.18.img_attn.qkv.weight": (9216, 3072), "single_blocks.37.linear1.weight": (21504, 3072),
                  "final_layer.linear.weight": (64, 3072)},
        "clip_l": {"text_model.embeddings.token_embedding.weight": (49408, 768),
                   "text_model.encoder.layers.11.mlp.fc1.weight": (3072, 768), "text_model.final_layer_norm.weight": (768,)},
        "t5xxl": {"shared.weight": (32128, 4096), "encoder.block.23.layer.1.DenseReluDense.wi_0.weight": (10240, 4096),
                  "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight": (32, 64),
                  "encoder.final_layer_norm.weight": (4096,)},
        "ae": {"encoder.conv_in.weight": (128, 3, 3, 3), "encoder.down.0.block.0.norm1.weight": (128,),
               "encoder.mid.attn_1.q.weight": (512, 512, 1, 1), "encoder.conv_out.weight": (32, 512, 3, 3),
               "decoder.conv_in.weight": (512, 16, 3, 3), "decoder.up.3.upsample.conv.weight": (512, 512, 3, 3),
               "decoder.up.0.block.0.nin_shortcut.weight": (128, 256, 1, 1)},
    }
    for name, expected in shapes.items():
        assert {k: tuple(st[name][k].shape) for k in expected} == expected, name
        assert all(v.dtype == torch.bfloat16 for v in st[name].values())
    assert "encoder.embed_tokens.weight" not in st["t5xxl"]
    assert all(k.startswith("text_model.") for k in st["clip_l"])
    assert not any("quant_conv" in k or "down_blocks" in k for k in st["ae"])


def test_gpu_benchmark_flop_count_and_peak_table():
    """The FLOP count of a step is torch's count of forward + backward: for one Linear layer
    (m x k input, k -> n), 2*m*k*n forward and 2*m*k*n for the weight gradient (the input is a
    leaf without grad: no input gradient), the elementwise loss not counted."""
    import types

    gpu = _load("gpu")
    lin = torch.nn.Linear(8, 16, bias=False)
    x = torch.randn(5, 8)

    class FakeRun:
        parts = types.SimpleNamespace(params=list(lin.parameters()))
        tset = types.SimpleNamespace(samples=[0] * 5)

        @staticmethod
        def micro_step_loss(epoch, idx, images, n):
            return lin(x[:len(idx)]).square().sum()

    assert gpu.step_flops(FakeRun, 5) == 2 * (2 * 5 * 8 * 16)
    assert gpu.peak_flops("NVIDIA H200", None) == 989.4e12
    assert gpu.peak_flops("NVIDIA H100 PCIe", None) == 756.0e12
    assert gpu.peak_flops("Unknown GPU", None) is None and gpu.peak_flops("x", 100) == 100e12


def test_ddp_scaling_parser_and_strategies():
    ddp = _load("ddp_scaling")
    a = ddp.build_parser().parse_args(["--steps", "2", "--methods", "lora", "--strategies", "sum"])
    assert (a.steps, a.methods, a.strategies, a.worker) == (2, ["lora"], ["sum"], None)
    with pytest.raises(SystemExit):
        ddp.build_parser().parse_args(["--strategies", "nope"])
    assert a.strategy == "ddp"  # the worker's default: the trainer's DDP engine
    # no trainer option for either; "sum" selects the old synchronous sum in the worker
    assert ddp.STRATEGIES == {"ddp": {"args": [], "reducer": True},
                              "sum": {"args": [], "reducer": False}}
    assert ddp.build_parser().parse_args([]).strategies == ["ddp", "sum"]
    assert ddp.main(["--sd-scripts", os.path.join(ROOT, "docs")]) == 2  # not a checkout


def test_data_pipeline_times_calls_that_exist():
    """benchmarks/data_pipeline.py wraps named functions of the run (the README quotes it): each
    must still exist where it looks for it, or the benchmark fails only when someone runs it."""
    import inspect

    pipeline = _load("data_pipeline")
    calls = pipeline.timed_calls()
    assert {key for _, _, key in calls} == {"cache_latents", "cache_text", "sample_latents",
                                           "text_conditioning", "train"}
    for owner, name, key in calls:
        assert callable(inspect.getattr_static(owner, name)), (owner, name, key)


# -- sd-scripts side by side (benchmarks/sd_scripts_launch.py; CI has no sd-scripts venv) --------
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def test_sd_scripts_options_are_checked_before_anything_runs(tmp_path, capsys):
    """--sd-scripts / --sd-scripts-python: each bad value is one line and exit 2, in both benchmarks."""
    ddp, gpu = _load("ddp_scaling"), _load("gpu")
    checkout = tmp_path / "sd-scripts"
    checkout.mkdir()
    (checkout / "train_db.py").write_text("")
    (checkout / "train_network.py").write_text("")
    not_python = tmp_path / "python"
    not_python.write_text("")  # exists, not executable
    cases = [
        (ddp, ["--sd-scripts", str(tmp_path)], "--sd-scripts"),  # no train_db.py there
        (ddp, ["--sd-scripts", str(checkout), "--sd-scripts-python", str(tmp_path / "nope")], "not an executable"),
        (ddp, ["--sd-scripts", str(checkout), "--sd-scripts-python", str(not_python)], "not an executable"),
        (ddp, ["--sd-scripts-python", sys.executable], "needs --sd-scripts"),
        (ddp, ["--sd-scripts", str(checkout), "--warmup", "0"], "--warmup 0"),
        (gpu, ["--sd-scripts", str(tmp_path)], "--sd-scripts"),
        (gpu, ["--sd-scripts", str(checkout), "--sd-scripts-python", str(not_python)], "not an executable"),
        (gpu, ["--sd-scripts-python", sys.executable], "needs --sd-scripts"),
        (gpu, ["--sd-scripts", str(checkout), "--dry-run"], "--dry-run"),
    ]
    for mod, argv, words in cases:
        assert mod.main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and words in err and "\n" not in err, (argv, err)


def test_sd_scripts_modules_are_looked_up_in_its_interpreter(tmp_path):
    """The missing modules are those of the given interpreter: one without site-packages (-S)
    lacks every third-party module; this venv lacks exactly what find_spec here does not find."""
    import importlib.util

    sdl = _load("sd_scripts_launch")
    bare = tmp_path / "bare-python"
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    bare.chmod(0o755)
    assert sdl.missing_modules(str(bare)) == list(sdl.SD_SCRIPTS_MODULES)
    here = [m for m in sdl.SD_SCRIPTS_MODULES if importlib.util.find_spec(m) is None]
    assert sdl.missing_modules(sys.executable) == here
    broken = tmp_path / "broken-python"
    broken.write_text("#!/bin/sh\necho nope >&2; exit 3\n")
    broken.chmod(0o755)
    with pytest.raises(sdl.SdScriptsError, match="does not run Python"):
        sdl.missing_modules(str(broken))


def test_sd_scripts_step_times_from_its_real_output():
    """The stdout of a real run (sd-scripts' train_network.py, LoRA, 2 CPU processes, 4 steps,
    through the launcher; tests/tools/data): step 2..4 durations are the differences of the
    printed time stamps (hand-computed), the text-encoder seconds and the parameter count as
    printed; sd-scripts' own lines around them are ignored."""
    sdl = _load("sd_scripts_launch")
    with open(os.path.join(DATA, "sd_scripts_lora_2proc_stdout.txt"), encoding="utf-8") as f:
        text = f.read()
    r = sdl.parse_output(text)
    assert r["times"] == pytest.approx([6.564086, 6.078225, 6.245159], abs=1e-6)
    assert r["te"] == pytest.approx([0.780152, 0.648934, 0.540599])
    assert r["params"] == 6782976 and r["peak"] is None  # a CPU run: no CUDA memory line
    assert sdl.parse_output("accelerator device: cpu\n") == {"times": [], "te": [], "params": None, "peak": None}
    peak = sdl.parse_output(text + "sdtk-peak-memory 15569256448 17179869184\n")
    assert peak["peak"] == (15569256448, 17179869184) and peak["times"] == r["times"]
    with pytest.raises(ValueError, match="out of order"):
        sdl.parse_output("sdtk-step 1 1.0\nsdtk-step 3 2.0\n")


def test_sd_scripts_command_lines():
    """Both benchmarks' sd-scripts runs: the same training as ours (the options ddp_scaling's and
    gpu.py's docstrings list; each list was parsed by sd-scripts' own setup_parser), launched as
    the docstrings say."""
    import argparse

    ddp, gpu, sdl = _load("ddp_scaling"), _load("gpu"), _load("sd_scripts_launch")

    def opts(args):
        args = [str(x) for x in args]
        return {k: (args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else True)
                for i, k in enumerate(args) if k.startswith("--")}

    a = argparse.Namespace(batch=1, warmup=1, steps=3)
    lora = opts(ddp.sd_scripts_args("lora", "/m", "/tok", "/d", "/o", a))
    db = opts(ddp.sd_scripts_args("dreambooth", "/m", "/tok", "/d", "/o", a))
    for o in (lora, db):
        assert (o["--resolution"], o["--train_batch_size"], o["--max_train_steps"]) == ("64", "1", "4")
        assert (o["--optimizer_type"], o["--learning_rate"], o["--mixed_precision"]) == ("SGD", "1e-4", "no")
        assert o["--cache_latents"] and o["--sdpa"] and o["--tokenizer_cache_dir"] == "/tok"
        assert "--cache_text_encoder_outputs" not in o and "--no_token_padding" not in o
    assert (lora["--network_dim"], lora["--network_alpha"], lora["--network_train_unet_only"]) == ("16", "16", True)
    assert db["--stop_text_encoder_training"] == "-1" and "--network_module" not in db
    files = {"model": "/m", "clip_l": "/c", "t5xxl": "/t", "ae": "/a"}
    entries = {}
    for name, (script, arch, size, batch) in gpu.CASES.items():
        assert (script, arch) in gpu.SD_SCRIPTS_ENTRY  # every training case has an sd-scripts row
        dit = arch in gpu.DIT_ARCHS
        entry, args = gpu.sd_scripts_args(name, gpu.sd_scripts_files("/w", arch) if dit else files, "/tok", "/d", "/o", 16)
        entries[name] = entry
        o, ours = opts(args), opts(gpu.case_args(name, "/d", "/o", 16, False, "/w")[1])
        assert (o["--resolution"], o["--train_batch_size"], o["--max_train_steps"]) == (str(size), str(batch), "16")
        assert o["--full_bf16"] and o["--mixed_precision"] == "bf16" and o["--cache_latents"] and o["--sdpa"]
        model = ours["--pretrained_model_name_or_path"] if dit else "/m"
        assert o["--pretrained_model_name_or_path"] == model and o["--tokenizer_cache_dir"] == "/tok"
        assert ("--cache_text_encoder_outputs" in o) == (arch != "sd15")  # SD1's script has no such option
        # every training option of ours is sd-scripts' too, with the same value (the files: own test)
        for k in set(ours) - {"--pretrained_model_name_or_path", "--output_dir", "--save_model_as", "--clip_l",
                              "--t5xxl", "--ae", "--cache_text_encoder_outputs", "--qwen3", "--vae",
                              "--t5_tokenizer_path", "--gemma2"}:
            assert o[k] == ours[k], (name, k)
        if arch == "flux":
            assert (o["--clip_l"], o["--t5xxl"], o["--ae"]) == ("/c", "/t", "/a")
            assert (o["--timestep_sampling"], o["--model_prediction_type"], o["--guidance_scale"],
                    o["--discrete_flow_shift"], o["--t5xxl_max_token_length"]) == ("sigma", "sigma_scaled", "3.5", "3.0", "512")
    assert entries == {"sd15-lora-b1": "train_network.py", "sd15-lora-b4": "train_network.py",
                       "sdxl-lora-b1": "sdxl_train_network.py", "sdxl-lora-b4": "sdxl_train_network.py",
                       "sdxl-full-b1": "sdxl_train.py", "flux-lora-b1": "flux_train_network.py", "flux-full-swap-b1": "flux_train.py",
                       "anima-lora-b1": "anima_train_network.py", "lumina-lora-b1": "lumina_train_network.py"}
    lora = opts(gpu.sd_scripts_args("flux-lora-b1", files, "/tok", "/d", "/o", 16)[1])
    assert (lora["--network_module"], lora["--network_dim"], lora["--network_alpha"]) == ("networks.lora_flux", "16", "16")
    assert lora["--fp8_base"] and lora["--network_train_unet_only"] and lora["--optimizer_type"] == "AdamW"
    assert "--blocks_to_swap" not in lora and "--fused_backward_pass" not in lora
    full = gpu.sd_scripts_args("flux-full-swap-b1", files, "/tok", "/d", "/o", 16)[1]
    assert full[full.index("--optimizer_args") + 1:full.index("--optimizer_args") + 4] == [
        "scale_parameter=False", "relative_step=False", "warmup_init=False"]
    full = opts(full)
    assert (full["--blocks_to_swap"], full["--optimizer_type"], full["--learning_rate"]) == ("8", "Adafactor", "1e-6")
    assert full["--fused_backward_pass"] and "--fp8_base" not in full and "--network_module" not in full
    assert "--gradient_checkpointing" not in full  # ours does not checkpoint either
    sdxl = opts(gpu.sd_scripts_args("sdxl-full-b1", {"model": "/m"}, "/tok", "/d", "/o", 16)[1])
    assert (sdxl["--optimizer_type"], sdxl["--learning_rate"], sdxl["--resolution"]) == ("Adafactor", "1e-6", "1024")
    assert sdxl["--fused_backward_pass"] and sdxl["--cache_text_encoder_outputs"] and "--blocks_to_swap" not in sdxl
    table = gpu.format_table([{"case": "sd15-lora-b1", "sd_scripts_it_s": 3.5, "sd_scripts_params": 6782976}], None)
    assert table[-1].split() == ["sd15-lora-b1", "sd-scripts", "3.50", "it/s,", "6,782,976", "trainable", "parameters"]
    table = gpu.format_table([{"case": "flux-lora-b1", "sd_scripts_it_s": 1.25, "sd_scripts_params": 9,
                               "sd_scripts_peak_alloc_gib": 14.5, "sd_scripts_peak_reserved_gib": 16.0}], None)
    assert table[-1].split() == ["flux-lora-b1", "sd-scripts", "1.25", "it/s,", "peak", "14.50", "GiB", "allocated",
                                 "/", "16.00", "GiB", "reserved,", "9", "trainable", "parameters"]
    two = sdl.command("/py", "/sd", "train_db.py", ["--x", 1], 2, 1234)
    one = sdl.command("/py", "/sd", "train_db.py", ["--x", 1], 1)
    plain = sdl.command("/py", "/sd", "train_network.py", ["--x", 1], None)
    assert two[:3] == ["/py", "-m", "accelerate.commands.launch"] and "--multi_gpu" in two and "--cpu" not in two
    assert "--cpu" in one and "--multi_gpu" not in one
    for cmd in (two, one):
        i = cmd.index("--num_processes")
        assert cmd[i + 1] == str(cmd is two and 2 or 1)
        assert cmd[cmd.index("--num_cpu_threads_per_process") + 1] == "1"
    assert plain == ["/py", os.path.join(ROOT, "benchmarks", "sd_scripts_launch.py"), "/sd/train_network.py", "--x", "1"]
    env = sdl.clean_env({"OMP_NUM_THREADS": "1"})
    assert "PYTHONPATH" not in env and env["HF_HUB_OFFLINE"] == "1" and env["OMP_NUM_THREADS"] == "1"


def test_sd_scripts_launcher_marks_optimizer_steps(monkeypatch, capsys):
    """The launcher's marks on an accelerate training loop (in this process, accelerate's state reset
    before and after): one mark per optimizer step, not per accumulation micro-step; once, the
    trainable parameters the optimizer holds (Linear(3, 2): 8; the frozen Linear's 6 not counted);
    from step 2 on, the text encoder's forward time of that step."""
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.scheduler import AcceleratedScheduler

    sdl, step_timer = _load("sd_scripts_launch"), _load("step_timer")

    class Encoder(torch.nn.Module):
        def forward(self, x):
            return x * 2

    monkeypatch.setattr(AcceleratedOptimizer, "step", AcceleratedOptimizer.step)  # restored afterwards
    monkeypatch.setattr(AcceleratedScheduler, "step", AcceleratedScheduler.step)
    monkeypatch.setattr(sdl, "_clip_classes", lambda: [Encoder])  # not transformers' own classes
    monkeypatch.delenv("RANK", raising=False)
    sdl._install_step_marks()
    step_timer._reset_accelerate()
    try:
        acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
        lin, frozen = torch.nn.Linear(3, 2), torch.nn.Linear(2, 2).requires_grad_(False)
        opt = torch.optim.SGD(list(lin.parameters()) + list(frozen.parameters()), lr=0.1)
        lin, opt = acc.prepare(lin, opt)
        te = Encoder()
        for _ in range(6):  # 6 micro-steps: 3 optimizer steps
            with acc.accumulate(lin):
                te(torch.ones(3))
                acc.backward(lin(torch.ones(1, 3)).sum())
                opt.step()
                opt.zero_grad()
    finally:
        step_timer._reset_accelerate()
    out = capsys.readouterr().out
    assert out.count("sdtk-trainable-params ") == 1 and out.count("sdtk-step ") == 3
    assert " te=" not in out.splitlines()[1]  # step 1: the timer was installed during it
    r = sdl.parse_output(out)
    assert r["params"] == 8 and len(r["times"]) == 2 and all(t > 0 for t in r["times"])
    assert len(r["te"]) == 2 and all(0 < t < s for t, s in zip(r["te"], r["times"]))


def test_sd_scripts_text_encoder_timer():
    """Each timed class's forward still returns its result and adds its own duration (a forward
    that sleeps 20 ms) to the sum; a class not timed adds nothing."""
    import time

    sdl = _load("sd_scripts_launch")

    class Encoder(torch.nn.Module):
        def forward(self, x):
            time.sleep(0.02)
            return x + 1

    class Other(Encoder):
        pass

    acc = {"seconds": 0.0}
    assert sdl._time_text_encoders([Encoder], acc) and not sdl._time_text_encoders([], acc)
    assert Encoder()(torch.tensor(1.0)).item() == 2.0 and 0.02 <= acc["seconds"] < 0.5
    before = acc["seconds"]
    Other.forward = lambda self, x: x  # its own forward, not the timed one
    Other()(torch.tensor(1.0))
    assert acc["seconds"] == before


def test_sd_scripts_launcher_leaves_frozen_modules_unwrapped_on_cpu_processes(monkeypatch):
    """On several CPU processes a model without trainable parameters is prepared with accelerate's
    no-DDP switch (evaluation_mode), as accelerate does on GPUs; any other model, or any model
    elsewhere, is prepared as asked."""
    from types import SimpleNamespace

    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    sdl = _load("sd_scripts_launch")
    calls = []
    monkeypatch.setattr(Accelerator, "prepare_model",
                        lambda self, model, device_placement=None, evaluation_mode=False: calls.append(evaluation_mode))
    sdl._skip_ddp_for_frozen_modules_on_cpu()
    frozen, trained = torch.nn.Linear(2, 2).requires_grad_(False), torch.nn.Linear(2, 2)
    cpus, one = SimpleNamespace(distributed_type=DistributedType.MULTI_CPU), SimpleNamespace(distributed_type=DistributedType.NO)
    for self, model in ((cpus, frozen), (cpus, trained), (one, frozen)):
        Accelerator.prepare_model(self, model)
    assert calls == [True, False, False]


def test_sd_scripts_tokenizer_caches_hold_the_tiny_t5_tokenizer(tmp_path):
    """gpu.py's --tokenizer_cache_dir holds T5-XXL's tokenizer id as a folder transformers'
    T5TokenizerFast loads offline (a config without transformers 5's list-valued
    extra_special_tokens, which sd-scripts' transformers 4 cannot read), giving our tiny
    tokenizer's ids (all below T5-XXL's 32128); the hub cache holds the same files under both
    FLUX.1 tokenizer ids in the hub's layout (refs/main -> snapshots/<revision>)."""
    import json

    from transformers import CLIPTokenizer, T5TokenizerFast

    from library.models import t5

    sdl = _load("sd_scripts_launch")
    cache = sdl.tokenizer_cache(str(tmp_path))
    folder = os.path.join(cache, "google_t5-v1_1-xxl")
    with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
        assert set(json.load(f)) == {"tokenizer_class", "eos_token", "pad_token", "unk_token", "extra_ids",
                                     "model_max_length"}
    tiny = t5.build_tiny_tokenizer()
    want, want_mask = t5.tokenize(tiny, ["a photo of sks dog", "red cat"], 512)
    hub = sdl.hub_cache(str(tmp_path))
    for tok in (T5TokenizerFast.from_pretrained(folder, local_files_only=True),
                T5TokenizerFast.from_pretrained("google/t5-v1_1-xxl", cache_dir=hub, local_files_only=True)):
        got = tok(["a photo of sks dog", "red cat"], max_length=512, padding="max_length", truncation=True,
                  return_tensors="pt")
        assert torch.equal(got["input_ids"], want) and torch.equal(got["attention_mask"], want_mask)
        assert int(got["input_ids"].max()) < 32128 and (tok.pad_token_id, tok.eos_token_id) == (0, 1)
    clip = CLIPTokenizer.from_pretrained("openai/clip-vit-large-patch14", cache_dir=hub, local_files_only=True)
    assert len(clip) == 49408
    with open(os.path.join(hub, "models--google--t5-v1_1-xxl", "refs", "main"), encoding="utf-8") as f:
        assert f.read() == sdl.HUB_REVISION


def test_sd_scripts_launcher_marks_fused_steps_at_the_scheduler(monkeypatch, capsys):
    """A fused backward pass never calls the optimizer's step (sd-scripts' flux_train.py steps each
    parameter in a gradient hook, then calls the scheduler's step once per step): the scheduler's
    step marks it, after counting the scheduler's optimizers' trainable parameters once (Linear(3,
    2): 8). With an optimizer step before the scheduler step (train_network.py's loop) each step
    is marked once, not twice."""
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.scheduler import AcceleratedScheduler

    sdl, step_timer = _load("sd_scripts_launch"), _load("step_timer")
    for fused in (True, False):
        monkeypatch.setattr(AcceleratedOptimizer, "step", AcceleratedOptimizer.step)  # restored by undo
        monkeypatch.setattr(AcceleratedScheduler, "step", AcceleratedScheduler.step)
        monkeypatch.setattr(sdl, "_clip_classes", lambda: [])
        monkeypatch.delenv("RANK", raising=False)
        sdl._install_step_marks()
        step_timer._reset_accelerate()
        try:
            acc = Accelerator(cpu=True)
            lin = torch.nn.Linear(3, 2)
            opt = torch.optim.SGD(lin.parameters(), lr=0.1)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
            lin, opt, sched = acc.prepare(lin, opt, sched)
            for _ in range(3):
                acc.backward(lin(torch.ones(1, 3)).sum())
                if fused:  # what adafactor_fused's step_param does per parameter, in the backward
                    with torch.no_grad():
                        for p in lin.parameters():
                            p.sub_(0.1 * p.grad)
                            p.grad = None
                else:
                    opt.step()
                    opt.zero_grad()
                sched.step()
        finally:
            step_timer._reset_accelerate()
            monkeypatch.undo()  # the real steps back: the next round wraps them afresh
        out = capsys.readouterr().out
        assert out.count("sdtk-trainable-params 8") == 1 and out.count("sdtk-step ") == 3, (fused, out)
        assert len(sdl.parse_output(out)["times"]) == 2


def test_sd_scripts_launcher_leaves_sd_scripts_library_alone(tmp_path):
    """Run as a script, the launcher is in sd-scripts' process: the training script's own
    ``library`` package (a stand-in beside it here) is the one it imports, not ours."""
    (tmp_path / "library").mkdir()
    (tmp_path / "library" / "__init__.py").write_text("WHOSE = 'sd-scripts'\n")
    (tmp_path / "train.py").write_text("import library, sys\nprint('library of', library.WHOSE)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "sd_scripts_launch.py"), str(tmp_path / "train.py")],
                       cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "library of sd-scripts" in p.stdout and "sdtk-peak-memory" not in p.stdout  # no CUDA here


def test_sd_scripts_flux_check_without_sd_scripts(tmp_path, capsys):
    """benchmarks/sd_scripts_flux_check.py without an sd-scripts checkout: a folder that is not one
    is one line and exit 2; the headers it hands sd-scripts are the meta tensors' names, shapes
    and safetensors dtypes; the values it expects sd-scripts to parse are gpu.py's for each row."""
    check = _load("sd_scripts_flux_check")
    assert check.main(["--sd-scripts", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --sd-scripts") and "\n" not in err
    meta = {"a": torch.empty(2, 3, dtype=torch.bfloat16, device="meta"), "b": torch.empty(4, dtype=torch.int64, device="meta")}
    assert check.headers({"f": (meta, None)}) == {"f": {"a": [[2, 3], "BF16"], "b": [[4], "I64"]}}
    want = check.expected_values("flux-full-swap-b1")
    assert (want["blocks_to_swap"], want["fused_backward_pass"], want["optimizer_type"]) == (8, True, "Adafactor")
    assert want["resolution"] == "1024" and want["t5xxl_max_token_length"] == 512 and not want["gradient_checkpointing"]
    assert check.expected_values("flux-lora-b1")["fp8_base"] and check.expected_values("sd15-lora-b1")["cache_text_encoder_outputs"] is None
    assert set(check.expected_values("sdxl-lora-b4")) <= set(check.expected_values("flux-lora-b1"))


def test_sd_scripts_lumina_check_without_sd_scripts(tmp_path, capsys):
    """benchmarks/sd_scripts_lumina_check.py: a folder that is not an sd-scripts checkout is one line
    and exit 2; our side's files load back (the transformer strict, the outputs of both forwards)."""
    from safetensors.torch import load_file

    from library.models.families.lumina import nextdit

    check = _load("sd_scripts_lumina_check")
    assert check.main(["--sd-scripts", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --sd-scripts") and "\n" not in err
    config = check.write_inputs(str(tmp_path))
    model = nextdit.NextDiT(nextdit.NextDiTConfig(**{k: v for k, v in config.items()}))
    model.load_state_dict(load_file(str(tmp_path / "transformer.safetensors")), strict=True)
    io = load_file(str(tmp_path / "io.safetensors"))
    with torch.no_grad():
        assert torch.equal(model(io["x"], io["t"], io["cap"], io["mask"]), io["out"])
    assert not torch.allclose(io["out"], io["out_lora"])


def test_sd_scripts_anima_check_without_sd_scripts(tmp_path, capsys):
    """benchmarks/sd_scripts_anima_check.py: a folder that is not an sd-scripts checkout is one line
    and exit 2; our side's files load back (the DiT strict from the released layout, the outputs of
    both forwards, the groups of the rates sent, the metadata of our LoRA file)."""
    import json

    from safetensors.torch import load_file

    from library.models.families.anima import weights

    check = _load("sd_scripts_anima_check")
    assert check.main(["--sd-scripts", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --sd-scripts") and "\n" not in err
    config = check.write_inputs(str(tmp_path))
    dit = weights.load_dit(str(tmp_path / "dit.safetensors"))
    assert (dit.config.model_channels, dit.config.adapter.vocab_size) == (config["model_channels"],
                                                                   config["adapter"]["vocab_size"])
    io = load_file(str(tmp_path / "io.safetensors"))
    with torch.no_grad():
        out = dit(io["x"], io["sigma"], io["states"], io["t5_ids"], io["t5_mask"], io["q_mask"])
    assert torch.equal(out, io["out"]) and not torch.allclose(io["out"], io["out_lora"])
    groups = json.loads((tmp_path / "groups.json").read_text())
    assert set(groups["lr"].values()) == {1e-2, 2e-2, 5e-3, 3e-3} and all(".mlp." in n for n in groups["frozen"])
    assert json.loads((tmp_path / "metadata.json").read_text())["modelspec.architecture"] == "anima-preview/lora"


def test_text_cache_rate_encodes_every_caption(capsys):
    from benchmarks import text_cache_rate

    caps = text_cache_rate.captions(16)
    assert len(set(caps)) == 16 and caps == text_cache_rate.captions(16)  # distinct, the same every run
    threads = torch.get_num_threads()
    try:
        assert text_cache_rate.main(["--captions", "16", "--repeats", "2", "--batch", "4"]) == 0
    finally:
        torch.set_num_threads(threads)  # the benchmark measures on one thread
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("text-encoder caching, 16 captions, batch 4:") and line.endswith("captions/s")
    assert len(line.split(":")[1].split()) == 3  # two rates and the unit



def test_model_tools_check_refuses_a_folder_that_is_not_sd_scripts_and_judges_by_hand(tmp_path, capsys):
    """benchmarks/sd_scripts_model_tools_check.py: a non-checkout is one line; its block-weighted
    judge gives 0 for the exact sum and the known error for a LoRA at half its weight."""
    from safetensors.torch import save_file

    from benchmarks import sd_scripts_model_tools_check as mt

    assert mt.main(["--sd_scripts", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --sd_scripts") and "\n" not in err
    g = torch.Generator().manual_seed(0)
    name = "lora_unet_down_blocks_0_attentions_0_proj_in"  # SD1 block IN01
    a = {f"{name}.lora_down.weight": torch.randn(2, 8, generator=g),
         f"{name}.lora_up.weight": torch.randn(8, 2, generator=g), f"{name}.alpha": torch.tensor(2.0)}
    save_file(a, str(tmp_path / "a.safetensors"))
    weights = [1.0] * 26
    weights[2] = 0.5  # IN01
    half = dict(a)
    half[f"{name}.lora_up.weight"] = a[f"{name}.lora_up.weight"] * 0.5
    save_file(half, str(tmp_path / "half.safetensors"))
    exact = mt.block_weighted_error(str(tmp_path / "half.safetensors"), [(str(tmp_path / "a.safetensors"), 1.0, weights)], False)
    assert exact.startswith("relative error of the deltas: worst 0, ")
    off = mt.block_weighted_error(str(tmp_path / "a.safetensors"), [(str(tmp_path / "a.safetensors"), 1.0, weights)], False)
    assert "worst 1, " in off  # the unweighted delta is twice the half-weighted one


def test_gpu_sd_scripts_rows_for_anima_and_lumina(tmp_path, capsys):
    """gpu.py's sd-scripts side of anima-lora-b1 / lumina-lora-b1: anima_train_network.py /
    lumina_train_network.py with dit_weights' files in sd-scripts' flags (Anima's VAE as the one
    weights file its loader reads, no --llm_adapter_path: the adapter is in the DiT file), every flag
    one sd-scripts' parser defines (its option lists at the audited commit), the row's training
    options unchanged; the Gemma tokenizer lumina_train_network.py asks the hub for is found in
    --tokenizer_cache_dir's hub layout offline; benchmarks/sd_scripts_dit_rows_check.py refuses a
    folder that is not a checkout in one line."""
    import json

    from huggingface_hub import try_to_load_from_cache
    from transformers import AutoTokenizer

    from library.models.families.lumina import text

    gpu = _load("gpu")
    here = os.path.join(ROOT, "tests", "config")
    parsers = {"anima": json.load(open(os.path.join(here, "sd_scripts_anima_options.json")))["scripts"],
               "lumina": json.load(open(os.path.join(here, "sd_scripts_lumina_options.json")))["scripts"]}
    work = str(tmp_path)
    want = {"anima": {"--qwen3": os.path.join(work, "qwen3-random"),
                      "--vae": os.path.join(work, "qwen-image-vae-random", "diffusion_pytorch_model.safetensors"),
                      "--t5_tokenizer_path": os.path.join(work, "t5-tokenizer"),
                      "--pretrained_model_name_or_path": os.path.join(work, "anima-random.safetensors")},
            "lumina": {"--gemma2": os.path.join(work, "gemma2-random.safetensors"),
                       "--ae": os.path.join(work, "lumina-ae-random.safetensors"),
                       "--pretrained_model_name_or_path": os.path.join(work, "lumina2-random.safetensors")}}
    entries = {"anima": "anima_train_network.py", "lumina": "lumina_train_network.py"}
    for arch, name in (("anima", "anima-lora-b1"), ("lumina", "lumina-lora-b1")):
        entry, args = gpu.sd_scripts_args(name, gpu.sd_scripts_files(work, arch), "tok", "data", "out", 5)
        assert entry == entries[arch]
        flags = [a for a in args if isinstance(a, str) and a.startswith("--")]
        assert len(flags) == len(set(flags)) and "--llm_adapter_path" not in flags
        assert {f[2:] for f in flags} <= set(parsers[arch][entry]), name
        given = {a: args[i + 1] for i, a in enumerate(args) if a in want[arch]}
        assert given == want[arch]
        opts = gpu.training_options(name, dry=False)
        start = args.index(opts[0])
        assert args[start:start + len(opts)] == opts and "--timestep_sampling" in opts
    cache = gpu.sd_scripts_tokenizers(work)
    # the hub cache layout resolves offline (transformers 4, sd-scripts', then reads the folder; 5 would
    # also ask for the model's config.json), and the folder is the tiny Gemma tokenizer
    found = try_to_load_from_cache("google/gemma-2-2b", "tokenizer_config.json", cache_dir=cache)
    assert isinstance(found, str)
    tok = AutoTokenizer.from_pretrained(os.path.dirname(found), local_files_only=True)
    ours = text.build_tiny_tokenizer()
    assert tok("a photo of sks dog")["input_ids"] == ours("a photo of sks dog")["input_ids"]
    assert (tok.bos_token, tok.pad_token, tok.eos_token) == ("<bos>", "<pad>", "<eos>")
    check = _load("sd_scripts_dit_rows_check")
    assert check.main(["--sd-scripts", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --sd-scripts") and "\n" not in err
