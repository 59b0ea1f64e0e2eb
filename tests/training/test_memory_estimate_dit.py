"""The memory estimate of Anima and Lumina 2 (their homes' memory hooks): the counted parts equal a
real run's, the fake forward saves what the real one saves, the cached bytes are the real cache's,
files are estimated from headers alone, and the full-size shapes count as diffusers' own model."""
import contextlib
import os

import pytest
import torch

from library.training import memory_estimate as me
from tests.training.test_memory_estimate import (TINY_PEAK_TOLERANCE_GIB, _nbytes, _optimizers, _stepping,
                                                 assert_estimate_counts_the_run, estimate_and_run,
                                                 measured_train_peak, refuse_tensor_reads)

ANIMA_LORA = ["--network_module", "networks.lora_anima", "--network_dim", "4"]
LUMINA_LORA = ["--network_module", "networks.lora_lumina", "--network_dim", "4"]
# every case caches latents; the text-encoder cases cache their outputs too
CASES = {
    "anima-lora-adamw-cached-text": ("train_lora", "tiny-anima", [
        *ANIMA_LORA, "--optimizer_type", "AdamW", "--cache_text_encoder_outputs", "--qwen3_max_token_length", "24",
        "--t5_max_token_length", "16"]),
    "anima-lora-lion-bf16-gc": ("train_lora", "tiny-anima", [
        *ANIMA_LORA, "--optimizer_type", "Lion", "--mixed_precision", "bf16", "--gradient_checkpointing"]),
    # anima_train.py's per-part rates: the MLPs frozen (mlp_lr 0), the others in their groups
    "anima-full-adamw-mlp-frozen": ("train_dreambooth", "tiny-anima", ["--optimizer_type", "AdamW", "--mlp_lr", "0",
                                                                        "--mod_lr", "1e-4"]),
    "lumina-lora-te-adamw": ("train_lora", "tiny-lumina", [*LUMINA_LORA, "--optimizer_type", "AdamW"]),
    "lumina-full-fused-adafactor-gc-swap": ("train_dreambooth", "tiny-lumina", [
        "--optimizer_type", "Adafactor", "--fused_backward_pass", "--gradient_checkpointing",
        "--blocks_to_swap", "1"]),
}


UNSTEPPED = {"lumina-full-fused-adafactor-gc-swap": lambda name: name == "norm_final.weight",
             "lumina-lora-te-adamw": lambda name: name.startswith("lora_te_layers_2_")}  # tiny Gemma-2: 3 layers


@pytest.mark.parametrize("case", sorted(CASES))
def test_estimate_counts_what_the_run_holds(case, train, dataset, tmp_path):
    """Parameters per component (trained or frozen, dtype), gradients and optimizer state against
    the run's own; what the run released after caching uncounted."""
    script, model, extra = CASES[case]
    est, run = estimate_and_run(train, dataset, tmp_path, script, model, extra)
    # trained parameters that never get a gradient, for which the run's optimizer keeps no state
    # (the estimate counts it): Lumina's norm_final (in the released weights, never used) in a
    # full fine-tune, and a LoRA's modules on Gemma-2's last layer (the penultimate states are read)
    names = {id(p): n for m in (run.parts.bundle.unet, run.parts.method.network) if m is not None
             for n, p in m.named_parameters()}
    stepped = {id(p) for o in _optimizers(run.parts.stepper) for p in o.state}
    unused = [p for p in run.parts.params if p.requires_grad and id(p) not in stepped]
    expected = UNSTEPPED.get(case, lambda n: False)
    assert unused == [] if case not in UNSTEPPED else unused and all(expected(names[id(p)]) for p in unused)
    rule = me.optimizer_rule(run.opts)
    unstepped = sum(rule.param_bytes(tuple(p.shape)) for p in unused)
    assert_estimate_counts_the_run(est, run, _stepping(case), unstepped)
    released = {"vae"} | ({"text_encoder"} if "--cache_text_encoder_outputs" in extra else set())
    for line in est.params:
        assert line.resident == (line.trained or line.component not in released), line
    if "swap" in case:  # the swapped blocks' bytes, from the run's own swap
        swap = run.parts.bundle.unet.block_swap
        assert f"{swap.swapped_bytes() / me.GIB:.3f} GiB of the transformer's weights in host" in est.device_note


