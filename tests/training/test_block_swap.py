"""blocks_to_swap (library/training/block_swap.py) and cpu_offload_checkpointing on the tiny
FLUX.1 and SD3 transformers, on the CPU (one thread: bit for bit).

- a FLUX.1 full fine-tune through train_dreambooth trains the same transformer bit for bit with
  blocks_to_swap as without, with the plain AdamW step (swapped blocks stepped on the host) and
  with fused_backward_pass (stepped on the device inside their backward, copied home); and the
  fused run equals the unfused one bit for bit;
- the transformer's gradients with swap equal those without, with and without gradient
  checkpointing, for FLUX.1 and SD3;
- the memory saving, measured: the bytes of the transformer's weights resident on the compute
  device, sampled at every module's forward and every saved tensor's use in the backward,
  peak with swap == all weights - the swapped blocks + the two-block window, each counted by
  hand from the config's layer shapes (not from the model's parameters);
- the options are refused where they cannot work, in one line, before any weight loads.
"""
from __future__ import annotations

import copy

import pytest
import torch

from library.models.families.flux import flux
from library.models.families.sd3 import sd3
from library.training import block_swap
from tests.training.test_flux_train import build_initial, flux_args, no_flux_loading  # noqa: F401


def _flux_inputs(batch=2):
    g = torch.Generator().manual_seed(1)
    img = torch.randn(batch, 16, 64, generator=g)
    txt = torch.randn(batch, 8, 32, generator=g)
    return (img, flux.image_ids(4, 4, batch), txt, flux.text_ids(8, batch),
            torch.rand(batch, generator=g), torch.randn(batch, 32, generator=g),
            torch.full((batch,), 3.5))


def _sd3_inputs(cfg, batch=2):
    g = torch.Generator().manual_seed(2)
    return (torch.randn(batch, 16, 8, 8, generator=g), torch.rand(batch, generator=g) * 1000,
            torch.randn(batch, cfg.adm_in_channels, generator=g),
            torch.randn(batch, 6, cfg.context_dim, generator=g))


def _train(model, inputs, steps=2):
    """AdamW steps on the mean square of the output; the weights after."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(*inputs).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _flux_model():
    torch.manual_seed(0)
    return flux.Flux(flux.TINY_FLUX_DEV)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("n", [1, 2])
def test_flux_swap_trains_the_same_weights(n, checkpointing):
    base = _flux_model()
    plain = _train(copy.deepcopy(base), _flux_inputs())
    m = copy.deepcopy(base)
    if checkpointing:
        m.enable_gradient_checkpointing()
    swap = block_swap.install(m, n, "cpu", storage=torch.float32, compute=torch.float32)
    assert len(swap.swapped) == [2, 3][n - 1]  # n=1: 0 double + 2 single; n=2: 1 double + 2 single
    swapped = _train(m, _flux_inputs())
    assert plain.keys() == swapped.keys()
    for k in plain:
        assert torch.equal(plain[k], swapped[k]), k
    # between steps every swapped parameter is at home (no device copy left behind)
    assert swap.inside == set() and swap.pending == {}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_sd3_swap_trains_the_same_weights(checkpointing):
    cfg = sd3.tiny_config("sd3.5-medium")  # attn2 in block 0, a pre-only last block
    torch.manual_seed(0)
    base = sd3.MMDiT(cfg)
    plain = _train(copy.deepcopy(base), _sd3_inputs(cfg))
    m = copy.deepcopy(base)
    m.enable_gradient_checkpointing(checkpointing)
    swap = block_swap.install(m, 2, "cpu", storage=torch.float32, compute=torch.float32)
    assert swap.swapped == [0, 1]
    swapped = _train(m, _sd3_inputs(cfg))
    for k in plain:
        assert torch.equal(plain[k], swapped[k]), k


def _linear(i, o, bias=True):
    return i * o + (o if bias else 0)


def _hand_count(cfg: flux.FluxConfig):
    """Parameters of one double and one single block, from the layer shapes of BFL's FLUX.1."""
    h, m, hd = cfg.hidden_size, cfg.mlp_hidden_dim, cfg.head_dim
    stream = (_linear(h, 6 * h) + _linear(h, 3 * h, cfg.qkv_bias) + 2 * hd + _linear(h, h)
              + _linear(h, m) + _linear(m, h))
    double = 2 * stream
    single = _linear(h, 3 * h + m) + _linear(h + m, h) + 2 * hd + _linear(h, 3 * h)
    return double, single


