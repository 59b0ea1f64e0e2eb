"""--lbws (LoRA Block Weight lists) in svd_merge_lora.py, merge_lora.py and sdxl_merge_lora.py:
each merge equals a block-weighted merge built by hand from the LoRA Block Weight extension's
block names (written out below, not taken from the code), and bad lists are one line, exit 2."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from library.models.families.sd_common.tiny_models import build_tiny_components
from networks import lora_blocks, merge_lora, sdxl_merge_lora, svd_merge_lora
from tests.networks.test_lora_tools import modules_in, read, ref_delta, rel
from tests.networks.test_merge_lora import make_lora_file, tes

BLOCKS = ["BASE"] + [f"IN{i:02d}" for i in range(12)] + ["MID"] + [f"OUT{i:02d}" for i in range(12)]
# the blocks a 17-value (SD1/SD2) and a 12- or 20-value (SDXL) list sets, in order; the rest keep 1
SET_17 = "BASE IN01 IN02 IN04 IN05 IN07 IN08 MID OUT03 OUT04 OUT05 OUT06 OUT07 OUT08 OUT09 OUT10 OUT11".split()
SET_12 = "BASE IN04 IN05 IN07 IN08 MID OUT00 OUT01 OUT02 OUT03 OUT04 OUT05".split()
SET_20 = ("BASE IN00 IN01 IN02 IN03 IN04 IN05 IN06 IN07 IN08 MID "
          "OUT00 OUT01 OUT02 OUT03 OUT04 OUT05 OUT06 OUT07 OUT08").split()

# SD1/SD2 (diffusers names): the extension's block of each module of the tiny U-Net, by hand
SD1_BLOCK = {
    "lora_te_text_model_encoder": "BASE",
    "lora_unet_down_blocks_0_resnets_0": "IN01", "lora_unet_down_blocks_0_attentions_0": "IN01",
    "lora_unet_down_blocks_0_resnets_1": "IN02", "lora_unet_down_blocks_0_attentions_1": "IN02",
    "lora_unet_down_blocks_0_downsamplers_0": "IN03",
    "lora_unet_down_blocks_1_resnets_0": "IN04", "lora_unet_down_blocks_1_attentions_0": "IN04",
    "lora_unet_down_blocks_1_resnets_1": "IN05", "lora_unet_down_blocks_1_attentions_1": "IN05",
    "lora_unet_down_blocks_1_downsamplers_0": "IN06",
    "lora_unet_down_blocks_2_resnets_0": "IN07", "lora_unet_down_blocks_2_attentions_0": "IN07",
    "lora_unet_down_blocks_2_resnets_1": "IN08", "lora_unet_down_blocks_2_attentions_1": "IN08",
    "lora_unet_down_blocks_2_downsamplers_0": "IN09",
    "lora_unet_down_blocks_3_resnets_0": "IN10", "lora_unet_down_blocks_3_resnets_1": "IN11",
    "lora_unet_mid_block": "MID",
    "lora_unet_up_blocks_0_resnets_0": "OUT00", "lora_unet_up_blocks_0_resnets_1": "OUT01",
    "lora_unet_up_blocks_0_resnets_2": "OUT02", "lora_unet_up_blocks_0_upsamplers_0": "OUT02",
    "lora_unet_up_blocks_1_resnets_0": "OUT03", "lora_unet_up_blocks_1_attentions_0": "OUT03",
    "lora_unet_up_blocks_1_resnets_1": "OUT04", "lora_unet_up_blocks_1_attentions_1": "OUT04",
    "lora_unet_up_blocks_1_resnets_2": "OUT05", "lora_unet_up_blocks_1_attentions_2": "OUT05",
    "lora_unet_up_blocks_1_upsamplers_0": "OUT05",
    "lora_unet_up_blocks_2_resnets_0": "OUT06", "lora_unet_up_blocks_2_attentions_0": "OUT06",
    "lora_unet_up_blocks_2_resnets_1": "OUT07", "lora_unet_up_blocks_2_attentions_1": "OUT07",
    "lora_unet_up_blocks_2_resnets_2": "OUT08", "lora_unet_up_blocks_2_attentions_2": "OUT08",
    "lora_unet_up_blocks_2_upsamplers_0": "OUT08",
    "lora_unet_up_blocks_3_resnets_0": "OUT09", "lora_unet_up_blocks_3_attentions_0": "OUT09",
    "lora_unet_up_blocks_3_resnets_1": "OUT10", "lora_unet_up_blocks_3_attentions_1": "OUT10",
    "lora_unet_up_blocks_3_resnets_2": "OUT11", "lora_unet_up_blocks_3_attentions_2": "OUT11",
}
# SDXL (SAI names): input_blocks_N is IN0N, the middle blocks MID, output_blocks_N OUT0N
SDXL_BLOCK = {"lora_te1_text_model_encoder": "BASE", "lora_te2_text_model_encoder": "BASE",
              **{f"lora_unet_input_blocks_{n}": f"IN0{n}" for n in range(1, 9)},
              **{f"lora_unet_middle_block_{n}": "MID" for n in range(3)},
              **{f"lora_unet_output_blocks_{n}": f"OUT0{n}" for n in range(9)}}


def block_of(name: str, table: dict) -> str:
    hits = [block for prefix, block in table.items() if name.startswith(prefix + "_")]
    assert len(hits) == 1, name
    return hits[0]


def weights_of(values: list[float], blocks: list[str]) -> dict[str, float]:
    return {b: dict(zip(blocks, values)).get(b, 1.0) for b in BLOCKS}


def lbw_sum(files_ratios_weights, table):
    """float64 sum_i ratio_i * w_i[block(module)] * delta_i, by hand."""
    out = {}
    for path, ratio, weights in files_ratios_weights:
        sd, _ = read(path)
        for name in modules_in(sd):
            out[name] = out.get(name, 0) + ratio * weights[block_of(name, table)] * ref_delta(sd, name)
    return out


@pytest.fixture(scope="module")
def sd1(tmp_path_factory):
    d = tmp_path_factory.mktemp("sd1")
    return (make_lora_file("sd15", d / "a.safetensors", seed=1),
            make_lora_file("sd15", d / "b.safetensors", seed=2, dim=2, alpha=1.0, conv_dim=None, text_encoder=False))


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    d = tmp_path_factory.mktemp("sdxl")
    return (make_lora_file("sdxl", d / "a.safetensors", seed=3, conv_dim=None),
            make_lora_file("sdxl", d / "b.safetensors", seed=4, dim=2, alpha=1.0, conv_dim=None, text_encoder=False))


def _json(values):
    return "[" + ",".join(f"{v:g}" for v in values) + "]"


@pytest.mark.parametrize("blocks", [BLOCKS, SET_17], ids=["26", "17"])
def test_svd_merge_lbws_is_the_hand_built_block_weighted_sum(sd1, tmp_path, blocks):
    a, b = sd1
    wa = [0.1 * k - 0.7 for k in range(len(blocks))]  # negative, zero-ish and above-one weights
    wb = [1.5 - 0.05 * k for k in range(len(blocks))]
    out = tmp_path / "svd.safetensors"
    assert svd_merge_lora.main(["--models", a, b, "--ratios", "0.8", "-0.5", "--lbws", _json(wa), _json(wb),
                                "--save_to", str(out), "--new_rank", "6", "--new_conv_rank", "3"]) == 0
    expected = lbw_sum([(a, 0.8, weights_of(wa, blocks)), (b, -0.5, weights_of(wb, blocks))], SD1_BLOCK)
    sd, _ = read(out)
    assert modules_in(sd) == sorted(expected)
    for name, ref in expected.items():
        assert rel(ref_delta(sd, name), ref) < 1e-5, name


def test_sdxl_merge_lora_concat_lbws_is_exact(sdxl, tmp_path):
    a, b = sdxl
    wa, wb = [0.5, 2.0, -1.0, 0.0, 0.25, 1.5, 0.75, -0.5, 3.0, 1.25, 0.1, 0.9], [1.0] * 6 + [0.3] * 6
    out = tmp_path / "cat.safetensors"
    assert sdxl_merge_lora.main(["--models", a, b, "--ratios", "1.0", "0.6", "--lbws", _json(wa), _json(wb),
                                 "--concat", "--save_to", str(out)]) == 0
    expected = lbw_sum([(a, 1.0, weights_of(wa, SET_12)), (b, 0.6, weights_of(wb, SET_12))], SDXL_BLOCK)
    sd, _ = read(out)
    for name, ref in expected.items():
        assert rel(ref_delta(sd, name), ref) < 1e-6, name


def test_sdxl_merge_into_the_model_with_lbws_equals_a_hand_scaled_lora(sdxl):
    """Block weights given to the merge == the same LoRA with each module's up factor scaled by hand."""
    a, _ = sdxl
    w = [0.1 * k - 0.4 for k in range(20)]
    weights = weights_of(w, SET_20)
    sd = load_file(a)
    scaled = {k: v * weights[block_of(k.split(".")[0], SDXL_BLOCK)] if k.endswith("lora_up.weight") else v
              for k, v in sd.items()}
    with_lbw, by_hand = build_tiny_components("sdxl"), build_tiny_components("sdxl")
    blocks, is_sdxl = lora_blocks.parse_lbws([_json(w)], 1)
    assert is_sdxl
    merge_lora.merge_lora_into(tes(with_lbw), with_lbw["unet"], sd, 0.7, blocks[0])
    merge_lora.merge_lora_into(tes(by_hand), by_hand["unet"], scaled, 0.7)
    for part in ("unet", "text_encoder", "text_encoder_2"):
        got, want = with_lbw[part].state_dict(), by_hand[part].state_dict()
        for k, v in want.items():
            # W + 0.7 * (w * up) @ down * s against W + (0.7 * w) * up @ down * s: the same sum up to
            # float32 rounding of the delta and of the sum, a few units of roundoff of max(|W|, 1)
            assert torch.allclose(got[k], v, rtol=0, atol=8 * 2 ** -24 * max(float(v.abs().max()), 1.0)), k