@pytest.mark.parametrize("model", ["tiny-anima", "tiny-lumina"])
def test_dry_run_prints_the_breakdown(model, dataset, tmp_path, run_script):
    """The dry run of a LoRA with network_module unset (the family's own LoRA) prints the plan, then
    the estimate with the network's trained parameters and the total; nothing is written."""
    rc, out, err = run_script("train_lora", ["--pretrained_model_name_or_path", model, "--train_data_dir", dataset,
                                             "--output_dir", str(tmp_path / "o"), "--resolution", "64",
                                             "--max_train_steps", "2", "--dry_run"])
    assert rc == 0, err
    plan, estimate = out.split("memory estimate (training loop", 1)
    assert "total_steps: 2" in plan and "Traceback" not in out + err
    assert "parameters, trained: network" in estimate and "total peak of the training loop:" in estimate
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("model, gc", [("tiny-anima", False), ("tiny-anima", True),
                                       ("tiny-lumina", False), ("tiny-lumina", True)])
def test_fake_forward_saves_what_the_real_forward_saves(model, gc):
    """The saved-for-backward bytes counted on fake tensors equal the same count on the loaded
    model, with and without checkpointing; the text tokens are the real encoding's."""
    from library.config.parse import parse_args
    from library.models import flow_family
    from library.training import flow_memory
    from library.training.methods import FullMethod

    opts = parse_args("train_dreambooth", ["--pretrained_model_name_or_path", model, "--train_data_dir", "unused",
                                           "--resolution", "64", "--train_batch_size", "2", "--max_train_steps", "1",
                                           "--dry_run"] + (["--gradient_checkpointing"] if gc else []))
    real = flow_family.load_from_options(opts.replace(script="train_lora"))  # Anima loads for train_lora only
    comps = {"unet": real.unet, "vae": real.vae, "text_encoder": real.text_encoders[0]}
    fm = flow_family.family_model_for(real, opts)
    with torch.no_grad():
        cond = fm.encode(fm.tokenize(["a photo"]), None)
    assert flow_memory.text_tokens(opts, real.family, comps)[:2] == tuple(cond.hidden_states.shape[1:])
    method = FullMethod(opts, real)
    method.setup()
    counted = me.count_activations(opts, real.family, comps, method, contextlib.nullcontext(), (64, 64), 2)
    est = me.estimate(opts, "dreambooth")
    assert counted.saved > 0 and (counted.recompute > 0) == gc
    assert est.activations == pytest.approx(
        int(me.FLOW_ACTIVATION_FACTOR * (counted.saved + counted.recompute)) + counted.weight_copies, abs=256)


CACHE_CASES = {
    "anima-float32": ("tiny-anima", [*ANIMA_LORA, "--caption_dropout_rate", "0.5"]),
    "anima-bf16": ("tiny-anima", [*ANIMA_LORA, "--mixed_precision", "bf16", "--t5_max_token_length", "20"]),
    "lumina-float32": ("tiny-lumina", [*LUMINA_LORA, "--network_train_unet_only", "--caption_dropout_rate", "0.5"]),
    "lumina-bf16": ("tiny-lumina", [*LUMINA_LORA, "--network_train_unet_only", "--mixed_precision", "bf16",
                                    "--gemma2_max_token_length", "30"]),
}


@pytest.mark.parametrize("case", sorted(CACHE_CASES))
def test_cached_data_is_what_the_run_caches(case, train, dataset, tmp_path):
    """The estimate's cached latents and text-encoder outputs equal the bytes of the entries a
    real 1-step run cached (the empty caption of caption dropout, bf16 encoders, other lengths)."""
    from library.config.parse import parse_args

    model, extra = CACHE_CASES[case]
    argv = ["--pretrained_model_name_or_path", model, "--train_data_dir", dataset, "--output_dir",
            str(tmp_path / "o"), "--resolution", "64", "--max_train_steps", "1", "--learning_rate", "1e-3",
            "--max_grad_norm", "0", "--cache_latents", "--cache_text_encoder_outputs", *extra]
    rc, out, err, run = train("train_lora", argv)
    assert rc == 0, err
    caches = run.parts.caches
    real = sum(_nbytes(e) for e in caches.latents.values()) + sum(_nbytes(e) for e in caches.text.values())
    assert len(caches.text) >= 1 + ("--caption_dropout_rate" in extra)
    est = me.estimate(parse_args("train_lora", [*argv, "--dry_run"]), "lora", run.tset)
    assert est.cached_data == real


