"""tools/update_gui_presets.py stores a kohya_ss checkout's presets, unchanged, with its commit."""
import json

from tools.update_gui_presets import main


def _write(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data), encoding="utf-8")


def test_presets_are_stored_with_their_commit(tmp_path, capsys):
    root = tmp_path / "kohya_ss"
    lora = {"LoRA_type": "Standard", "network_dim": 8, "sdxl": True, "optimizer": "Prodigy"}
    ft = {"learning_rate": 1e-5, "max_resolution": "512,512"}
    _write(root / "presets" / "lora" / "SDXL - a.json", lora)
    _write(root / "presets" / "finetune" / "b.json", ft)
    _write(root / "presets" / "lora" / "user_presets" / "mine.json", {"x": 1})  # a user's own
    (root / "presets" / "lora" / "prepare_presets.md").write_text("# notes")
    out = tmp_path / "fixture.json"
    sha = "0123456789abcdef0123456789abcdef01234567"
    assert main(["--kohya_ss", str(root), "--commit", sha, "--out", str(out)]) == 0
    data = json.loads(out.read_text(encoding="utf-8"))
    assert data == {"source": "bmaltais/kohya_ss", "commit": sha,
                    "presets": {"lora": {"SDXL - a": lora}, "finetune": {"b": ft}}}
    assert "2 presets" in capsys.readouterr().out


def test_bad_checkout_or_commit_is_one_line(tmp_path, capsys):
    out = str(tmp_path / "f.json")
    assert main(["--kohya_ss", str(tmp_path), "--commit", "0" * 40, "--out", out]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: --kohya_ss {tmp_path}: no presets/ folder (not a kohya_ss checkout)"
    _write(tmp_path / "presets" / "lora" / "a.json", {})
    assert main(["--kohya_ss", str(tmp_path), "--commit", "abc", "--out", out]) == 2
    assert capsys.readouterr().err.strip() == "error: --commit abc: not a 40-digit commit"
    (tmp_path / "presets" / "lora" / "a.json").write_text("{not json", encoding="utf-8")
    assert main(["--kohya_ss", str(tmp_path), "--commit", "0" * 40, "--out", out]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {tmp_path}/presets/lora/a.json: cannot read the preset") and "\n" not in err
