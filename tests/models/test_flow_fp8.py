"""fp8_base / fp8_base_unet for the FLUX.1 and SD3 transformers (library/models/placement.py,
library/models/fp8.py): every Linear weight stored as float8_e4m3fn, computed in bf16.

- the fp8-stored transformer's forward equals, bit for bit, the float32 transformer with each
  Linear / Conv2d weight rounded to e4m3 once (every other tensor to bf16, as stored) and run
  under bf16 autocast (what the fp8 path computes: an e4m3 value is exact in bf16);
- each Linear layer's output against the float32 layer within the bound from the formats: e4m3
  keeps 3 mantissa bits, so a normal weight moves by at most 2^-4 of itself, a subnormal one
  (|w| < 2^-6) by at most 2^-10; bf16 (8 bits) rounds the input and the output by 2^-8 of
  themselves. |y8 - y| <= 2^-4 |W||x| + 2^-10 sum|x| + 2^-8 (|W||x| + |y|) (+ the bias's bf16
  rounding);
- a full fine-tune (train_dreambooth) takes the option with sd-scripts' "no effect" warning, as
  for SD: the trained transformer is not stored in fp8.
"""
from __future__ import annotations

import copy

import pytest
import torch

from library.models import fp8, placement
from library.models.families.flux import flux
from library.models.families.sd3 import sd3


def _flux():
    torch.manual_seed(0)
    m = flux.Flux(flux.TINY_FLUX_DEV).eval()
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 16, 64, generator=g), flux.image_ids(4, 4, 2), torch.randn(2, 8, 32, generator=g),
         flux.text_ids(8, 2), torch.rand(2, generator=g), torch.randn(2, 32, generator=g), torch.full((2,), 3.5))
    return m, x


def _sd3():
    torch.manual_seed(0)
    cfg = sd3.tiny_config("sd3.5-medium")
    m = sd3.MMDiT(cfg).eval()
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(2, 16, 8, 8, generator=g), torch.rand(2, generator=g) * 1000,
         torch.randn(2, cfg.adm_in_channels, generator=g), torch.randn(2, 6, cfg.context_dim, generator=g))
    return m, x


@pytest.mark.parametrize("build", [_flux, _sd3], ids=["flux", "sd3"])
def test_fp8_transformer_equals_e4m3_rounded_weights_in_bf16(build):
    model, inputs = build()
    ref = copy.deepcopy(model)
    with torch.no_grad():  # Linear (and Conv2d) weights rounded to e4m3, every other tensor to bf16
        for m in ref.modules():
            for kind in ("_parameters", "_buffers"):
                for name, t in getattr(m, kind).items():
                    if t is not None and t.is_floating_point():
                        stored = fp8.FP8 if (kind == "_parameters" and name == "weight" and fp8.eligible(m)) \
                            else torch.bfloat16
                        t.data = t.data.to(stored).float()
    placement.place(model, fp8.FP8, torch.bfloat16, "cpu")
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert linears and all(m.weight.dtype == fp8.FP8 for m in linears)
    assert fp8.stored_fp8(model)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = model(*inputs), ref(*inputs)
    assert torch.equal(got.float(), want.float())


def test_fp8_linear_layers_within_the_format_bound():
    model, inputs = _flux()
    full = copy.deepcopy(model)
    placement.place(model, fp8.FP8, torch.bfloat16, "cpu")
    pairs = [(a, b) for a, b in zip(model.modules(), full.modules()) if type(a) is torch.nn.Linear]
    seen = []

    def capture(mod, args, out):
        seen.append((mod, args[0].detach().float(), out.detach().float()))

    hooks = [a.register_forward_hook(capture) for a, _ in pairs]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(*inputs)
    for h in hooks:
        h.remove()
    ref_of = {id(a): b for a, b in pairs}
    checked = 0
    for mod, x, y8 in seen:
        lin = ref_of[id(mod)]
        w, b = lin.weight.detach(), lin.bias.detach() if lin.bias is not None else None
        y = torch.nn.functional.linear(x, w, b)  # float32, on the same (bf16-rounded) input
        wx = x.abs() @ w.abs().t()
        bound = 2 ** -4 * wx + 2 ** -10 * x.abs().sum(-1, keepdim=True) + 2 ** -8 * (wx + y.abs())
        if b is not None:
            bound = bound + 2 ** -8 * b.abs()
        assert bool(((y8 - y).abs() <= bound + 1e-6).all()), mod
        checked += 1
    assert checked == len(pairs) > 20


def test_fp8_base_in_a_flux_full_finetune_has_no_effect_with_a_warning(dataset, tmp_path, train):
    from tests.training.test_flux_train import flux_args

    rc, _, err, run = train("train_dreambooth", flux_args(dataset, str(tmp_path / "o"), "--fp8_base",
                                                          "--max_train_steps", "1"))
    assert rc == 0, err
    assert "option fp8_base has no effect in train_dreambooth" in err
    assert not fp8.stored_fp8(run.parts.bundle.unet)