def _anima_files(tmp_path) -> tuple[str, list]:
    """tiny-anima as a DiT file (adapter inside), a qwen3 folder, a VAE folder and a T5 tokenizer."""
    from library.models.families.anima import tiny, weights

    m = tiny.build()
    weights.save_dit(m["dit"], str(tmp_path / "dit.safetensors"))
    for name in ("qwen3", "qwen3_tokenizer"):
        m[name].save_pretrained(tmp_path / "qwen3")
    m["vae"].save_pretrained(tmp_path / "vae")
    m["t5_tokenizer"].save_pretrained(tmp_path / "t5")
    return str(tmp_path / "dit.safetensors"), [
        "--qwen3", str(tmp_path / "qwen3"), "--vae", str(tmp_path / "vae"), "--t5_tokenizer_path", str(tmp_path / "t5"),
        *ANIMA_LORA]


def _lumina_file(tmp_path) -> tuple[str, list]:
    """tiny-lumina as an original-layout transformer file with gemma2 and ae files."""
    from safetensors.torch import save_file

    from library.models.families.flux import flux_ae
    from library.models.families.lumina import loading, text, tiny

    p = tiny.build_tiny_lumina()
    m = loading.LuminaModel("original", tiny.nextdit.TINY, p["transformer"], p["gemma2"], p["tokenizer"], p["ae"],
                            "x", "y")
    loading.save_transformer(str(tmp_path / "lumina.safetensors"), m, p["transformer"].state_dict(), {})
    save_file({"model." + k: v.contiguous() for k, v in p["gemma2"].state_dict().items()},
              str(tmp_path / "gemma2.safetensors"), text.gemma2_file_metadata(p["gemma2"], p["tokenizer"]))
    save_file({k: v.contiguous() for k, v in flux_ae.ae_state_dict(p["ae"]).items()}, str(tmp_path / "ae.safetensors"),
              flux_ae.ae_file_metadata(p["ae"]))
    return str(tmp_path / "lumina.safetensors"), [
        "--gemma2", str(tmp_path / "gemma2.safetensors"), "--ae", str(tmp_path / "ae.safetensors"), *LUMINA_LORA,
        "--network_train_unet_only"]


def _lumina_folder(tmp_path) -> tuple[str, list]:
    """tiny-lumina as a diffusers folder (transformer/ by our saver, the rest by transformers / diffusers)."""
    from library.models.families.lumina import tiny
    from tests.models.test_lumina_loading import write_diffusers_folder

    return str(write_diffusers_folder(tiny.build_tiny_lumina(), tmp_path / "pipe")), [
        *LUMINA_LORA, "--network_train_unet_only"]


SOURCES = {"anima-file": (_anima_files, "anima"), "lumina-file": (_lumina_file, "lumina"),
           "lumina-diffusers-folder": (_lumina_folder, "lumina")}


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_files_and_folders_are_estimated_without_their_tensors(source, train, dataset, tmp_path, monkeypatch):
    """A DiT / transformer file with its parts' files, and a diffusers folder, estimated from
    headers and configs (reading tensor data fails the test): every component's parameter count
    and the LoRA's trained parameters equal the real run's, which loads them (Lumina's LoRA on the
    transformer alone: its Gemma-2 modules are test_estimate_counts_what_the_run_holds')."""
    from library.config.parse import parse_args
    from library.models import flow_family

    make, family = SOURCES[source]
    model, extra = make(tmp_path)
    assert flow_family.family_before_loading(model) == family
    argv = ["--pretrained_model_name_or_path", model, "--train_data_dir", dataset, "--output_dir",
            str(tmp_path / "o"), "--resolution", "64", "--max_train_steps", "1", "--learning_rate", "1e-3",
            "--cache_latents", *extra]
    with monkeypatch.context() as m:
        refuse_tensor_reads(m, family)
        est = me.estimate(parse_args("train_lora", [*argv, "--dry_run"]), "lora")
    rc, out, err, run = train("train_lora", argv)
    assert rc == 0, err
    assert_estimate_counts_the_run(est, run)


