"""The memory estimate that ``--dry_run`` prints (and a run prints next to its step plan).

Nothing is loaded: the model is built from its configuration under torch's ``FakeTensorMode``
(tensors with shapes, dtypes and a "cpu" device but no storage), from the same sources the
trainer loads (built-in names, diffusers folders, single files read only up to their safetensors
header). The trainer's own set-up of the model (library/training/model_setup.py
``set_up_method``: the dtypes, the parts stored in them, the method's set-up, its network stored)
then runs over that fake model (``NetworkMethod`` creates the real network modules,
``FullMethod`` picks the trained parts), so the parameter counts are those of the run, not a
table; the release after caching, the partial text cache and the stepper's units are the run's
own rules too (offload, partial_text_cache, stepper.step_units).

The peak of the training loop (one process, steady state: the optimizer state exists) is

    runtime + cached data + resident parameters + optimizer state + collective buffers
      + plain step:  max(backward: max(A, G) + s * min(A, G),  step: G + T)
      + fused steps: max(A + g, g + T)   (g: the largest parameter's or group's gradients)

- resident parameters: trained ones and the frozen parts that stay in memory (the VAE leaves
  after its latents are cached, the text encoders after their outputs are cached, unless
  ``highvram``; library/training/offload.py), each in the dtype the trainer gives it
  (``placement.dtype_placement``: ``trained_precision``, the mixed-precision dtype or fp8 for
  frozen parts; ``vae_dtype``);
- optimizer state: per parameter from the optimizer's own rules (``OptimizerRule``), float
  state in float32 (float32 weights, or the float32 copies ``full_bf16``/``full_fp16`` step);
- G: all trained gradients; with gradient accumulation the fused steppers keep them all too
  (they step in the last micro-step only), and the plain step's backward then starts with all
  of them (s = 1);
- A (activations): the bytes autograd saves for backward in one micro-step, counted by a fake
  forward pass of the run's batch at its largest bucket (``saved_tensors_hooks``; with gradient
  checkpointing the blocks' inputs plus the largest block's recomputation), times
  ``ACTIVATION_FACTOR``, plus autocast's saved copies of the weights;
- T: the optimizer update's temporary float32 copies of the largest parameter.

``RUNTIME_BYTES``, ``ACTIVATION_FACTOR`` and s (``GRADS_WITH_ACTIVATIONS``) are fitted on measured
peaks (see their comments and README "Memory estimate"); everything else is counted.
"""
from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import os
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from bitsandbytes.optim.optimizer import Optimizer2State
from diffusers import AutoencoderKL, UNet2DConditionModel
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

from library.config import method_kinds
from library.config.parse import required
from library.data import cache_stage
from library.data.latent_cache import vae_dtype
from library.errors import UserError, first_line
from library.models import fake_parts, flow_family, fp8, loading, placement, sd_checkpoint
from library.models.families.sd_common import tiny_models
from library.models.families import registry
from library.models.family import CHUNK, MAX_TOKENS, TextConditioning, chunk_count, family_model_for
from library.models.loading import ARCH_OF_FAMILY, SHIPPED_CONFIGS
from library.models.placement import compute_dtype, trained_precision
from library.training import flow_memory, model_setup, partial_text_cache
from library.training.host_memory import GIB
from library.training.methods import _dtype, make_method
from library.training.offload import released_after_caching
from library.training.optim import build_optimizer, check_optimizer
from library.training.stepper import fused_mode, step_units

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options

logger = logging.getLogger("sdtk")


# --- calibrated constants ---------------------------------------------------------------------
# Fitted on training-loop peaks (peak RSS, 2 optimizer steps) of tools/memory_benchmark.py,
# sd15-arch, 256 px, latents and text-encoder outputs cached, on the 2-core, 24 GiB x86_64 CPU
# machine, 2026-11-30 (benchmarks/memory_estimate_check.py, README "Memory estimate"), with the
# VAE and text encoder freed after caching and glibc's mmap threshold at 128 KiB
# (library/training/offload.py, library/training/host_memory.py): full fine-tune with fused Adafactor at batch 1
# (5.935 GiB) and 2 (6.310 GiB), AdamW at batch 1 (13.534 GiB), LoRA dim 16 with AdamW at
# batch 1 (4.248 GiB).
# Peak activation memory per byte saved for backward: the fused batch 2 - batch 1 slope,
# 0.375 GiB per sample against 0.441 GiB saved per sample.
ACTIVATION_FACTOR = 0.85
# FLUX.1 / SD3: the same, measured on full-width FLUX.1 dev blocks on the CPU (one double and one
# single block, float32, 256 and 512 px + 512 T5 tokens, benchmarks/flux_block_memory.py,
# 2026-12-03): 1.002 (256 px) and 1.000 (512 px) bytes of peak per counted byte from one block
# application to two, for both kinds (a whole model does not fit: the per-block slope is
# extrapolated to the model's depth). The backward's transient of one block (double / single:
# 0.077 / 0.151 GB at 256 px, 0.092 / 0.283 GB at 512 px) is not added.
FLOW_ACTIVATION_FACTOR = 1.0
# Resident memory of the process beyond its tensors (Python, torch, diffusers, transformers,
# accelerate, the allocator's slack): chosen so that the four cases above come out within
# 0.5% (+0.4%, +0.4%, +0.5%, -0.4%).
RUNTIME_BYTES = int(0.57 * GIB)
# The plain step's backward frees activations while it creates gradients: the larger of the two
# is all there at its peak, and this fraction of the smaller. Not identifiable from the cases
# above (the full fine-tune's plain-step peak is the optimizer step, LoRA's gradients are tiny):
# an assumption between the bounds 0 (no overlap) and 1 (all at once).
GRADS_WITH_ACTIVATIONS = 0.5