def _peak_resident(model, swap, inputs):
    """The largest number of weight bytes on the compute device (the model's tensors not at their
    host home, and the copies in flight), sampled at every module's forward and at every saved
    tensor's use in the backward, over one training step."""
    peak = [0]

    def sample(*_):
        now = block_swap.device_bytes(model, swap) + (swap.in_flight_bytes() if swap else 0)
        peak[0] = max(peak[0], now)

    handles = [mod.register_forward_pre_hook(lambda mod, args: sample()) for mod in model.modules()]

    def unpack(t):
        sample()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
            model(*inputs).square().mean().backward()
        sample()
    finally:
        for hnd in handles:
            hnd.remove()
    return peak[0]


def test_flux_swap_memory_saving_measured():
    cfg = flux.TINY_FLUX_DEV
    double, single = _hand_count(cfg)
    m = _flux_model().train()
    total = sum(p.numel() for p in m.parameters()) * 4
    without = _peak_resident(m, None, _flux_inputs())
    assert without == total  # all weights, all the time
    m.zero_grad(set_to_none=True)  # (accumulated gradients would travel with their blocks)
    swap = block_swap.install(m, 2, "cpu", storage=torch.float32, compute=torch.float32)
    # blocks_to_swap 2 on 2 double + 2 single blocks: the last double and both single blocks
    swapped = (double + 2 * single) * 4
    assert swap.swapped_bytes() == swapped
    assert block_swap.device_bytes(m, swap) == total - swapped  # between steps
    # at most two swapped blocks on the device at once: the one computing and the next one
    # being copied in (forward: double 1 + single 0; backward: the same pair)
    window = (double + single) * 4
    with_swap = _peak_resident(m, swap, _flux_inputs())
    assert with_swap == total - swapped + window
    assert without - with_swap == single * 4  # the tiny model saves one single block's bytes


def test_full_size_swap_counts_match_sd_scripts():
    """FLUX.1 dev (19 double, 38 single): blocks_to_swap 18 keeps 9 double and 18 single blocks
    on the host (sd-scripts' split), the largest value 35 keeps 17 and 36; SD3.5 large: n joint
    blocks. Built on the meta device (no memory)."""
    with torch.device("meta"):
        dev = flux.Flux(flux.FLUX_DEV)
        large = sd3.MMDiT(sd3.SD35_LARGE)
    assert block_swap.counts(dev, 18) == [9, 18]
    assert block_swap.counts(dev, 35) == [17, 36]
    assert block_swap.counts(large, 10) == [10]
    double, single = _hand_count(flux.FLUX_DEV)
    blocks = block_swap.blocks_for(dev, 18)
    assert sum(p.numel() for b in blocks for p in b.parameters()) == 9 * double + 18 * single
    with pytest.raises(block_swap.BlockSwapError, match=r"blocks_to_swap 40: asks for 20 of the model.s 19 double blocks \(at most 38 here\)"):
        block_swap.counts(dev, 40)
    # one block list: n blocks of it, so at most all of them (SD3.5 large has 38)
    assert block_swap.counts(large, 38) == [38]
    with pytest.raises(block_swap.BlockSwapError, match=r"asks for 39 of the model.s 38 joint blocks \(at most 38 here\)"):
        block_swap.counts(large, 39)