@pytest.mark.parametrize("tool,argv,message", [
    (svd_merge_lora, ["--lbws", "[1]", "[1]", "[1]"], "--lbws: 3 value(s) given for 2 file(s) in --models"),
    (svd_merge_lora, ["--lbws", "not json", "[1]"], "--lbws 'not json': not a JSON list of numbers"),
    (svd_merge_lora, ["--lbws", _json([1] * 13), _json([1] * 13)], "13 values; expected 17 or 26 (SD1/SD2) or 12 or 20 (SDXL)"),
    (svd_merge_lora, ["--lbws", _json([1] * 17), _json([1] * 26)], "--lbws: lists of 17 and 26 values"),
    (svd_merge_lora, ["--lbws", _json([1] * 12), _json([1] * 12)], "--lbws: the lists have SDXL's lengths (12 or 20) but"),
    (merge_lora, ["--lbws", _json([1] * 20), _json([1] * 20), "--concat"], "but {a} is SD1/SD2"),
    (sdxl_merge_lora, ["--concat"], "{a}: not an SDXL LoRA"),
])
def test_bad_lbws_are_one_line_and_write_nothing(sd1, tmp_path, capsys, tool, argv, message):
    a, b = sd1
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"previous good LoRA")
    capsys.readouterr()
    assert tool.main(["--models", a, b, "--save_to", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and message.format(a=a) in err, err
    assert out.read_bytes() == b"previous good LoRA"


def test_sdxl_merge_lora_refuses_another_family_model(sdxl, tmp_path, capsys):
    out = tmp_path / "m.safetensors"
    assert sdxl_merge_lora.main(["--sd_model", "tiny-sd15", "--models", sdxl[0], "--save_to", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--sd_model tiny-sd15: a sd1 model; sdxl_merge_lora.py merges into SDXL models" in err and "\n" not in err
    assert not out.exists()


def test_help_names_sd_scripts_flags(capsys):
    for tool in (svd_merge_lora, sdxl_merge_lora):
        with pytest.raises(SystemExit):
            tool.main(["--help"])
        text = capsys.readouterr().out
        assert "--lbws" in text and "--models" in text and "--save_to" in text
