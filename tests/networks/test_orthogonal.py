"""sd-scripts' networks.oft_v2 and networks.boft (PR #2428): the rotations against float64
constructions written here from the PEFT / sd-scripts formulas (a transposed or wrongly scaled
rotation is planted and must be caught), the file layouts, merge == run time on tiny models, and
the network_args errors."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from library.models.families.sd_common.tiny_models import build_tiny_components
from networks import boft, merge_lora, oft_v2
from networks.lora import LoRAError
from networks.orthogonal_modules import BOFTModule, OFTv2Module
from tests import client_key_tables as clients

# float32 run time against float64: a few hundred products and sums of O(1) numbers, each
# rounding at 6e-8 relative, stay well below 1e-5; every planted fault moves outputs by > 1e-2
TOL = dict(rtol=1e-5, atol=1e-5)


def _close(got: torch.Tensor, want: np.ndarray) -> bool:
    return bool(np.allclose(got.detach().double().numpy(), want, **TOL))


def _block_diag(blocks) -> np.ndarray:
    n = sum(b.shape[0] for b in blocks)
    out, at = np.zeros((n, n)), 0
    for b in blocks:
        out[at:at + b.shape[0], at:at + b.shape[0]] = b
        at += b.shape[0]
    return out


# --- OFTv2 --------------------------------------------------------------------------------------

def _skew(row: np.ndarray, b: int) -> np.ndarray:
    """The stored row fills the strict upper triangle row by row: Q = M - M^T."""
    m, k = np.zeros((b, b)), 0
    for i in range(b):
        for j in range(i + 1, b):
            m[i, j] = row[k]
            k += 1
    return m - m.T


def _oftv2_block(row: np.ndarray, b: int, scale: float = 1.0) -> np.ndarray:
    """PEFT's OFT rotation of one stored row: R = I + 2Q + 2Q^2 + 2Q^3 + Q^4 (the 5-term Neumann
    series of (I + Q)(I - Q)^-1)."""
    q = _skew(row, b) * scale
    p = np.linalg.matrix_power
    return np.eye(b) + 2 * q + 2 * p(q, 2) + 2 * p(q, 3) + p(q, 4)


def _oftv2_weight(w: np.ndarray, rows: np.ndarray, b: int, conv: bool, mult: float, transpose=False, scale=1.0):
    """sd-scripts' OFTv2 weight: a Linear's inputs rotate x -> x R (W R^T), a conv's flattened
    kernel W_flat R; then W + mult * (W' - W)."""
    n = w[0].size
    blocks = [_oftv2_block(rows[i % len(rows)], b, scale) for i in range(n // b)]
    r = _block_diag(blocks)
    if transpose:
        r = r.T
    flat = w.reshape(w.shape[0], -1)
    rotated = flat @ r if conv else flat @ r.T
    return (flat + mult * (rotated - flat)).reshape(w.shape)


def _randomize(module, seed, std=0.1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_((1.0 if name == "boft_s" else 0.0) + torch.randn(p.shape, generator=g) * std)


def _output_of(org, inp):
    """The layer's float64 output with a given weight (its own bias, padding 1 for a conv)."""
    bias = org.bias.detach().double()

    def out(weight: np.ndarray) -> np.ndarray:
        wt = torch.from_numpy(weight)
        if isinstance(org, torch.nn.Conv2d):
            return F.conv2d(inp.double(), wt, bias, padding=1).numpy()
        return (inp.double() @ wt.T + bias).numpy()
    return out


def _hooked(module, org, x):
    module.apply_to()
    try:
        return org(x)
    finally:
        module.restore()


@pytest.mark.parametrize("share", [False, True])
def test_oftv2_linear_and_3x3_conv_against_the_float64_neumann_cayley(share):
    torch.manual_seed(0)
    lin, conv = torch.nn.Linear(12, 8), torch.nn.Conv2d(4, 8, 3, padding=1)
    x, xc = torch.randn(3, 12), torch.randn(2, 4, 5, 5)
    for org, inp, b in ((lin, x, 4), (conv, xc, 6)):
        m = OFTv2Module("lora_unet_x", org, multiplier=0.7, block_size=b, block_share=share)
        n = org.weight[0].numel()
        assert m.oft_R.weight.shape == (1 if share else n // b, b * (b - 1) // 2)
        _randomize(m, 1)
        m.eval()
        rows = m.oft_R.weight.detach().double().numpy()
        got = _hooked(m, org, inp)
        w, is_conv = org.weight.detach().double().numpy(), isinstance(org, torch.nn.Conv2d)
        out = _output_of(org, inp)

        assert _close(got, out(_oftv2_weight(w, rows, b, is_conv, 0.7)))
        # the planted faults: the other side's rotation, the skew matrix at half scale
        assert not _close(got, out(_oftv2_weight(w, rows, b, is_conv, 0.7, transpose=True)))
        assert not _close(got, out(_oftv2_weight(w, rows, b, is_conv, 0.7, scale=0.5)))


def test_oftv2_series_is_the_cayley_transform_for_small_rotations_and_coft_projects_per_block():
    rng = np.random.default_rng(0)
    row = rng.normal(size=6) * 1e-2
    r, q = _oftv2_block(row, 4), _skew(row, 4)
    exact = (np.eye(4) + q) @ np.linalg.inv(np.eye(4) - q)
    # the series stops at Q^4 (half of it): the rest is O(|Q|^4), |Q| ~ 3e-2 here
    assert np.abs(r - exact).max() < 1e-5 and np.abs(r - exact).max() > 1e-9
    assert np.abs(r @ r.T - np.eye(4)).max() < 1e-5

    lin = torch.nn.Linear(8, 4)
    m = OFTv2Module("lora_unet_x", lin, block_size=4, coft=True, coft_eps=1e-3)
    _randomize(m, 2)
    m.oft_R.weight.data[1] *= 1e-4  # one row inside the bound stays as it is
    before = m.oft_R.weight.detach().double().numpy().copy()
    m.train()
    _hooked(m, lin, torch.randn(2, 8))
    bound = 1e-3 / np.sqrt(2)  # eps / sqrt(rows)
    for got, v in zip(m.oft_R.weight.detach().double().numpy(), before):
        norm = np.sqrt(2) * np.linalg.norm(v)  # ||M - M^T||_F
        want = v if norm <= bound else v * bound / norm
        assert np.allclose(got, want, rtol=1e-6, atol=1e-12)
    assert np.allclose(m.oft_R.weight.detach()[1].double().numpy(), before[1])


# --- BOFT ---------------------------------------------------------------------------------------

def _butterfly(n: int, b: int, factor: int) -> np.ndarray:
    """P_i of PEFT's BOFT as a dense matrix (P[p, idx[p]] = 1): within each group of b * 2^i inputs
    the half-blocks (b / 2 wide) are taken even ones first, then odd ones."""
    half, group = b // 2, b * 2 ** factor
    chunks = group // half
    p = np.zeros((n, n))
    for pos in range(n):
        g, q = divmod(pos, group)
        j, o = divmod(q, half)
        src = 2 * j if j < chunks // 2 else 2 * (j - chunks // 2) + 1
        p[pos, g * group + src * half + o] = 1
    return p


def _boft_weight(w, blocks, s, mult, transpose=False, half_skew=True):
    """diag(s) W_flat R^T, R = M_{m-1} ... M_0, M_i = P_i blockdiag(C(A)) P_i^T, C(A) = (I - S)(I + S)^-1
    with S = (A - A^T) / 2; P_0 = I; then W + mult * (W' - W)."""
    m, nb, b, _ = blocks.shape
    n = nb * b
    rot = np.eye(n)
    for i in range(m):
        cay = []
        for a in blocks[i]:
            sk = (a - a.T) * (0.5 if half_skew else 1.0)
            cay.append((np.eye(b) - sk) @ np.linalg.inv(np.eye(b) + sk))
        p = _butterfly(n, b, i)  # P_0 = I
        rot = p @ _block_diag(cay) @ p.T @ rot
    assert np.abs(rot @ rot.T - np.eye(n)).max() < 1e-10
    if transpose:
        rot = rot.T
    flat = w.reshape(w.shape[0], -1)
    rotated = s.reshape(-1, 1) * (flat @ rot.T)
    return (flat + mult * (rotated - flat)).reshape(w.shape)


@pytest.mark.parametrize("factors", [1, 2, 3])
def test_boft_linear_and_3x3_conv_against_the_float64_butterfly_product(factors):
    torch.manual_seed(0)
    lin, conv = torch.nn.Linear(16, 6), torch.nn.Conv2d(8, 5, 3, padding=1)  # 72 = 2 x 36 inputs
    x, xc = torch.randn(3, 16), torch.randn(2, 8, 5, 5)
    for org, inp, b in ((lin, x, 2), (conv, xc, 2)):
        m = BOFTModule("lora_unet_x", org, multiplier=0.6, block_size=b, n_factors=factors)
        n = org.weight[0].numel()
        assert m.boft_R.shape == (factors, n // b, b, b) and m.boft_s.shape == (org.weight.shape[0], 1)
        _randomize(m, 3, std=0.3)
        m.eval()
        blocks, s = m.boft_R.detach().double().numpy(), m.boft_s.detach().double().numpy()
        got = _hooked(m, org, inp)
        w, is_conv = org.weight.detach().double().numpy(), isinstance(org, torch.nn.Conv2d)
        out = _output_of(org, inp)

        assert _close(got, out(_boft_weight(w, blocks, s, 0.6)))
        assert not _close(got, out(_boft_weight(w, blocks, s, 0.6, transpose=True)))
        assert not _close(got, out(_boft_weight(w, blocks, s, 0.6, half_skew=False)))


def test_boft_butterfly_mixes_every_input_after_log2_blocks_factors():
    """A known property of the butterfly: with b = 2 and N blocks, log2(N) + 1 factors connect
    every input to every output (the product has no zero), fewer do not."""
    n, b = 16, 2
    rng = np.random.default_rng(0)
    for factors, full in ((3, False), (4, True)):
        blocks = rng.normal(size=(factors, n // b, b, b))
        w = np.eye(n)
        rot = _boft_weight(w, blocks, np.ones(n), 1.0)  # W = I: the rotation itself, transposed
        assert (np.abs(rot) > 1e-12).all() == full


# --- files, merge and clients -------------------------------------------------------------------

KINDS = {"oft_v2": (oft_v2, {"oft_block_size": "4", "enable_conv": "true"}, ("oft_R.weight",)),
         "boft": (boft, {"boft_block_size": "2", "boft_n_butterfly_factor": "2", "enable_conv": "true"},
                  ("boft_R", "boft_s"))}


def _tes(c):
    return [c["text_encoder"]] + ([c["text_encoder_2"]] if "text_encoder_2" in c else [])


def _network(kind, c, mult=1.0):
    module, args, _ = KINDS[kind]
    tes = _tes(c)
    net = module.create_network(mult, 8, 1.0, None, tes if len(tes) > 1 else tes[0], c["unet"], **args)
    net.apply_to(tes, c["unet"])
    _randomize(net, 4, std=0.05)
    return net


@pytest.mark.parametrize("kind", ["oft_v2", "boft"])
def test_file_layout_merge_equals_run_time_and_no_client_reads_it(kind):
    module, _, parts = KINDS[kind]
    c = build_tiny_components("sd15")
    net = _network(kind, c, mult=0.8)
    net.eval()
    sd = {k: v.detach().clone() for k, v in net.state_dict().items()}
    names = {k.partition(".")[0] for k in sd}
    assert {k.partition(".")[2] for k in sd} == set(parts)  # no alpha, nothing else
    assert any(n.startswith("lora_te_text_model_encoder_layers_0_self_attn") for n in names)
    assert any(n.endswith("resnets_0_conv1") for n in names)  # 3x3 convs with enable_conv
    layers = {lora.lora_name: lora.org_module for lora in net.unet_loras + net.text_encoder_loras}
    run_time = {n: lora.interpolated(lora.org_module.weight.float()).detach()
                for n, lora in ((lo.lora_name, lo) for lo in net.unet_loras + net.text_encoder_loras)}
    torch.manual_seed(0)
    lat, t, ctx = torch.randn(1, 4, 8, 8), torch.tensor([10]), torch.randn(1, 77, c["unet"].config.cross_attention_dim)
    with torch.no_grad():
        want = c["unet"](lat, t, ctx).sample
    net.remove_from()

    assert merge_lora.merge_lora_into([c["text_encoder"]], c["unet"], sd, 0.8) == len(names)
    for n, w in run_time.items():
        assert torch.allclose(layers[n].weight, w, rtol=1e-5, atol=1e-6), n
    with torch.no_grad():
        got = c["unet"](lat, t, ctx).sample
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)

    # A1111's and ComfyUI's adapter types read none of these modules (their OFT / BOFT read LyCORIS' oft_blocks)
    by_module: dict[str, set] = {}
    for k in sd:
        name, _, part = k.partition(".")
        by_module.setdefault(name, set()).add(part)
    for p in by_module.values():
        assert not any(f(p) for f in clients.A1111_TYPES.values())
        assert not any(f(p) for f in clients.COMFY_TYPES.values())


@pytest.mark.parametrize("kind", ["oft_v2", "boft"])
def test_sdxl_names_and_a_file_read_back_with_its_shapes(kind):
    module, args, _ = KINDS[kind]
    c = build_tiny_components("sdxl")
    net = _network(kind, c)
    sd = net.state_dict()
    assert any(k.startswith("lora_te2_text_model_encoder_layers_0_") for k in sd)
    assert any(k.startswith("lora_unet_input_blocks_") for k in sd)  # SAI layout
    tes = _tes(c)
    back, _ = module.create_network_from_weights(1.0, None, None, tes, c["unet"], weights_sd=sd)
    assert {k: tuple(v.shape) for k, v in back.state_dict().items()} == {k: tuple(v.shape) for k, v in sd.items()}
    back.load_state_dict(sd)
    bad = dict(sd)
    key = next(k for k in bad if k.endswith(KINDS[kind][2][0]))
    bad[key] = bad[key][..., :1] if kind == "oft_v2" else bad[key][:, :1]
    with pytest.raises(LoRAError, match="wrong base model"):
        module.create_network_from_weights(1.0, None, None, tes, c["unet"], weights_sd=bad)


def test_include_and_exclude_patterns_match_the_dotted_layer_path():
    """sd-scripts' rule: full matches on the layer's path in its model (SDXL U-Net: SAI layout;
    text encoders under text_model); include patterns win over exclude patterns."""
    c = build_tiny_components("sdxl")
    tes = _tes(c)
    every = {lo.lora_name for lo in _all(oft_v2.create_network(1.0, 4, None, None, tes, c["unet"]))}
    no_attn2 = {lo.lora_name for lo in _all(oft_v2.create_network(1.0, 4, None, None, tes, c["unet"],
                                                                  exclude_patterns="['.*attn2.*']"))}
    assert no_attn2 == {n for n in every if "_attn2_" not in n} and len(no_attn2) < len(every)
    only = {lo.lora_name for lo in _all(boft.create_network(
        1.0, 4, None, None, tes, c["unet"], include_patterns="['input_blocks\\.4\\..*to_q', 'text_model\\..*q_proj']",
        exclude_patterns="['.*']"))}
    assert only and all(n.startswith("lora_unet_input_blocks_4_") and n.endswith("to_q")
                        or n.startswith(("lora_te1_", "lora_te2_")) and n.endswith("q_proj") for n in only)
    with pytest.raises(LoRAError, match="include_patterns of networks.boft: bad regular expression"):
        boft.check_network_args({"include_patterns": "['(']"})


def _all(net):
    return net.text_encoder_loras + net.unet_loras


def test_network_args_errors_are_one_line_each():
    with pytest.raises(LoRAError, match="unknown key 'blocksize' for networks.oft_v2"):
        oft_v2.check_network_args({"blocksize": "4"})
    with pytest.raises(LoRAError, match="not both"):
        boft.check_network_args({"boft_block_size": "4", "boft_block_num": "8"})
    with pytest.raises(LoRAError, match="boft_n_butterfly_factor='0' must be >= 1"):
        boft.check_network_args({"boft_n_butterfly_factor": "0"})
    lin = torch.nn.Linear(12, 4)
    with pytest.raises(LoRAError, match="block size 5 does not divide its 12 inputs"):
        OFTv2Module("lora_unet_x", lin, block_size=5)
    with pytest.raises(LoRAError, match="boft_block_size=5 does not divide 12 inputs"):
        BOFTModule("lora_unet_x", lin, block_size=5, auto_adjust=False)
    # auto_adjust (the default) takes the nearest divisor / valid butterfly shape, as sd-scripts
    assert BOFTModule("lora_unet_x", lin, block_size=5).block_size == 4
    assert BOFTModule("lora_unet_x", torch.nn.Linear(24, 4), block_size=3, n_factors=3).block_size == 2


def test_base_weights_merge_the_rotation_in_float64():
    """base_weights on an SD model goes through merge_lora_into: each layer gets W + m (W' - W), W'
    the float64 rotation of the file (here checked for one Linear and one 3x3 conv against the
    constructions above)."""
    from types import SimpleNamespace

    from library.training.network_options import _merge

    c = build_tiny_components("sd15")
    net = _network("oft_v2", c)
    sd = {k: v.detach().clone() for k, v in net.state_dict().items()}
    lin = next(lo for lo in net.unet_loras if isinstance(lo.org_module, torch.nn.Linear))
    conv = next(lo for lo in net.unet_loras if lo.org_module.weight.dim() == 4 and lo.org_module.weight.shape[-1] == 3)
    net.remove_from()
    want = {lo.lora_name: _oftv2_weight(lo.org_module.weight.detach().double().numpy(),
                                        sd[lo.lora_name + ".oft_R.weight"].double().numpy(), 4,
                                        lo.org_module.weight.dim() == 4, 0.5) for lo in (lin, conv)}
    bundle = SimpleNamespace(family="sd1", text_encoders=[c["text_encoder"]], unet=c["unet"])
    assert _merge(bundle, sd, 0.5, "networks.lora") == len({k.partition(".")[0] for k in sd})
    for lo in (lin, conv):
        assert np.allclose(lo.org_module.weight.detach().double().numpy(), want[lo.lora_name], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("arch", ["sd15", "sdxl"])
def test_omi_and_peft_key_layouts_read_as_sd_scripts_reads_them(arch, tmp_path):
    """sd-scripts' loader also takes OMI's ``unet.`` / ``clip_l.`` / ``clip_g.`` + dotted path and
    PEFT's ``base_model.model.`` + the diffusers path; each reads back to the kohya file, and a
    merge from them equals the merge from the kohya file."""
    from library.models.unet_layout import block_map, original_path

    c = build_tiny_components(arch)
    tes = _tes(c)
    net = _network("oft_v2", c)
    sd = {k: v.detach().clone() for k, v in net.state_dict().items()}
    paths = {}  # kohya name -> (head, dotted path)
    blocks = block_map(c["unet"].config) if arch == "sdxl" else None
    for lo in _all(net):
        for root, head in ((c["unet"], "unet"), *((te, h) for te, h in zip(tes, ("clip_l", "clip_g")))):
            for path, layer in root.named_modules():
                if layer is lo.org_module:
                    paths[lo.lora_name] = (head, path)
    net.remove_from()
    assert len(paths) == len({k.partition(".")[0] for k in sd})

    def omi(name):
        head, path = paths[name]
        if head == "unet" and blocks is not None:  # OMI names the layer by sd-scripts' SAI path
            path = original_path(path, blocks)
        if head != "unet" and not path.startswith("text_model."):
            path = "text_model." + path
        return f"{head}.{path}"

    omi_sd = {omi(k.partition(".")[0]) + "." + k.partition(".")[2]: v for k, v in sd.items()}
    back, renamed = oft_v2.create_network_from_weights(1.0, None, None, tes if len(tes) > 1 else tes[0], c["unet"],
                                                       weights_sd=omi_sd)
    assert renamed.keys() == sd.keys() and all(torch.equal(renamed[k], sd[k]) for k in sd)
    save_file(omi_sd, str(tmp_path / "omi.safetensors"))  # network_weights: load_weights reads it too
    fresh = _network("oft_v2", c)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh.load_weights(str(tmp_path / "omi.safetensors"))
    assert all(torch.equal(v, sd[k]) for k, v in fresh.state_dict().items())
    fresh.remove_from()
    peft_sd = {"base_model.model." + paths[k.partition(".")[0]][1] + "." + k.partition(".")[2]: v
               for k, v in sd.items() if paths[k.partition(".")[0]][0] == "unet"}
    back, renamed = oft_v2.create_network_from_weights(1.0, None, None, tes if len(tes) > 1 else tes[0], c["unet"],
                                                       weights_sd=peft_sd)
    assert renamed == {k: v for k, v in sd.items() if k.startswith("lora_unet_")}
    if arch == "sdxl":
        with pytest.raises(LoRAError, match="does not say which text encoder"):
            oft_v2.create_network_from_weights(1.0, None, None, tes, c["unet"], weights_sd={
                "base_model.model.text_model.encoder.layers.0.self_attn.q_proj.oft_R.weight": torch.zeros(8, 6)})