def test_cpu_offload_checkpointing_same_gradients_inputs_held_on_host(monkeypatch):
    """The checkpointed blocks' saved inputs go through save_on_cpu (one context per block and
    forward); the weights trained are those of plain checkpointing and of no checkpointing."""
    base = _flux_model()
    plain = _train(copy.deepcopy(base), _flux_inputs())
    m = copy.deepcopy(base)
    m.enable_gradient_checkpointing()
    m.cpu_offload_checkpointing = True
    real, entered = torch.autograd.graph.save_on_cpu, []

    def spy(*a, **k):
        entered.append(k)
        return real(*a, **k)

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", spy)
    offloaded = _train(m, _flux_inputs())
    assert len(entered) == 2 * 4 and entered[0] == {"pin_memory": False}  # 2 steps x 4 blocks
    for k in plain:
        assert torch.equal(plain[k], offloaded[k]), k


def _weights(train, dataset, out, *extra):
    rc, _, err, run = train("train_dreambooth", flux_args(
        dataset, out, "--optimizer_type", "AdamW", "--max_grad_norm", "0", *extra))
    assert rc == 0, err
    return {k: v.detach().clone() for k, v in run.parts.bundle.unet.state_dict().items()}, err


def test_flux_finetune_with_block_swap_equals_without(dataset, tmp_path, train):
    """The entry script: 2 AdamW steps with blocks_to_swap 2 == without, bit for bit; so for
    fused_backward_pass (the swapped blocks stepped on the device, written home), which also
    equals the unfused step bit for bit, and for cpu_offload_checkpointing."""
    plain, _ = _weights(train, dataset, str(tmp_path / "a"))
    swapped, err = _weights(train, dataset, str(tmp_path / "b"), "--blocks_to_swap", "2")
    assert "blocks_to_swap 2: 3 of the transformer's 4 blocks" in err
    initial = build_initial()
    for k in plain:
        assert not torch.equal(plain[k], initial[k]), k
        assert torch.equal(plain[k], swapped[k]), k
    fused, _ = _weights(train, dataset, str(tmp_path / "c"), "--fused_backward_pass")
    fused_swapped, _ = _weights(train, dataset, str(tmp_path / "d"), "--fused_backward_pass",
                                "--blocks_to_swap", "2")
    for k in fused:
        assert not torch.equal(fused[k], initial[k]), k
        assert torch.equal(fused[k], fused_swapped[k]), k
        # fused == unfused for the FLUX.1 full fine-tune: AdamW stepped per parameter in its
        # gradient hook is the same float arithmetic as the one step over all (one thread)
        assert torch.equal(fused[k], plain[k]), k
    # cpu_offload_checkpointing turns checkpointing on (with a warning, as sd-scripts) and
    # offloads its saved inputs: the same weights as the plain run
    rc, _, err, run = train("train_dreambooth", flux_args(
        dataset, str(tmp_path / "e"), "--optimizer_type", "AdamW", "--max_grad_norm", "0",
        "--cpu_offload_checkpointing"))
    assert rc == 0, err
    unet = run.parts.bundle.unet
    assert unet.gradient_checkpointing and unet.cpu_offload_checkpointing
    assert "cpu_offload_checkpointing turns gradient_checkpointing on" in err
    offloaded = unet.state_dict()
    for k in plain:
        assert torch.equal(plain[k], offloaded[k]), k


@pytest.mark.parametrize("extra, message", [
    (["--blocks_to_swap", "2", "--fused_optimizer_groups", "2"],
     "blocks_to_swap with fused_optimizer_groups: not supported"),
    (["--blocks_to_swap", "2", "--cpu_offload_checkpointing"],
     "blocks_to_swap and cpu_offload_checkpointing cannot be combined"),
    (["--blocks_to_swap", "2", "--ema_decay", "0.9"], "blocks_to_swap with ema_decay"),
    (["--blockwise_fused_optimizers", "--fused_backward_pass"],
     "blockwise_fused_optimizers cannot be combined"),
])
def test_block_swap_conflicts_fail_before_loading(dataset, tmp_path, run_script, no_flux_loading,
                                                  extra, message):
    rc, _, err = run_script("train_dreambooth", flux_args(dataset, str(tmp_path / "o"), *extra))
    assert rc != 0 and message in err and "Traceback" not in err