# float32 copies of the largest trained parameter that an optimizer's update holds at once
# (from reading the update code; not fitted): AdamW's denominator and update, Adafactor's squared
# gradient, factored estimate and update, bitsandbytes' dequantized states on the CPU.
STEP_TEMPORARIES = {"adamw": 2, "adafactor": 3, "bnb": 4, "lion": 1, "sgd": 1, "prodigy": 3,
                    "schedulefree": 2, "probed": 2}


class EstimateUnavailable(Exception):
    """The estimate cannot be made for this model source (said in one line, never fatal)."""


# --- the fake model ---------------------------------------------------------------------------

TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")  # SD3's third: T5-XXL


def _fake_mode():
    return FakeTensorMode()


def _clip_models(folder: str, names) -> dict:
    out = {}
    for name in names:
        cfg = os.path.join(folder, name, "config.json")
        if os.path.isfile(cfg):
            cls = CLIPTextModelWithProjection if name == "text_encoder_2" else CLIPTextModel
            out[name] = cls(CLIPTextConfig.from_json_file(cfg))
    return out


def _from_config_dir(folder: str, family: str) -> dict:
    unet = UNet2DConditionModel.load_config(folder, subfolder="unet")
    comps = {"unet": UNet2DConditionModel.from_config(unet),
             "vae": AutoencoderKL.from_config(AutoencoderKL.load_config(folder, subfolder="vae"))}
    names = registry.get(family).text_encoder_components
    comps.update(_clip_models(folder, names))
    missing = [n for n in names if n not in comps]
    if missing:
        raise EstimateUnavailable(f"{folder}: no {missing[0]}/config.json")
    return comps


