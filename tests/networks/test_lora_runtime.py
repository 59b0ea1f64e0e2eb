"""The LoRA network a run builds, at run time: each hooked layer's output equals the layer with
the independent weight W + multiplier * up @ down * alpha / rank (SD1 linear, 1x1 and 3x3 conv
layers, SDXL), and network_dropout / rank_dropout / module_dropout from the options reach the
network's forward in training and not in eval."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from library.config.parse import parse_args
from library.training.methods import NetworkMethod
from library.models.loading import load_from_options


def _network(model, *extra, dataset="."):
    opts = parse_args("train_lora", ["--pretrained_model_name_or_path", model, "--train_data_dir",
                                     dataset, "--resolution", "64", "--max_train_steps", "1", "--dry_run",
                                     *[str(a) for a in extra]])
    bundle = load_from_options(opts)
    method = NetworkMethod(opts, bundle)
    method.setup()
    return opts, bundle, method


def _randomize(net, seed=3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in net.text_encoder_loras + net.unet_loras:
            m.lora_up.weight.copy_(torch.randn(m.lora_up.weight.shape, generator=g) * 0.1)
            m.lora_down.weight.copy_(torch.randn(m.lora_down.weight.shape, generator=g) * 0.1)


def _expected(layer, up, down, factor, x):
    """The layer's output with its weight W + factor * up @ down, computed here in float64 from
    the factors (no code of networks/lora.py)."""
    w = layer.weight.detach().double()
    up, down = up.detach().double(), down.detach().double()
    b = None if layer.bias is None else layer.bias.detach().double()
    if isinstance(layer, torch.nn.Linear):
        return F.linear(x.double(), w + factor * up @ down, b)
    # conv: up is (out, r, 1, 1), down (r, in, kh, kw): the composed kernel sums over the rank
    delta = torch.einsum("or,rihw->oihw", up[:, :, 0, 0], down)
    return F.conv2d(x.double(), w + factor * delta, b, layer.stride, layer.padding, layer.dilation,
                    layer.groups)


def _input(layer, g):
    if isinstance(layer, torch.nn.Linear):
        return torch.randn(2, 5, layer.in_features, generator=g)
    return torch.randn(2, layer.in_channels, 8, 8, generator=g)


def _pick(net):
    """One text-encoder linear, one U-Net linear, one 1x1 conv and one 3x3 conv module."""
    picks = {}
    for m in net.text_encoder_loras:
        if isinstance(m.org_module, torch.nn.Linear):
            picks.setdefault("te linear", m)
    for m in net.unet_loras:
        layer = m.org_module
        if isinstance(layer, torch.nn.Linear):
            picks.setdefault("unet linear", m)
        elif isinstance(layer, torch.nn.Conv2d):
            picks.setdefault("conv 1x1" if layer.kernel_size == (1, 1) else "conv 3x3", m)
    return picks


@pytest.mark.parametrize("model,dim,alpha,conv_dim,conv_alpha,multiplier", [
    ("tiny-sd15", 4, 2.0, 3, 1.5, 0.7),
    ("tiny-sdxl", 8, 3.0, 2, 4.0, 1.6),
])
def test_runtime_output_is_the_layer_with_the_merged_weight(model, dim, alpha, conv_dim, conv_alpha,
                                                            multiplier):
    _, _, method = _network(model, "--network_dim", dim, "--network_alpha", alpha,
                            "--network_multiplier", multiplier, "--network_args",
                            f"conv_dim={conv_dim}", f"conv_alpha={conv_alpha}")
    net = method.network
    _randomize(net)
    net.eval()
    picks = _pick(net)
    assert set(picks) == {"te linear", "unet linear", "conv 1x1", "conv 3x3"}
    g = torch.Generator().manual_seed(0)
    for what, m in picks.items():
        layer = m.org_module
        rank, a = (conv_dim, conv_alpha) if what == "conv 3x3" else (dim, alpha)
        assert m.lora_down.weight.shape[0] == rank, what
        x = _input(layer, g)
        with torch.no_grad():
            got = layer(x)  # the hooked forward: base + LoRA
            want = _expected(layer, m.lora_up.weight, m.lora_down.weight, multiplier * a / rank, x)
        err = float((got.double() - want).abs().max() / want.abs().max())
        assert err < 1e-5, (what, err)
        # and the LoRA part is not negligible: a wrong scale could not hide in the tolerance
        with torch.no_grad():
            base = F.linear(x, layer.weight, layer.bias) if isinstance(layer, torch.nn.Linear) else \
                F.conv2d(x, layer.weight, layer.bias, layer.stride, layer.padding)
        assert float((got - base).abs().max() / want.abs().max()) > 1e-2, what


def test_dropouts_from_the_options_reach_the_forward_in_training_only():
    opts, bundle, method = _network("tiny-sd15", "--network_dim", "4", "--network_dropout", "0.3",
                                    "--network_args", "rank_dropout=0.25", "module_dropout=0.2")
    net = method.network
    modules = net.text_encoder_loras + net.unet_loras
    assert {(m.dropout, m.rank_dropout, m.module_dropout) for m in modules} == {(0.3, 0.25, 0.2)}
    _randomize(net)
    m = next(m for m in net.unet_loras if isinstance(m.org_module, torch.nn.Linear))
    layer = m.org_module
    x = _input(layer, torch.Generator().manual_seed(1))
    exact = _expected(layer, m.lora_up.weight, m.lora_down.weight, m.multiplier * opts.network_alpha
                      / opts.network_dim, x)
    method.set_train(0)  # what the training loop calls at each epoch's start
    torch.manual_seed(0)
    with torch.no_grad():
        outs = [layer(x) for _ in range(12)]
    assert any(not torch.equal(outs[0], o) for o in outs[1:])  # the draws vary step to step
    assert all(float((o.double() - exact).abs().max()) > 1e-6 for o in outs[:3])
    # module dropout: some forwards are the base layer alone
    base = F.linear(x, layer.weight, layer.bias)
    assert any(torch.equal(o, base) for o in outs)
    bundle.unet.eval()  # validation and sampling: eval mode, no dropout
    net.eval()
    with torch.no_grad():
        a, b = layer(x), layer(x)
    assert torch.equal(a, b)
    assert float((a.double() - exact).abs().max() / exact.abs().max()) < 1e-5