@pytest.mark.parametrize("option", [["--blocks_to_swap", "2"], ["--cpu_offload_checkpointing"],
                                    ["--blockwise_fused_optimizers"]])
def test_transformer_memory_options_refused_with_an_sd_model(dataset, tmp_path, run_script,
                                                             no_weight_loading, option):
    rc, _, err = run_script("train_dreambooth", [
        "--pretrained_model_name_or_path", "tiny-sd15", "--train_data_dir", dataset, "--output_dir",
        str(tmp_path / "o"), "--resolution", "64", "--max_train_steps", "2", *option])
    # the flow families that do not refuse it (Anima has no block swap; its DiT offloads checkpoints)
    titles = ("Chroma, FLUX.1, SD3, Anima and Lumina 2" if option[0] == "--cpu_offload_checkpointing"
              else "Chroma, FLUX.1, SD3 and Lumina 2")
    assert rc != 0 and f"{option[0][2:]}: an option of {titles} transformers" in err


def test_sd3_finetune_with_block_swap_equals_without(dataset, tmp_path, train):
    """SD3 through finetune: blocks_to_swap 1 (the last joint block on the host) trains the same
    MMDiT bit for bit, with gradient checkpointing (the recomputation finds the block in)."""
    from tests.training.test_sd3_train import sd3_args

    def weights(out, *extra):
        rc, _, err, run = train("finetune", sd3_args(dataset, str(tmp_path / out), "--optimizer_type",
                                                     "AdamW", "--gradient_checkpointing", *extra))
        assert rc == 0, err
        return {k: v.detach().clone() for k, v in run.parts.bundle.unet.state_dict().items()}, run

    plain, _ = weights("a")
    swapped, run = weights("b", "--blocks_to_swap", "1")
    assert run.parts.bundle.unet.block_swap.swapped == [1]
    for k in plain:
        assert torch.equal(plain[k], swapped[k]), k


def test_flux_blockwise_fused_optimizers_equal_one_optimizer(dataset, tmp_path, train):
    """blockwise_fused_optimizers: one optimizer per FLUX.1 block (2 double + 2 single) and one
    for the rest, each stepped in the backward when its block is complete: the same transformer
    bit for bit as one AdamW (one thread), also with blocks_to_swap (a block's optimizer steps it
    while it is on the device)."""
    from library.training.methods import block_param_lists

    def weights(out, *extra):
        rc, _, err, run = train("train_dreambooth", flux_args(
            dataset, str(tmp_path / out), "--optimizer_type", "AdamW", "--max_grad_norm", "0", *extra))
        assert rc == 0, err
        return {k: v.detach().clone() for k, v in run.parts.bundle.unet.state_dict().items()}, run

    plain, _ = weights("a")
    blockwise, run = weights("b", "--blockwise_fused_optimizers")
    unet = run.parts.bundle.unet
    units = run.parts.stepper.units
    assert len(units) == 5  # the rest + 4 blocks, each block's parameters one unit
    blocks = [*unet.double_blocks, *unet.single_blocks]
    for block in blocks:
        ids = {id(p) for p in block.parameters()}
        assert any({id(p) for p in u} == ids for u in units)
    lists = block_param_lists(unet)
    assert [len(x) for x in lists[1:]] == [len(list(b.parameters())) for b in blocks]
    swapped, _ = weights("c", "--blockwise_fused_optimizers", "--blocks_to_swap", "2")
    for k in plain:
        assert torch.equal(plain[k], blockwise[k]), k
        assert torch.equal(plain[k], swapped[k]), k