def safetensors_header(path: str) -> tuple[dict, dict]:
    """({tensor name: shape}, metadata) from a .safetensors file's JSON header only."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or n > 100 * 1024 * 1024:
                raise ValueError("bad header length")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        raise EstimateUnavailable(f"{path}: cannot read the safetensors header ({e})") from None
    meta = header.pop("__metadata__", None) or {}
    return {k: tuple(v["shape"]) for k, v in header.items()}, meta


class _Shape:
    def __init__(self, shape):
        self.shape = shape


def _single_file_components(path: str) -> tuple[str, dict]:
    if path.endswith(".safetensors"):
        shapes, meta = safetensors_header(path)
    else:
        try:  # memory-mapped: the tensors are not read
            sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file: no estimate, the load will say why
            raise EstimateUnavailable(f"{path}: cannot read its tensor names ({type(e).__name__})") from None
        while isinstance(sd, dict) and isinstance(sd.get("state_dict"), dict):
            sd = sd["state_dict"]
        shapes = {k: tuple(v.shape) for k, v in sd.items() if hasattr(v, "shape")}
        meta = {}
    family = sd_checkpoint.detect_family({k: _Shape(s) for k, s in shapes.items()}, path)
    if sd_checkpoint.META_CONFIG_KEY in meta:
        with tempfile.TemporaryDirectory(prefix="sdtk-estimate-") as tmp:
            sd_checkpoint.write_config_dir(json.loads(meta[sd_checkpoint.META_CONFIG_KEY]), tmp)
            return family, _from_config_dir(tmp, family)
    return family, _from_config_dir(os.path.join(SHIPPED_CONFIGS, ARCH_OF_FAMILY[family]), family)


def fake_components(opts: Options) -> tuple[str, dict]:
    """(family, {unet, vae, text_encoder[, text_encoder_2]}) with fake tensors, from the model's
    configuration; must be called inside a FakeTensorMode. FLUX.1 / SD3: library/training/flow_memory.py."""
    flow = flow_family.family_before_loading(opts.pretrained_model_name_or_path)
    if flow is not None:
        try:
            return flow, flow_memory.fake_components(opts, flow, safetensors_header)
        except fake_parts.Unavailable as e:
            raise EstimateUnavailable(str(e)) from None
    src = loading.resolve_model_source(required(opts.pretrained_model_name_or_path,
                                                "pretrained_model_name_or_path"))
    if src.kind == "builtin":
        family = loading.FAMILY_OF_ARCH[src.arch]
        if src.location in loading.TINY_BUILTINS:
            comps = tiny_models.build_tiny_components(
                src.arch, inpaint=src.location.endswith(tiny_models.INPAINT_SUFFIX))
        else:
            comps = loading._build_arch(src.arch)
    elif src.kind == "diffusers":
        family = loading._family_of_folder(src.location)
        comps = _from_config_dir(src.location, family)
    elif src.kind == "single_file":
        family, comps = _single_file_components(src.location)
    else:
        try:
            # lazy: imported in a try: fake_components() answers its absence or failure
            from huggingface_hub import snapshot_download

            folder = snapshot_download(src.location, local_files_only=True, allow_patterns=[
                "model_index.json", "*/config.json"])
        except Exception:  # noqa: BLE001 - not in the local cache
            raise EstimateUnavailable(f"{src.location}: the hub model's configs are not in the "
                                      "local cache yet") from None
        family = loading._family_of_folder(folder)
        comps = _from_config_dir(folder, family)
    vae = opts.vae
    if vae:
        p = os.path.expanduser(vae)
        for cfg in (os.path.join(p, "vae"), p):
            if os.path.isfile(os.path.join(cfg, "config.json")):
                comps["vae"] = AutoencoderKL.from_config(AutoencoderKL.load_config(cfg))
                break  # a single-file VAE has the base model's architecture
    return family, {k: comps[k] for k in ("unet", "vae", *TEXT_ENCODERS) if k in comps}


# --- optimizer state --------------------------------------------------------------------------

def _optimizer_kind(cls, kwargs: dict) -> str:
    module = (cls.__module__ or "").split(".")[0].lower()
    name = cls.__name__.lower()
    if module == "bitsandbytes":
        return "bnb"
    if module == "transformers" and name == "adafactor":
        return "adafactor"
    if module == "torch" and name in ("adamw", "adam"):
        return "adamw"
    if module == "torch" and name == "sgd":
        return "sgd"
    if module == "lion_pytorch":
        return "lion"
    if module == "prodigyopt":
        return "prodigy"
    if module == "schedulefree":
        return "schedulefree"
    return "probed"


@dataclass
class OptimizerRule:
    """How many state bytes an optimizer keeps per trained parameter (float state is float32:
    float32 weights, or with full_bf16/full_fp16 the float32 per-parameter copies the stepper
    steps, whose state stays float32)."""
    kind: str
    name: str
    kwargs: dict
    bnb_states: int = 0
    bnb_bits: int = 8
    bnb_min_size: int = 4096
    bnb_unorm: bool = False
    probed_per_element: float = 0.0
    probed_per_param: int = 0

    def describe(self) -> str:
        k = self.kind
        if k == "adamw":
            n = 3 if self.kwargs.get("amsgrad") else 2
            return f"{self.name}: {n} float32 moments per parameter"
        if k == "adafactor":
            first = " and a float32 first moment" if self.kwargs.get("beta1") is not None else ""
            return (f"{self.name}: float32 second moment factored over the last two dimensions "
                    f"(rows + columns), full for vectors{first}")
        if k == "bnb":
            if self.bnb_bits == 8:
                return (f"{self.name}: {self.bnb_states} 8-bit state(s) + float32 absmax per "
                        f"256-element block; tensors under {self.bnb_min_size} elements float32")
            return f"{self.name}: {self.bnb_states} float32 state(s)"
        if k == "lion":
            return f"{self.name}: 1 float32 moment"
        if k == "sgd":
            return f"{self.name}: 1 float32 momentum buffer" if self.kwargs.get("momentum", 0) else \
                f"{self.name}: no state"
        if k == "prodigy":
            return f"{self.name}: moments, initial weights and s per parameter (float32)"
        if k == "schedulefree":
            return f"{self.name}: z and second moment (float32)" if "sgd" not in self.name.lower() \
                else f"{self.name}: z (float32)"
        return (f"{self.name}: {self.probed_per_element:g} bytes per element + "
                f"{self.probed_per_param} per parameter, measured by one step on small parameters")

    def param_bytes(self, shape: tuple, zero_init: bool = False) -> int:
        """State bytes of one parameter of this shape after its first step."""
        n = math.prod(shape)
        k, kw = self.kind, self.kwargs
        if k == "adamw":
            return (3 if kw.get("amsgrad") else 2) * 4 * n + 4  # + the float32 step tensor
        if k == "adafactor":
            b = 4  # RMS, a 0-dim float32 tensor
            if len(shape) >= 2:  # transformers' _get_options: factored when ndim >= 2
                b += 4 * (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1])
            else:
                b += 4 * n
            if kw.get("beta1") is not None:
                b += 4 * n
            return b
        if k == "bnb":
            b = 4 if self.bnb_unorm else 0
            if self.bnb_bits == 8 and n >= self.bnb_min_size:
                blocks = -(-n // 256)
                return b + self.bnb_states * (n + 4 * blocks)
            return b + self.bnb_states * 4 * n
        if k == "lion":
            return 4 * n
        if k == "sgd":
            return 4 * n if kw.get("momentum", 0) else 0
        if k == "prodigy":
            sliced = -(-n // int(kw.get("slice_p", 1)))
            betas = kw.get("betas", (0.9, 0.999))
            b = 4 * sliced + (4 if zero_init else 4 * sliced)  # s, and p0 (0-dim for all-zero p)
            return b + 4 * n * (2 if betas[0] > 0 else 1)
        if k == "schedulefree":
            return 4 * n * (1 if "sgd" in self.name.lower() else 2)
        return int(round(self.probed_per_element * n)) + self.probed_per_param

    def per_optimizer_bytes(self, params) -> int:
        """State shared within one optimizer instance (bitsandbytes' quantization maps)."""
        if self.kind == "bnb" and self.bnb_bits == 8 and any(math.prod(s) >= self.bnb_min_size
                                                              for s in params):
            return self.bnb_states * 256 * 4
        return 0


def optimizer_rule(opts: Options) -> OptimizerRule:
    """The state rule of the run's optimizer (resolved as the trainer resolves it)."""
    cls, fixed, args = check_optimizer(opts.optimizer_type, opts.optimizer_args)
    kwargs = {**fixed, **args}
    kind = _optimizer_kind(cls, kwargs)
    rule = OptimizerRule(kind, cls.__name__, kwargs)
    if kind in ("bnb", "probed"):
        def probe(shape):
            p = torch.nn.Parameter(torch.zeros(shape))
            opt = build_optimizer(opts.optimizer_type, opts.optimizer_args, [{"params": [p]}],
                                  opts.learning_rate or 1e-4, warn=False)
            return p, opt

        if kind == "bnb":
            _, opt = probe((64, 64))
            rule.bnb_states = 2 if isinstance(opt, Optimizer2State) else 1
            rule.bnb_bits = int(opt.args.optim_bits)
            rule.bnb_min_size = int(opt.args.min_8bit_size)
            rule.bnb_unorm = bool(opt.args.max_unorm and opt.args.max_unorm > 0)
        else:
            # an optimizer we have no rule for: its state after one step on two sizes of
            # parameter, as bytes = a x elements + b (exact for state that is per element)
            sizes = []
            for shape in ((64, 64), (32,)):
                p, opt = probe(shape)
                p.grad = torch.full_like(p, 1e-3)
                opt.step()
                sizes.append((p.numel(), tensor_bytes(opt.state[p].values())))
            (n1, b1), (n2, b2) = sizes
            rule.probed_per_element = (b1 - b2) / (n1 - n2)
            rule.probed_per_param = int(round(b1 - rule.probed_per_element * n1))
    return rule


def tensor_bytes(values, seen: set | None = None) -> int:
    """Bytes of the distinct tensor storages among ``values`` (nested lists/dicts allowed)."""
    seen = set() if seen is None else seen
    total = 0
    stack = list(values)
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif torch.is_tensor(v):
            st = v.untyped_storage()
            key = (st.data_ptr(), st.nbytes()) if v.device.type != "meta" else id(v)
            if key not in seen:
                seen.add(key)
                total += st.nbytes()
    return total


# --- activations ------------------------------------------------------------------------------

class _SavedCounter:
    """Bytes autograd saves for backward, by distinct storage, without parameters; tensors that
    have a parameter's shape (autocast's casts of weights) are counted apart."""

    def __init__(self, param_keys: set, param_shapes: set | None):
        self.param_keys = param_keys
        self.param_shapes = param_shapes
        self.activations: dict = {}
        self.weight_copies: dict = {}

    def pack(self, t):
        st = t.untyped_storage()
        key = st._cdata
        if key not in self.param_keys:
            copy = self.param_shapes is not None and tuple(t.shape) in self.param_shapes
            where = self.weight_copies if copy else self.activations
            where[key] = max(where.get(key, 0), st.nbytes())
        return t

    def add(self, t):
        self.pack(t)

    def total(self) -> int:
        return sum(self.activations.values())

    @contextlib.contextmanager
    def hooks(self):
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
            yield


def _largest_bucket(tset, resolution) -> tuple[int, int]:
    buckets = list(tset.bucket_sizes()) if tset is not None else []
    if buckets:
        return tuple(max(buckets, key=lambda b: (b[0] * b[1], b))[:2])  # (w, h[, multiplier])
    r = resolution if resolution else (512, 512)
    return (r, r) if isinstance(r, int) else tuple(r)


@dataclass
class ActivationCount:
    saved: int            # bytes saved for backward outside checkpointed blocks
    recompute: int        # the largest checkpointed block's saved bytes (recomputed in backward)
    weight_copies: int    # autocast copies of weights saved for backward
    bucket: tuple
    latent: tuple


def count_activations(opts: Options, family, comps, method, mode, bucket, batch: int) -> ActivationCount:
    """One micro-step's forward over fake tensors, as ``Run.micro_step_loss`` does it."""
    unet = comps["unet"]
    tes = [comps[n] for n in TEXT_ENCODERS if n in comps]
    params = [p for m in comps.values() for p in m.parameters()]
    if method.network is not None:
        params += list(method.network.parameters())
    keys = {p.untyped_storage()._cdata for p in params}
    dtype = compute_dtype(opts.mixed_precision)
    autocast = torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 and \
        not opts.full_fp16 else contextlib.nullcontext()
    # under autocast, weight-shaped saved tensors are the casts of weights (batch-independent)
    shapes = {tuple(p.shape) for p in params if p.dim() >= 2} if dtype != torch.float32 else None
    outer = _SavedCounter(keys, shapes)
    blocks = [0]

    def checkpointed(fn, *args, **kwargs):
        for a in args:
            if torch.is_tensor(a) and a.requires_grad:
                outer.add(a)  # the checkpoint keeps its inputs
        inner = _SavedCounter(keys, shapes)
        with inner.hooks():
            out = fn(*args, **kwargs)
        blocks[0] = max(blocks[0], inner.total())
        return out

    flow = registry.is_flow(family)
    sdxl_like = registry.get(family).size_conditioning  # pooled text and size conditioning
    if flow and (opts.gradient_checkpointing or opts.cpu_offload_checkpointing):
        flow_memory.checkpoint_with(unet, checkpointed)
    elif opts.gradient_checkpointing:
        unet.enable_gradient_checkpointing(checkpointed)
        if method.train_text_encoder:
            for te in tes:
                for m in te.modules():
                    if getattr(m, "gradient_checkpointing", None) is not None and \
                            hasattr(m, "_gradient_checkpointing_func"):
                        m.gradient_checkpointing = True
                        m._gradient_checkpointing_func = checkpointed
    if flow:  # FLUX.1 / SD3: the transformer's forward on the text encoders' outputs
        latent = flow_memory.latent_shape(bucket)
        with mode:
            latents = torch.zeros(batch, *latent)
            dt = next(unet.parameters()).dtype
            with outer.hooks(), autocast:
                pred = flow_memory.forward(opts, family, comps, latents.to(dtype if dt == fp8.FP8 else dt), dtype)
            with outer.hooks():
                loss = ((pred.float() - latents) ** 2).mean()
            del loss
        return ActivationCount(outer.total(), blocks[0], sum(outer.weight_copies.values()),
                               tuple(bucket), latent)
    vae = comps["vae"]
    scale = 2 ** (len(vae.config.block_out_channels) - 1)
    w, h = bucket
    latent = (unet.config.in_channels, h // scale, w // scale)
    cached_text = bool(opts.cache_text_encoder_outputs or opts.cache_text_encoder_outputs_to_disk)
    n_chunks = chunk_count(opts.max_token_length)
    tokens = n_chunks * CHUNK + 2 if n_chunks > 1 else MAX_TOKENS
    with mode:
        family_model = family_model_for(_Bundle(family, unet, tes, []), opts.max_token_length)
        unet_dtype = next(unet.parameters()).dtype
        if unet_dtype == fp8.FP8:  # fp8_base: the U-Net computes in the mixed-precision dtype
            unet_dtype = dtype
        latents = torch.zeros(batch, *latent)
        noisy = latents.to(unet_dtype)
        t = torch.zeros(batch, dtype=torch.long)
        size_cond = torch.zeros(batch, 6)
        with outer.hooks(), autocast:
            if cached_text:
                pooled = torch.zeros(batch, tes[-1].config.projection_dim) if sdxl_like else None
                cond = TextConditioning(torch.zeros(batch, tokens, unet.config.cross_attention_dim,
                                                        dtype=dtype), pooled)
            else:
                ids = [torch.zeros((batch, tokens) if n_chunks == 1 else (batch, n_chunks, MAX_TOKENS),
                                   dtype=torch.long) for _ in tes]
                with (contextlib.nullcontext() if method.train_text_encoder else torch.no_grad()):
                    cond = family_model.encode(ids, opts.clip_skip)
            pred = family_model.unet_forward(noisy, t, cond, size_cond if sdxl_like else None)
        with outer.hooks():
            # an inpainting U-Net takes 9 channels and predicts the 4 latent ones
            loss = ((pred.float() - latents[:, :pred.shape[1]]) ** 2).mean()
        del loss
    return ActivationCount(outer.total(), blocks[0], sum(outer.weight_copies.values()), tuple(bucket),
                           latent)


def _cast_module(module, dtype, compute=None) -> dict:
    """The trainer's ``placement.place(module, dtype, compute)`` for fake tensors (whose
    parameters ``Module.to`` cannot swap): new Parameters in the dtypes ``placement.tensor_dtypes``
    gives (fp8: float8 Linear/Conv2d weights, with the up-casting forward); returns
    {id(old parameter): new parameter}."""
    new = {}
    for m, kind, name, target in list(placement.tensor_dtypes(module, dtype, compute)):
        t = getattr(m, kind)[name]
        if kind == "_buffers":
            if t.dtype != target:
                m._buffers[name] = t.to(target)
            continue
        if t.dtype == target:
            continue
        if id(t) not in new:
            new[id(t)] = torch.nn.Parameter(t.detach().to(target), requires_grad=t.requires_grad)
        m._parameters[name] = new[id(t)]
    if dtype == fp8.FP8:
        fp8.install_forward(module, compute)
    return new


class _FakePlacer:
    """model_setup.Placer on fake tensors: new parameters in the trainer's dtypes."""

    def unet(self, module, storage, compute):
        return _cast_module(module, storage, compute)

    def module(self, module, storage, compute):
        return _cast_module(module, storage, compute)


@dataclass
class _Bundle:
    family: str
    unet: torch.nn.Module
    text_encoders: list
    tokenizers: list
    vae: object = None


def _fake_bundle(opts: Options) -> tuple[str, dict, _Bundle]:
    """The run's model on fake tensors (inside ``_fake_mode``), as a ModelBundle-like record."""
    family, comps = fake_components(opts)
    tes = [comps[n] for n in TEXT_ENCODERS if n in comps]
    return family, comps, _Bundle(family, comps["unet"], tes, [], comps["vae"])


# --- the estimate -----------------------------------------------------------------------------

@dataclass
class ParamLine:
    component: str
    trained: bool
    dtype: str
    numel: int
    bytes: int
    resident: bool
    note: str = ""


@dataclass
class Estimate:
    params: list = field(default_factory=list)
    gradients: int = 0
    gradients_note: str = ""
    optimizer: int = 0
    optimizer_note: str = ""
    activations: int = 0
    activations_note: str = ""
    step_temporaries: int = 0
    runtime: int = 0
    cached_data: int = 0
    collective_buffer: int = 0
    backward_peak: int = 0
    step_peak: int = 0
    total: int = 0
    peak_phase: str = ""
    device_note: str = ""  # blocks_to_swap: what the compute device holds less (FLUX.1 / SD3)

    @property
    def resident_params(self) -> int:
        return sum(p.bytes for p in self.params if p.resident)

    @property
    def trained_params(self) -> int:
        return sum(p.numel for p in self.params if p.trained)

    def lines(self) -> list[str]:
        out = []
        for p in self.params:
            kind = "trained" if p.trained else "frozen"
            size = f"{p.bytes / GIB:.3f} GiB" if p.resident else f"({p.bytes / GIB:.3f} GiB not counted)"
            out.append(f"parameters, {kind}: {p.component} {p.numel / 1e6:.1f} M {p.dtype} {size}"
                       + (f"; {p.note}" if p.note else ""))
        out.append(f"gradients: {self.gradients / GIB:.3f} GiB ({self.gradients_note})")
        out.append(f"optimizer state: {self.optimizer / GIB:.3f} GiB ({self.optimizer_note})")
        out.append(f"activations: {self.activations / GIB:.3f} GiB ({self.activations_note})")
        out.append(f"optimizer step temporaries: {self.step_temporaries / GIB:.3f} GiB")
        if self.collective_buffer:
            out.append(f"collective buffers: {self.collective_buffer / GIB:.3f} GiB (gradient "
                       "all-reduce buckets: under DDP a copy of every trained gradient, none with "
                       "ddp_gradient_as_bucket_view; with fsdp the largest all-gathered U-Net "
                       "block)")
        if self.cached_data:
            out.append(f"cached latents and text-encoder outputs: {self.cached_data / GIB:.3f} GiB")
        out.append(f"runtime overhead: {self.runtime / GIB:.3f} GiB (Python, torch and the libraries)")
        out.append(f"total peak of the training loop: {self.total / GIB:.2f} GiB per process (at "
                   f"{self.peak_phase})")
        if self.device_note:
            out.append(self.device_note)
        return out


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _cached_data_bytes(opts: Options, tset, family: str, comps, flow: bool, scale: int, text_dtype_bytes: int,
                       tokens: int, partial_text: bool) -> int:
    """Latents (float32, each flip its own) and one text-encoder cache entry per caption the cache
    stage encodes (cache_stage.cached_captions); ``partial_text``: FLUX.1 / SD3's partial cache,
    the frozen T5's part only (flow_memory.text_entry_bytes); ``flow``: a FLUX.1 / SD3 model."""
    total = 0
    if tset is None:
        return 0
    items = tset.train_items + tset.reg_items
    if opts.cache_latents or opts.cache_latents_to_disk:
        for it in items:
            if flow:
                c, h, w = flow_memory.latent_shape(it.bucket)
            else:
                c, h, w = comps["unet"].config.in_channels, it.bucket[1] // scale, it.bucket[0] // scale
            total += (2 if it.flip_aug else 1) * c * h * w * 4
    if opts.cache_text_encoder_outputs or opts.cache_text_encoder_outputs_to_disk:
        if flow:
            entry = flow_memory.text_entry_bytes(opts, family, comps, text_dtype_bytes, partial_text)
        else:
            d = comps["unet"].config.cross_attention_dim
            pooled = comps["text_encoder_2"].config.projection_dim if "text_encoder_2" in comps else 0
            entry = (tokens * d + pooled) * text_dtype_bytes
        total += len(cache_stage.cached_captions(tset)) * entry
    return total


@contextlib.contextmanager
def _quiet():
    """The method's own set-up messages belong to the real set-up, not to the estimate."""
    previous = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = previous


def _without_weights(opts: Options):
    """The options a fake network is built from: no network_weights (the estimate reads no
    weights), and no pivotal tuning's few embedding rows (the fake model has no tokenizer)."""
    return opts.replace(network_weights=None, pivotal_tokens=None, pivotal_init_words=None,
                        pivotal_num_vectors=None, pivotal_learning_rate=None,
                        stop_pivotal_training=None)


def _fake_method(opts: Options, method_name: str, bundle):
    """The run's method over the fake bundle; a network's shape comes from the options (no
    network_weights read)."""
    kind = method_kinds.get(method_name)
    return make_method(method_name, _without_weights(opts) if kind.trains_network else opts, bundle)


def _check_modeled(opts: Options, method_name: str) -> None:
    kind = method_kinds.get(method_name)
    if kind.memory_estimate is not None:
        raise EstimateUnavailable(kind.memory_estimate)
    if kind.trains_network and opts.dim_from_weights:
        raise EstimateUnavailable("dim_from_weights: the network's shape comes from "
                                  "network_weights, which the estimate does not read")


def save_dtype_bytes(opts: Options) -> int:
    """Bytes per value of a model save: save_precision, unset as trained (a full model's frozen
    parts may be smaller: an upper bound)."""
    dtype = _dtype(opts.save_precision) or getattr(torch, trained_precision(opts))
    return dtype.itemsize


def saved_parameters(opts: Options, method_name: str) -> tuple[int, list[tuple]]:
    """(numel of what a model save writes, shapes of the trained parameters), from the model
    built on fake tensors: a LoRA save writes its network, a full save every component."""
    _check_modeled(opts, method_name)
    with _fake_mode(), _quiet():
        family, comps, bundle = _fake_bundle(opts)
        method = _fake_method(opts, method_name, bundle)
        method.setup()
        trained = [tuple(p.shape) for p in method.trainable_parameters() if p.requires_grad]
        # what a save writes, as the method says: its network, else the whole model
        modules = [method.network] if method.network is not None else list(comps.values())
        saved = sum(p.numel() for m in modules for p in m.parameters())
    return saved, trained


def fused_gradient_bytes(unit_bytes: list[int], alive: int) -> int:
    """The fused steps' gradient bytes at once when ``alive`` units' gradients may be alive:
    1 in one process (the unit being filled, stepped when complete); under several processes
    1 + fused_reductions_in_flight (the sums in flight beside the unit being filled,
    library/training/stepper.py _HookStepper). At most the ``alive`` largest units."""
    return sum(sorted(unit_bytes, reverse=True)[:alive])


def estimate(opts: Options, method_name: str, tset=None, processes: int = 1) -> Estimate:
    """The memory estimate of this run (one process); raises EstimateUnavailable or UserError."""
    _check_modeled(opts, method_name)
    if opts.deepspeed:
        # Measured: a one-process ZeRO-2 fine-tune of sd15-arch (AdamW8bit, 256 px) was killed
        # above 22 GiB of resident memory where this model, with ZeRO's partitioning and float32
        # master copy, said 14.1 GiB: DeepSpeed's flat buffers are not modeled.
        raise EstimateUnavailable("deepspeed: ZeRO's flat parameter, gradient and bucket buffers "
                                  "are not modeled")
    mode = _fake_mode()
    with mode, _quiet():
        family, comps, bundle = _fake_bundle(opts)
        method = _fake_method(opts, method_name, bundle)
        trained_dtype = getattr(torch, trained_precision(opts))
        frozen_dtype = compute_dtype(opts.mixed_precision)
        _cast_module(comps["vae"], vae_dtype(opts))  # Run.load's VAE dtype
        # the trainer's own set-up of the model (library/training/model_setup.py): the parts in
        # their dtypes, the method's groups, its network in its dtype
        groups = model_setup.set_up_method(opts, method_name, method, bundle, _FakePlacer()).groups
    trained = [p for p in method.trainable_parameters() if p.requires_grad]
    trained_ids = {id(p) for p in trained}

    # -- parameters, by component
    est = Estimate()
    cached_latents = bool(opts.cache_latents or opts.cache_latents_to_disk)
    cached_text = bool(opts.cache_text_encoder_outputs or opts.cache_text_encoder_outputs_to_disk)
    # the parts the run releases after caching, by the run's own rule (library/training/offload.py)

    # FLUX.1 / SD3 with trained CLIP encoders: a partial cache, T5 released (partial_text_cache.py)
    partial_text = False
    if cached_text and registry.get(family).partial_cache:
        with _quiet():
            partial_text = partial_text_cache.is_partial(
                method, bundle.text_encoders, flow_memory.family_model(opts, family, comps, bundle.text_encoders),
                logger, t5_only=opts.use_t5xxl_cache_only)
    flow = registry.get(family).flow
    t5_name = None if flow is None else flow.t5_component
    released = released_after_caching(
        latents_cached=cached_latents, text_cached=cached_text,
        text_encoders_trained=method.train_text_encoder, highvram=opts.highvram,
        partial_text=partial_text)
    # fsdp (full fine-tune, several processes): each process holds 1/P of the trained weights,
    # their gradients and optimizer state, plus one all-gathered block at a time (library/distributed/fsdp.py)
    shards = processes if (opts.fsdp and method_kinds.get(method_name).trains_model and processes > 1) else 1
    parts = list(comps.items())
    if method.network is not None:
        parts.append(("network", method.network))
    for name, module in parts:
        by_key: dict = {}
        for p in module.parameters():
            k = (id(p) in trained_ids, _dtype_name(p.dtype))
            n, b = by_key.get(k, (0, 0))
            by_key[k] = (n + p.numel(), b + p.numel() * p.element_size())
        for (is_trained, dt), (n, b) in sorted(by_key.items(), key=lambda kv: not kv[0][0]):
            resident, note = True, ""
            if name == "vae" and "vae" in released:
                resident, note = False, "released after its latents are cached"
            if name.startswith("text_encoder") and "text_encoders" in released:
                resident, note = False, "released after its outputs are cached"
            if name == t5_name and "cached_text_encoders" in released:
                resident, note = False, "released after its outputs are cached (the CLIP encoders train)"
            if is_trained and shards > 1:
                b, note = -(-b // shards), f"sharded over {shards} processes (fsdp)"
            est.params.append(ParamLine(name, is_trained, dt, n, b, resident, note))

    # -- optimizer state
    rule = optimizer_rule(opts)
    fmode = fused_mode(opts)
    # kohya networks start their up weights at zero (Prodigy then keeps a 0-dim initial copy)
    zero_init = {id(p) for n, p in (method.network.named_parameters()
                                    if method.network is not None and not opts.network_weights else [])
                 if "lora_up" in n}
    state = sum(rule.param_bytes(tuple(p.shape), id(p) in zero_init) for p in trained)
    # the units the stepper builds (one optimizer per unit), by the stepper's own rule
    _, _, units = step_units(groups, trained, fmode, opts.fused_optimizer_groups)
    state += sum(rule.per_optimizer_bytes([tuple(p.shape) for p in u]) for u in units)
    est.optimizer = -(-state // shards)
    est.optimizer_note = rule.describe() + (f"; {len(units)} optimizers" if len(units) > 1 else "")
    # -- gradients
    def nbytes(p):
        return p.numel() * p.element_size()

    all_grads = sum(nbytes(p) for p in trained)
    largest = max((nbytes(p) for p in trained), default=0)
    accumulate = opts.gradient_accumulation_steps > 1
    if fmode is None or accumulate:
        est.gradients = all_grads
        est.gradients_note = "all trained parameters at once" + (
            f" ({fmode} steps in the last micro-step only)" if fmode and accumulate else "")
        overlap = all_grads
    else:
        alive = 1 + (opts.fused_reductions_in_flight if processes > 1 else 0)
        unit_bytes = fused_gradient_bytes([sum(nbytes(p) for p in u) for u in units], alive)
        est.gradients = unit_bytes
        fused = fmode == "fused_backward_pass"
        if alive == 1:
            est.gradients_note = ("the largest parameter's: fused_backward_pass" if fused
                                  else f"the largest of {len(units)} groups: {fmode}")
        else:
            est.gradients_note = (f"the {alive} largest " + ("parameters'" if fused else
                                                            f"of {len(units)} groups'")
                                  + f": {fmode}, up to {alive - 1} sums in flight over "
                                  f"{processes} processes (fused_reductions_in_flight)")
        overlap = unit_bytes
    largest_fp32 = max((p.numel() * 4 for p in trained), default=0)
    n_tmp = STEP_TEMPORARIES.get(rule.kind, 2) + (2 if trained_dtype != torch.float32 else 0)
    est.step_temporaries = n_tmp * largest_fp32
    if fmode is not None:
        # the fused steps' guard (fused_optim.step_masked): a copy of the parameter being
        # stepped and of its optimizer state, one parameter at a time
        est.step_temporaries += max((nbytes(p) + rule.param_bytes(tuple(p.shape)) for p in trained),
                                    default=0)

    # -- activations (fake forward of one micro-step at the largest bucket)
    bucket = _largest_bucket(tset, opts.resolution)
    with _quiet():
        act = count_activations(opts, family, comps, method, mode, bucket, opts.train_batch_size)
    saved = act.saved + act.recompute
    factor = FLOW_ACTIVATION_FACTOR if flow is not None else ACTIVATION_FACTOR
    est.activations = int(factor * saved) + act.weight_copies
    gc = " with gradient checkpointing" if (opts.gradient_checkpointing
                                            or opts.cpu_offload_checkpointing) else ""
    copies = f" + {act.weight_copies / GIB:.3f} GiB autocast copies of weights" if act.weight_copies else ""
    est.activations_note = (f"batch {opts.train_batch_size} at {bucket[0]}x{bucket[1]} (latents "
                            f"{act.latent[1]}x{act.latent[2]}): {saved / GIB:.3f} GiB saved for "
                            f"backward{gc} x {factor:g}{copies}")

    # -- the rest
    vae = comps["vae"]
    scale = 8 if flow is not None else 2 ** (len(vae.config.block_out_channels) - 1)

    n_chunks = chunk_count(opts.max_token_length)
    tokens = n_chunks * CHUNK + 2 if n_chunks > 1 else MAX_TOKENS
    est.cached_data = _cached_data_bytes(opts, tset, family, comps, flow is not None, scale,
                                         frozen_dtype.itemsize, tokens, partial_text)
    est.runtime = RUNTIME_BYTES
    if processes > 1 and fmode is None and not opts.fsdp:
        # DDP (library/distributed/ddp.py): its buckets hold a copy of every trained gradient,
        # unless the gradients are views into them (ddp_gradient_as_bucket_view)
        est.collective_buffer = 0 if opts.ddp_gradient_as_bucket_view else all_grads
    elif processes > 1:
        # the fused steps' all-reduce of a group (accelerator.sum_gradients' flat bucket)
        est.collective_buffer = 25 * 1024 * 1024 + largest
    if shards > 1:
        unet = comps["unet"]
        blocks = [*unet.down_blocks, *([unet.mid_block] if unet.mid_block is not None else []),
                  *unet.up_blocks]
        est.collective_buffer = max(sum(nbytes(p) for p in blk.parameters()) for blk in blocks)
        est.gradients, all_grads, overlap = (-(-x // shards) for x in (est.gradients, all_grads, overlap))
        est.gradients_note += f", sharded over {shards} processes (fsdp)"
    base = est.runtime + est.cached_data + est.resident_params + est.optimizer + est.collective_buffer
    if fmode is None:
        # the plain step: in the backward the activations shrink while the gradients grow, so
        # the larger of the two is all there at once and a share of the smaller (with
        # accumulation the earlier micro-steps' gradients are all there from the start); then
        # the step over all gradients
        a = est.activations
        share = 1.0 if accumulate else GRADS_WITH_ACTIVATIONS
        est.backward_peak = base + max(a, all_grads) + share * min(a, all_grads)
        est.step_peak = base + all_grads + est.step_temporaries
    else:
        # steps inside the backward hooks (the last micro-step): one unit's gradients beside the
        # activations, and with accumulation all gradients; the update's temporaries come once
        # the backward has freed activations (measured: they do not add to the fused peak)
        est.backward_peak = base + est.activations + overlap
        est.step_peak = base + overlap + est.step_temporaries
    est.total = int(max(est.backward_peak, est.step_peak))
    if flow is not None:
        est.device_note = flow_memory.swap_line(opts, comps["unet"]) or ""
    if fmode is not None:
        est.peak_phase = "the backward pass, which steps the parameters"
    else:
        est.peak_phase = "the backward pass" if est.backward_peak >= est.step_peak else "the optimizer step"
    return est


def report(opts: Options, method_name: str, tset=None, processes: int = 1, main: bool = True):
    """Print the estimate (main process); an estimate that cannot be made is said, never fatal."""
    if not main:
        return None
    try:
        est = estimate(opts, method_name, tset, processes)
        gc.collect()  # the fake model's modules hold reference cycles: free them before training
    except (EstimateUnavailable, UserError) as e:
        print(f"memory estimate: not available ({e})", flush=True)
        return None
    except Exception as e:  # noqa: BLE001 - e.g. a network module that cannot be built on fake
        # tensors: the estimate is advice, never a reason to stop a run
        print(f"memory estimate: not available ({first_line(e, typed=True)})", flush=True)
        return None
    flow = flow_family.family_before_loading(opts.pretrained_model_name_or_path) is not None
    print("memory estimate (training loop, one process; CPU peak resident memory model "
          "calibrated on sd15-arch" + ("; activations per byte on full-width FLUX.1 blocks, "
                                       "extrapolated to the model" if flow else "") + "):", flush=True)
    for line in est.lines():
        print("  " + line, flush=True)
    return est