def _header_only_file(path: str, shapes: dict, metadata: dict | None = None) -> str:
    """A .safetensors file whose header names ``shapes`` (bf16) and that holds no tensor data:
    what the estimate reads of a full-size file (a loader would refuse it)."""
    import json
    import struct

    header, offset = {}, 0
    for k, s in shapes.items():
        n = 2 * int(torch.Size(s).numel())
        header[k] = {"dtype": "BF16", "shape": list(s), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
    return path


def _meta_shapes(module: torch.nn.Module, prefix: str = "") -> dict:
    return {prefix + k: tuple(v.shape) for k, v in module.state_dict().items()}


def test_full_size_lumina_counts_as_diffusers_model(tmp_path, monkeypatch):
    """Lumina Image 2.0 at its released shapes (a header-only transformer file, Gemma-2 2B and
    FLUX.1's autoencoder headers): the transformer the estimate builds has the parameters of
    diffusers' own Lumina2Transformer2DModel at the 2B config (plus the unused norm_final, 2304),
    Gemma-2 2B's are transformers' Gemma2Model's, the autoencoder's its header's."""
    from diffusers import Lumina2Transformer2DModel
    from transformers import Gemma2Config, Gemma2Model

    from library.config.parse import parse_args
    from library.models.families.flux import flux_ae
    from library.models.families.lumina import nextdit, text

    with torch.device("meta"):
        ours = nextdit.NextDiT(nextdit.LUMINA2_2B)
        ref = Lumina2Transformer2DModel(sample_size=128, patch_size=2, in_channels=16, hidden_size=2304, num_layers=26,
                                        num_refiner_layers=2, num_attention_heads=24, num_kv_heads=8, multiple_of=256,
                                        norm_eps=1e-5, scaling_factor=1.0, axes_dim_rope=(32, 32, 32),
                                        axes_lens=(300, 512, 512), cap_feat_dim=2304)
        gemma = Gemma2Model(Gemma2Config(**text.GEMMA2_2B))
        ae_shapes = {k: tuple(v.shape) for k, v in flux_ae.ae_state_dict(flux_ae.build_ae(flux_ae.FLUX_AE_CONFIG)).items()}
    model = _header_only_file(str(tmp_path / "lumina.safetensors"), _meta_shapes(ours))
    gemma_file = _header_only_file(str(tmp_path / "gemma2.safetensors"), _meta_shapes(gemma, "model."))
    ae_file = _header_only_file(str(tmp_path / "ae.safetensors"), ae_shapes)
    refuse_tensor_reads(monkeypatch, "lumina")
    opts = parse_args("train_dreambooth", [
        "--pretrained_model_name_or_path", model, "--gemma2", gemma_file, "--ae", ae_file, "--train_data_dir", "unused",
        "--resolution", "1024", "--max_train_steps", "1", "--mixed_precision", "bf16", "--full_bf16",
        "--optimizer_type", "Adafactor", "--fused_backward_pass", "--gradient_checkpointing",
        "--cache_latents", "--cache_text_encoder_outputs", "--dry_run"])
    est = me.estimate(opts, "dreambooth")
    got = {line.component: line.numel for line in est.params}
    assert got["unet"] == sum(p.numel() for p in ref.parameters()) + 2304
    assert got["text_encoder"] == sum(p.numel() for p in gemma.parameters())
    assert got["vae"] == sum(int(torch.Size(s).numel()) for s in ae_shapes.values())
    assert 2.5e9 < got["unet"] < 2.7e9  # "Lumina-Image 2.0: 2.6B"
    # full_bf16: the transformer's bf16 weights alone stay (the autoencoder and Gemma-2 are released)
    assert est.resident_params == 2 * got["unet"] and est.total > est.resident_params


# measured 2026-12-07 (2-core x86_64, one thread): see docs/MEMORY_ESTIMATE.md
PEAK_CASES = {"anima-lora": ("train_lora", "tiny-anima", ANIMA_LORA),
              "lumina-full": ("train_dreambooth", "tiny-lumina", [])}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(PEAK_CASES))
