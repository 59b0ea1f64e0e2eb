"""fp8 frozen base weights (``fp8_base``, ``fp8_base_unet``): stored as float8_e4m3fn, computed
in the mixed-precision dtype.

Which tensors are stored in fp8: the weights of the plain ``nn.Linear`` / ``nn.Conv2d`` modules
(nearly all of a U-Net's or text encoder's bytes). Everything else (norms, token and position
embeddings, biases, buffers) stays in the compute dtype: sd-scripts keeps the text encoders'
embeddings out of fp8 because ``nn.Embedding`` cannot compute in it, and CPU autocast cannot
run a GroupNorm/LayerNorm whose parameters are fp8 (checked on torch 2.13: "mixed dtype (CPU):
expect parameter to have scalar type of Float").

How they compute: each fp8 module's forward goes through ``_Fp8Linear`` / ``_Fp8Conv2d``, which
cast the weight to the compute dtype inside the forward and again inside the backward, and save
only the fp8 weight for the backward. CPU autocast (like CUDA's) would up-cast an fp8 weight in
``F.linear`` / ``F.conv2d`` by itself, but autograd then keeps that compute-dtype copy of every
weight until the backward reaches it: at the end of the forward the U-Net would be resident
once in fp8 and once more in bf16, more than a bf16 base. Here one weight's copy exists at a
time.

The forward is installed as an instance attribute before a network is applied, so a kohya
network's hook (``LoRAModule.apply_to`` keeps ``org_module.forward`` as its ``org_forward``)
calls the fp8 forward.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn


def eligible(module: torch.nn.Module) -> bool:
    """A module whose weight is stored in fp8: an exact nn.Linear, or an nn.Conv2d with zero
    padding given as numbers (what the backward's ``conv2d_input`` computes)."""
    if type(module) is torch.nn.Linear:
        return True
    return (type(module) is torch.nn.Conv2d and module.padding_mode == "zeros"
            and not isinstance(module.padding, str))


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, dtype):
        ctx.save_for_backward(weight)  # the fp8 tensor itself: no compute-dtype copy is kept
        ctx.dtype, ctx.x_dtype = dtype, x.dtype
        return F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        # d/dx (x W^T) = grad W; the frozen weight and bias get no gradient
        return (grad.to(ctx.dtype) @ weight.to(ctx.dtype)).to(ctx.x_dtype), None, None, None


class _Fp8Conv2d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, dtype, stride, padding, dilation, groups):
        ctx.save_for_backward(weight)
        ctx.conf = (x.shape, x.dtype, dtype, stride, padding, dilation, groups)
        return F.conv2d(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype),
                        stride, padding, dilation, groups)

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        shape, x_dtype, dtype, stride, padding, dilation, groups = ctx.conf
        if not ctx.needs_input_grad[0]:
            return (None,) * 8
        gx = torch.nn.grad.conv2d_input(shape, weight.to(dtype), grad.to(dtype), stride, padding,
                                        dilation, groups)
        return (gx.to(x_dtype),) + (None,) * 7


def _linear_forward(self, x):
    return _Fp8Linear.apply(x, self.weight, self.bias, self.fp8_compute_dtype)


def _conv_forward(self, x):
    return _Fp8Conv2d.apply(x, self.weight, self.bias, self.fp8_compute_dtype, self.stride,
                            self.padding, self.dilation, self.groups)


def install_forward(module: torch.nn.Module, compute: torch.dtype) -> int:
    """Route every eligible submodule whose weight is fp8 through the up-casting forward; returns
    how many. Must run before a network hooks those modules' forward."""
    n = 0
    for m in module.modules():
        if eligible(m) and m.weight.dtype == FP8:
            m.fp8_compute_dtype = compute
            m.forward = types.MethodType(_linear_forward if type(m) is torch.nn.Linear
                                         else _conv_forward, m)
            n += 1
    return n


def stored_fp8(module: torch.nn.Module) -> bool:
    return any(p.dtype == FP8 for p in module.parameters())