def test_estimate_against_a_measured_cpu_peak(case, tmp_path):
    """A tiny Anima LoRA and a tiny Lumina 2 full fine-tune (AdamW, 64 px, 2 steps) in a fresh
    process: the training-loop peak resident set against the estimate, within the bound of the
    FLUX.1 check (the runtime constant's excess on a tiny process plus a margin)."""
    import json

    from library.config.parse import parse_args
    from tools.make_sample_dataset import make_sample_dataset

    script, model, extra = PEAK_CASES[case]
    data = str(tmp_path / "data")
    make_sample_dataset(data, n_images=2, size=64, repeats=2)
    argv = ["--pretrained_model_name_or_path", model, "--train_data_dir", data, "--output_dir", str(tmp_path / "o"),
            "--resolution", "64", "--max_train_steps", "2", "--cache_latents", "--max_grad_norm", "0",
            "--optimizer_type", "AdamW", *extra]
    measured = measured_train_peak(tmp_path, script, argv)
    est = me.estimate(parse_args(script, [*argv, "--dry_run"]), "lora" if script == "train_lora" else "dreambooth")
    print(json.dumps({"case": case, "estimate": est.total / me.GIB, "measured": measured}))
    assert abs(est.total / me.GIB - measured) <= TINY_PEAK_TOLERANCE_GIB, (est.total / me.GIB, measured)


def _llm_adapter_params(vocab=32128, d=1024, source=1024, layers=6, heads=16, mlp=4096) -> int:
    """Anima's LLM adapter counted by hand: the T5 embedding; per block a self- and a cross-attention
    (q, k, v, o without bias, per-head q / k norms), three RMS norms and a biased 2-layer MLP; the
    biased output projection and its norm (no input projection: the model width is the target's)."""
    head = d // heads
    attention = 2 * d * d + 2 * source * d + 2 * head  # the cross-attention's k / v read Qwen3's width
    self_attention = 4 * d * d + 2 * head
    block = self_attention + attention + 3 * d + (d * mlp + mlp) + (mlp * d + d)
    return vocab * d + layers * block + (d * d + d) + d


def test_full_size_anima_counts_as_diffusers_cosmos(tmp_path, monkeypatch):
    """Anima at its released shapes (header-only DiT, Qwen3-0.6B and Qwen-Image VAE files): the DiT
    the estimate builds has the parameters of diffusers' CosmosTransformer3DModel at
    Cosmos-Predict2 2B's config plus the LLM adapter counted by hand; Qwen3 is Qwen3-0.6B's."""
    from diffusers import AutoencoderKLQwenImage, CosmosTransformer3DModel
    from transformers import Qwen3Config, Qwen3Model

    from library.config.parse import parse_args
    from library.models.families.anima import model as anima_model
    from library.models.families.anima import parts

    with torch.device("meta"):
        dit = anima_model.Anima(anima_model.FULL)
        cosmos = CosmosTransformer3DModel(in_channels=16, out_channels=16, num_attention_heads=16,
                                          attention_head_dim=128, num_layers=28, mlp_ratio=4.0, text_embed_dim=1024,
                                          adaln_lora_dim=256, patch_size=(1, 2, 2), rope_scale=(1.0, 4.0, 4.0),
                                          concat_padding_mask=True, extra_pos_embed_type=None)
        qwen3 = Qwen3Model(Qwen3Config(**parts.QWEN3_06B))
        vae_shapes = _meta_shapes(AutoencoderKLQwenImage())
    model = _header_only_file(str(tmp_path / "anima.safetensors"), _meta_shapes(dit, "net."))
    qwen3_file = _header_only_file(str(tmp_path / "qwen3.safetensors"), _meta_shapes(qwen3, "model."))
    vae_file = _header_only_file(str(tmp_path / "vae.safetensors"), vae_shapes)
    refuse_tensor_reads(monkeypatch, "anima")
    opts = parse_args("train_lora", [
        "--pretrained_model_name_or_path", model, "--qwen3", qwen3_file, "--vae", vae_file, "--train_data_dir", "unused",
        "--resolution", "1024", "--max_train_steps", "1", "--mixed_precision", "bf16", *ANIMA_LORA,
        "--cache_latents", "--cache_text_encoder_outputs", "--dry_run"])
    est = me.estimate(opts, "lora")
    got = {(line.component, line.trained): line.numel for line in est.params}
    assert got[("unet", False)] == sum(p.numel() for p in cosmos.parameters()) + _llm_adapter_params()
    assert got[("text_encoder", False)] == sum(p.numel() for p in qwen3.parameters())
    assert got[("vae", False)] == sum(int(torch.Size(s).numel()) for s in vae_shapes.values())
    assert 2.0e9 < got[("unet", False)] < 2.2e9 and got[("network", True)] > 0
