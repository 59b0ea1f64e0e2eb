"""The Dataset workbench's API (library/ui/workbench.py, dataset_routes.py) and dataset tools as
jobs (library/ui/tool_jobs.py), in process with FastAPI's TestClient.

References are independent of the code under test: texts and tag counts written out by hand,
pixel colours of solid images, the files on disk read back, the tool's own output folder.
"""
from __future__ import annotations

import io
import json
import os
import threading
import time

import pytest

from tests.outputs.test_faults_paths import _read_only
from tests.ui.conftest import UI

from library.ui import tool_jobs, workbench

pytest.importorskip("fastapi", reason="the ui extra (pip install -e \".[ui]\")")
pytest.importorskip("httpx", reason="the ui extra (pip install -e \".[ui]\")")


def png(color=(200, 30, 40), size=(64, 64), mode="RGB") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture
def allowed(tmp_path):
    root = tmp_path / "allowed"
    folder = root / "5_sks dog"
    folder.mkdir(parents=True)
    (folder / "a.png").write_bytes(png((255, 0, 0)))
    (folder / "b.png").write_bytes(png((0, 0, 255), (128, 64)))
    (folder / "c.png").write_bytes(png((0, 255, 0)))
    (folder / "a.txt").write_text("sks dog, red, solo", encoding="utf-8")
    (folder / "b.txt").write_text("sks dog, blue\nsecond line, red", encoding="utf-8")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "x.png").write_bytes(png())
    return root


@pytest.fixture
def wb(tmp_path, allowed):
    u = UI(tmp_path / "server", allowed_paths=[str(allowed)], gated=True)
    yield u
    u.close()


def concept(allowed) -> str:
    return str(allowed / "5_sks dog")


def test_picker_lists_inside_and_refuses_outside(wb, allowed, tmp_path):
    c = wb.client
    roots = c.get("/api/fs").json()
    assert [e["path"] for e in roots["entries"]] == [os.path.realpath(allowed)]
    top = c.get("/api/fs", params={"path": str(allowed)}).json()
    assert top["parent"] is None and [(e["name"], e["dir"]) for e in top["entries"]] == [("5_sks dog", True)]
    inner = c.get("/api/fs", params={"path": concept(allowed)}).json()
    assert [e["name"] for e in inner["entries"]] == ["a.png", "a.txt", "b.png", "b.txt", "c.png"]
    assert inner["parent"] == os.path.realpath(allowed)
    os.symlink(tmp_path / "outside", allowed / "link")
    for path in (str(tmp_path / "outside"), str(allowed / ".." / "outside"), str(allowed / "link")):
        r = c.get("/api/fs", params={"path": path})
        assert r.status_code == 403, r.text
        assert r.json()["error"] == f"folder {path} is outside the allowed paths ({allowed})"
    r = c.get("/api/dataset/thumb", params={"path": str(tmp_path / "outside" / "x.png")})
    assert r.status_code == 403 and "outside the allowed paths" in r.json()["error"]
    r = c.get("/api/dataset", params={"folder": str(allowed / "missing")})
    assert r.status_code == 422 and r.json() == {"error": f"folder {allowed / 'missing'}: no such folder"}


def test_folder_view_captions_tags_and_filters(wb, allowed):
    (allowed / "5_sks dog" / "c.txt").write_bytes("caf\xe9, dog".encode("latin-1"))
    v = wb.client.get("/api/dataset", params={"folder": concept(allowed), "ext": ".txt"}).json()
    assert v["repeats"] == 5 and v["writable"] and v["total"] == 3
    by = {i["name"]: i for i in v["images"]}
    assert by["a.png"]["caption"] == "sks dog, red, solo"
    assert by["a.png"]["hash"] == workbench.text_hash("sks dog, red, solo")
    # the file in another encoding: its one-line error, no text, no hash (it cannot be saved over)
    assert by["c.png"]["caption"] is None and by["c.png"]["hash"] is None
    assert by["c.png"]["error"].endswith("c.txt: line 1: not UTF-8 text (byte 0xe9 at column 4); save the file as UTF-8")
    # tags by the number of captions holding them (by hand: "red" is in both, on b's second line)
    assert v["tags"] == [["red", 2], ["sks dog", 2], ["blue", 1], ["second line", 1], ["solo", 1]]
    shown = lambda **p: [i["name"] for i in wb.client.get(  # noqa: E731
        "/api/dataset", params={"folder": concept(allowed), "ext": ".txt", **p}).json()["images"]]
    assert shown(tag="red") == ["a.png", "b.png"] and shown(tag="solo") == ["a.png"]
    assert shown(q="BLUE") == ["b.png"] and shown(q="c.png") == ["c.png"] and shown(tag="none") == []
    parent = wb.client.get("/api/dataset", params={"folder": str(allowed)}).json()
    assert parent["folders"] == [{"name": "5_sks dog", "path": os.path.realpath(concept(allowed)),
                                  "repeats": 5, "images": 3}]


def test_thumbnails_cached_by_content_and_a_corrupt_image(wb, allowed):
    from PIL import Image

    c, img = wb.client, str(allowed / "5_sks dog" / "b.png")
    r = c.get("/api/dataset/thumb", params={"path": img})
    assert r.status_code == 200 and r.headers["content-type"] == "image/jpeg"
    t = Image.open(io.BytesIO(r.content))
    # 128x64 scaled to fit 256: PIL's thumbnail never enlarges, so it stays 128x64
    assert t.size == (128, 64)
    px = t.convert("RGB").getpixel((64, 32))
    assert max(abs(a - b) for a, b in zip(px, (0, 0, 255))) <= 8  # JPEG of a flat colour
    cache = os.path.join(wb.data_dir, "thumbs")
    made = [os.path.join(d, f) for d, _, fs in os.walk(cache) for f in fs]
    assert len(made) == 1
    marker = png((0, 255, 0))
    with open(made[0], "wb") as f:
        f.write(marker)  # what the cache holds is what is served: not made again
    assert c.get("/api/dataset/thumb", params={"path": img}).content == marker
    # the image edited (another size and colour): a new thumbnail
    Image.new("RGBA", (512, 256), (0, 0, 0, 0)).save(img)
    t2 = Image.open(io.BytesIO(c.get("/api/dataset/thumb", params={"path": img}).content))
    assert t2.size == (256, 128) and t2.convert("RGB").getpixel((10, 10)) >= (250, 250, 250)  # alpha on white
    # EXIF orientation 6 (turned 90 degrees): shown as the trainer reads it, 64 wide and 128 high
    rot = Image.new("RGB", (128, 64), (0, 200, 0))
    exif = Image.Exif()
    exif[0x0112] = 6
    rot.save(allowed / "5_sks dog" / "rot.jpg", exif=exif)
    t3 = Image.open(io.BytesIO(c.get("/api/dataset/thumb", params={"path": str(allowed / "5_sks dog" / "rot.jpg")}).content))
    assert t3.size == (64, 128)
    (allowed / "5_sks dog" / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    r = c.get("/api/dataset/thumb", params={"path": str(allowed / "5_sks dog" / "bad.png")})
    assert r.status_code == 422
    err, reason = r.json()["error"], r.json()["reason"]
    # the path once (PIL's message quotes it too), then why; the tile, which shows the name, shows the reason
    bad = str(allowed / "5_sks dog" / "bad.png")
    assert err == f"image {bad}: {reason}" and err.count("bad.png") == 1 and "\n" not in err
    assert reason == "cannot decode it (cannot identify image file)"


def test_caption_edit_undo_and_a_stale_edit(wb, allowed):
    c, folder = wb.client, concept(allowed)
    a, cap = str(allowed / "5_sks dog" / "a.png"), allowed / "5_sks dog" / "a.txt"
    old = workbench.text_hash("sks dog, red, solo")
    r = c.put("/api/dataset/caption", json={"path": a, "ext": ".txt", "text": "sks dog, crimson", "base_hash": old})
    assert r.status_code == 200 and r.json()["hash"] == workbench.text_hash("sks dog, crimson")
    assert cap.read_text(encoding="utf-8") == "sks dog, crimson"
    # a second client that opened the old text: refused, the saved edit stays, the current text comes back
    r = c.put("/api/dataset/caption", json={"path": a, "ext": ".txt", "text": "mine", "base_hash": old})
    assert r.status_code == 409
    assert r.json()["current"] == "sks dog, crimson" and "changed since you opened it" in r.json()["error"]
    assert cap.read_text(encoding="utf-8") == "sks dog, crimson"
    # a new caption for an image without one
    cimg, ccap = str(allowed / "5_sks dog" / "c.png"), allowed / "5_sks dog" / "c.txt"
    assert c.put("/api/dataset/caption", json={"path": cimg, "ext": ".txt", "text": "green", "base_hash": ""}).status_code == 200
    assert ccap.read_text(encoding="utf-8") == "green"
    assert c.get("/api/dataset", params={"folder": folder, "ext": ".txt"}).json()["undo"] == 2
    r = c.post("/api/dataset/undo", json={"folder": folder})
    assert r.status_code == 200 and r.json()["kept"] == [] and not ccap.exists()  # the new one removed
    c.post("/api/dataset/undo", json={"folder": folder})
    assert cap.read_text(encoding="utf-8") == "sks dog, red, solo"
    r = c.post("/api/dataset/undo", json={"folder": folder})
    assert r.status_code == 422 and r.json()["error"].startswith(f"{os.path.realpath(folder)}: no caption edit to undo")
    # wrong types: one line each, nothing written
    for body, expect in (({"path": a, "ext": None, "text": "x", "base_hash": ""}, "--caption_extension None"),
                         ({"path": a, "ext": ".txt", "text": 3, "base_hash": ""}, "text: a string is required"),
                         ({"path": a, "ext": ".txt", "text": "x"}, "base_hash: a string is required"),
                         ({"path": None, "text": "x", "base_hash": ""}, "image: a path is required")):
        r = c.put("/api/dataset/caption", json=body)
        assert r.status_code == 422 and r.json()["error"].startswith(expect), r.text
    assert cap.read_text(encoding="utf-8") == "sks dog, red, solo"


def test_two_edits_of_one_caption_at_once_one_wins(allowed):
    # many rounds of four edits released together: the lock's creation must leave no window in
    # which another taker reads it without its holder's pid (it would take it for a dead
    # writer's lock, remove it, and both edits would be saved)
    a, cap = str(allowed / "5_sks dog" / "a.png"), allowed / "5_sks dog" / "a.txt"
    for n in range(25):
        base = workbench.text_hash(cap.read_text(encoding="utf-8"))
        results, go = {}, threading.Barrier(4)

        def edit(text):
            go.wait()
            try:
                workbench.save_caption(a, [str(allowed)], ".txt", text, base)
                results[text] = "saved"
            except workbench.UserError as e:
                results[text] = str(e)

        texts = [f"round {n} edit {k}" for k in range(4)]
        threads = [threading.Thread(target=edit, args=(t,)) for t in texts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        won = [t for t, r in results.items() if r == "saved"]
        assert len(won) == 1, results
        for t in set(texts) - set(won):
            assert "changed since you opened it" in results[t] or "another caption edit is running" in results[t]
        assert cap.read_text(encoding="utf-8") == won[0]


def test_a_caption_in_another_encoding_is_not_overwritten(wb, allowed):
    cap = allowed / "5_sks dog" / "c.txt"
    cap.write_bytes("caf\xe9".encode("latin-1"))
    r = wb.client.put("/api/dataset/caption", json={"path": str(allowed / "5_sks dog" / "c.png"), "ext": ".txt",
                                                    "text": "new", "base_hash": ""})
    assert r.status_code == 422 and "not UTF-8 text" in r.json()["error"]
    assert cap.read_bytes() == "caf\xe9".encode("latin-1")


def test_bulk_tag_rename_remove_add_and_undo(wb, allowed):
    c, folder = wb.client, concept(allowed)
    a, b = allowed / "5_sks dog" / "a.txt", allowed / "5_sks dog" / "b.txt"
    r = c.post("/api/dataset/tags", json={"folder": folder, "ext": ".txt", "op": "rename", "tag": "red", "new": "solo"})
    assert r.status_code == 200 and len(r.json()["changed"]) == 2
    assert a.read_text() == "sks dog, solo" and b.read_text() == "sks dog, blue\nsecond line, solo"
    c.post("/api/dataset/tags", json={"folder": folder, "ext": ".txt", "op": "remove", "tag": "sks dog"})
    assert a.read_text() == "solo" and b.read_text() == "blue\nsecond line, solo"
    # add, only to the images shown (a filtered view): b only
    r = c.post("/api/dataset/tags", json={"folder": folder, "ext": ".txt", "op": "add", "tag": "ohwx",
                                          "images": ["b.png"]})
    assert r.status_code == 200 and a.read_text() == "solo" and b.read_text() == "ohwx, blue\nohwx, second line, solo"
    r = c.post("/api/dataset/tags", json={"folder": folder, "ext": ".txt", "op": "rename", "tag": "a, b", "new": "x"})
    assert r.status_code == 422 and r.json()["error"] == "tag 'a, b': one tag (no comma)"
    r = c.post("/api/dataset/tags", json={"folder": folder, "ext": ".txt", "op": "explode", "tag": "a"})
    assert r.status_code == 422 and r.json()["error"] == "op 'explode': one of rename, remove, add"
    for _ in range(3):
        assert c.post("/api/dataset/undo", json={"folder": folder}).status_code == 200
    assert a.read_text() == "sks dog, red, solo" and b.read_text() == "sks dog, blue\nsecond line, red"


def test_concept_folders_and_repeats(wb, allowed):
    c = wb.client
    r = c.post("/api/dataset/concept", json={"parent": str(allowed), "name": "ohwx cat", "repeats": 3})
    assert r.status_code == 200 and os.path.isdir(allowed / "3_ohwx cat")
    r = c.post("/api/dataset/concept", json={"parent": str(allowed), "name": "ohwx cat", "repeats": 3})
    assert r.status_code == 409 and r.json()["error"].endswith("3_ohwx cat exists")
    for name, repeats in (("../x", 3), ("", 3), ("ok", 0), ("ok", "2")):
        r = c.post("/api/dataset/concept", json={"parent": str(allowed), "name": name, "repeats": repeats})
        assert r.status_code == 422 and "\n" not in r.json()["error"]
    r = c.post("/api/dataset/repeats", json={"folder": concept(allowed), "repeats": 12})
    assert r.status_code == 200 and sorted(os.listdir(allowed)) == ["12_sks dog", "3_ohwx cat"]
    assert sorted(os.listdir(allowed / "12_sks dog")) == ["a.png", "a.txt", "b.png", "b.txt", "c.png"]
    r = c.post("/api/dataset/repeats", json={"folder": str(allowed / "12_sks dog"), "repeats": 3})
    assert r.status_code == 200  # "3_sks dog" is free
    os.mkdir(allowed / "plain")
    r = c.post("/api/dataset/repeats", json={"folder": str(allowed / "plain"), "repeats": 3})
    assert r.status_code == 422 and "not a <repeats>_<concept> folder" in r.json()["error"]


def test_uploads(wb, allowed, tmp_path):
    c, folder = wb.client, concept(allowed)
    data = png((1, 2, 3))
    r = c.put("/api/dataset/upload", params={"folder": folder, "name": "new.png"}, content=data)
    assert r.status_code == 200 and (allowed / "5_sks dog" / "new.png").read_bytes() == data
    r = c.put("/api/dataset/upload", params={"folder": folder, "name": "new.png"}, content=png((9, 9, 9)))
    assert r.status_code == 409 and (allowed / "5_sks dog" / "new.png").read_bytes() == data
    for name, body, expect in (("x.gif", data, "not an image type the trainer reads"),
                               ("x.png", b"not an image", "not a readable image"),
                               ("../x.png", data, "a plain file name is required")):
        r = c.put("/api/dataset/upload", params={"folder": folder, "name": name}, content=body)
        assert r.status_code == 422 and expect in r.json()["error"], r.text
    r = c.put("/api/dataset/upload", params={"folder": str(tmp_path / "outside"), "name": "y.png"}, content=data)
    assert r.status_code == 403 and not (tmp_path / "outside" / "y.png").exists()
    # over the upload limit: 413 before anything is written
    small = UI(tmp_path / "s2", allowed_paths=[str(allowed)], max_body=1 << 20)
    small.settings.max_upload = 1000
    from fastapi.testclient import TestClient

    from library.ui.app import create_app

    client = TestClient(create_app(small.settings, small.store, small.runner))
    r = client.put("/api/dataset/upload", params={"folder": folder, "name": "big.png"}, content=png(size=(300, 300), mode="RGB") + b"\0" * 2000)
    assert r.status_code == 413 and not (allowed / "5_sks dog" / "big.png").exists()
    small.close()


def test_read_only_folder(wb, allowed):
    folder = allowed / "5_sks dog"
    undo = _read_only(folder)
    try:
        v = wb.client.get("/api/dataset", params={"folder": str(folder), "ext": ".txt"}).json()
        r = wb.client.put("/api/dataset/caption", json={"path": str(folder / "a.png"), "ext": ".txt", "text": "x",
                                                        "base_hash": workbench.text_hash("sks dog, red, solo")})
        up = wb.client.put("/api/dataset/upload", params={"folder": str(folder), "name": "n.png"}, content=png())
    finally:
        undo()
    assert v["writable"] is False
    assert r.status_code == 422 and "cannot write there" in r.json()["error"] and "nothing was changed" in r.json()["error"]
    assert up.status_code == 422 and "Read-only file system" in up.json()["error"]
    assert (folder / "a.txt").read_text() == "sks dog, red, solo" and not (folder / "n.png").exists()


def test_preview_buckets_and_captions_as_trained(wb, allowed):
    r = wb.client.post("/api/dataset/preview", json={"folder": concept(allowed), "ext": ".txt", "resolution": 512})
    assert r.status_code == 200, r.text
    d = r.json()
    # 3 images x 5 repeats; the two squares in the 512x512 bucket (the square bucket at the
    # resolution's area), b (2:1) in a wider one
    assert sum(b["samples"] for b in d["buckets"]) == 15
    assert {"width": 512, "height": 512, "samples": 10} in d["buckets"]
    wide = [b for b in d["buckets"] if b["width"] != 512]
    assert len(wide) == 1 and wide[0]["width"] > wide[0]["height"] and wide[0]["samples"] == 5
    # no shuffle or dropout configured: the caption file's first line; c.png without a caption
    # file trains on the folder's class tokens
    expected = {"a.png": "sks dog, red, solo", "b.png": "sks dog, blue", "c.png": "sks dog"}
    assert len(d["captions"]) == 6  # the first six samples of epoch 1
    assert all(c["caption"] == expected[c["image"]] for c in d["captions"]), d["captions"]
    r = wb.client.post("/api/dataset/preview", json={"folder": concept(allowed), "resolution": 13})
    assert r.status_code == 422 and r.json()["error"] == "resolution 13: an integer from 64 to 4096 is required"


def _log_tail(ui, jid) -> str:
    with open(os.path.join(ui.data_dir, "jobs", str(jid), "log.txt"), encoding="utf-8", errors="replace") as f:
        return f.read()[-2000:]


def test_tool_jobs_allow_list_and_paths(wb, allowed, tmp_path):
    c = wb.client
    listed = c.get("/api/tools").json()["tools"]
    assert {"tools/caption_edit.py", "tools/resize_images_to_resolution.py",
            "finetune/clean_captions_and_tags.py", "tools/compare_checkpoints.py"} <= set(listed)
    assert all(os.path.isfile(os.path.join(tool_jobs.ROOT, t)) for t in listed)
    assert "tools/make_tiny_model.py" not in listed and "train_lora.py" not in listed
    r = c.post("/api/jobs", json={"tool": "tools/make_tiny_model.py", "args": []})
    assert r.status_code == 422 and "not a dataset tool of this checkout" in r.json()["errors"][0]["message"]
    r = c.post("/api/jobs", json={"tool": "finetune/tag_images_by_wd14_tagger_typo.py", "args": []})
    assert r.status_code == 422
    for args in ([str(tmp_path / "outside"), "x"], ["--out=" + str(tmp_path / "outside")],
                 ["-o" + str(tmp_path / "outside")], ["~/x"],
                 [str(allowed / ".." / "outside")]):
        r = c.post("/api/jobs", json={"tool": "tools/caption_edit.py", "args": ["tags"] + args})
        assert r.status_code == 403, (args, r.text)
        assert "outside the allowed paths" in r.json()["errors"][0]["message"]
    r = c.post("/api/jobs", json={"tool": "tools/caption_edit.py", "args": "tags x"})
    assert r.status_code == 422 and c.get("/api/jobs").json()["jobs"] == []
    # a word that is not a path passes; a relative output lands inside the first allowed folder
    config = json.loads(tool_jobs.check("tools/caption_edit.py", ["trigger", concept(allowed), "sks"], [str(allowed)]))
    assert config == {"args": ["trigger", concept(allowed), "sks"], "cwd": os.path.realpath(allowed)}


def test_tool_job_runs_in_the_queue_with_progress(wb, allowed):
    c = wb.client
    dst = allowed / "resized"
    r = c.post("/api/jobs", json={"tool": "tools/resize_images_to_resolution.py",
                                  "args": [concept(allowed), "resized", "--max_resolution", "32x32"]})
    assert r.status_code == 201
    j = wb.wait(r.json()["id"], lambda j: j["state"] in ("done", "failed"), timeout=120)
    assert j["state"] == "done", _log_tail(wb, j["id"])
    assert j["script"] == "tools/resize_images_to_resolution.py" and j["exit_code"] == 0
    # the relative destination is inside the allowed folder (the job's working folder)
    assert sorted(os.listdir(dst)) == ["a+32x32.jpg", "a.txt", "b+32x32.jpg", "b.txt", "c+32x32.jpg"]
    # progress from the tool's bar: 5 files listed in the source folder
    assert (j["step"], j["total_steps"]) == (5, 5)
    assert c.get(f"/api/jobs/{j['id']}/files/x").status_code == 404  # no output folder of its own
    # caption_edit as a job: its one-line error is the job's error
    r = c.post("/api/jobs", json={"tool": "tools/caption_edit.py", "args": ["remove", concept(allowed), ",", "--caption_extension", ".txt"]})
    j = wb.wait(r.json()["id"], lambda j: j["state"] in ("done", "failed"), timeout=120)
    assert j["state"] == "failed" and j["exit_code"] == 2 and j["error"] == "error: tag ',': no tag"


def test_a_tool_job_waits_its_turn_and_stops(wb, allowed):
    from PIL import Image

    src = allowed / "many"
    src.mkdir()
    for i in range(300):
        Image.new("RGB", (8, 8), (i % 256, 0, 0)).save(src / f"{i:03d}.png")
    c = wb.client
    c.post("/api/queue", json={"held": True})
    long = c.post("/api/jobs", json={"tool": "tools/resize_images_to_resolution.py",
                                     "args": [str(src), str(allowed / "big"), "--max_resolution", "768x768",
                                              "--interpolation", "lanczos4"]}).json()["id"]
    nxt = c.post("/api/jobs", json={"tool": "tools/caption_edit.py",
                                    "args": ["trigger", concept(allowed), "ohwx", "--caption_extension", ".txt"]}).json()["id"]
    wb.hold(long, (2, "signal"))  # after 2 images it waits for the stop (tests/step_gate.py)
    c.post("/api/queue", json={"held": False})
    j = wb.wait(long, lambda j: j["state"] == "running" and j["step"] >= 2, timeout=120)
    assert j["total_steps"] == 300
    r = c.post(f"/api/jobs/{long}/save_now")
    assert r.status_code == 409 and r.json()["error"].endswith("a dataset tool: it has no save_now")
    assert c.get(f"/api/jobs/{nxt}").json()["state"] == "queued"  # one job at a time on the CPU
    assert c.post(f"/api/jobs/{long}/stop").status_code == 200
    j = wb.wait(long, lambda j: j["state"] not in ("running", "stopping"), timeout=60)
    assert j["state"] == "stopped" and j["step"] == 2
    assert len(os.listdir(allowed / "big")) < 300
    j = wb.wait(nxt, lambda j: j["state"] in ("done", "failed"), timeout=120)
    assert j["state"] == "done", _log_tail(wb, nxt)
    assert (allowed / "5_sks dog" / "a.txt").read_text() == "ohwx, sks dog, red, solo"


def test_log_progress_reads_the_last_bar(tmp_path):
    log = tmp_path / "log.txt"
    assert tool_jobs.log_progress(str(log)) == {"step": 0, "total_steps": None}
    log.write_text("loading\nresize:  10%|#         | 3/30 [00:01<00:09,  3.0file/s]\r"
                   "resize:  20%|##        | 6/30 [00:02<00:08,  3.0file/s]")
    assert tool_jobs.log_progress(str(log)) == {"step": 6, "total_steps": 30}


def test_the_thumbnail_cache_keeps_the_recently_used(allowed, tmp_path):
    cache, folder = str(tmp_path / "thumbs"), allowed / "5_sks dog"
    made = {n: workbench.thumbnail(str(folder / n), [], cache) for n in ("a.png", "b.png", "c.png")}
    old = time.time() - 100
    for i, p in enumerate(made.values()):
        os.utime(p, (old + i, old + i))  # a oldest, c newest
    workbench.thumbnail(str(folder / "a.png"), [], cache)  # a used again: now the newest
    keep = os.path.getsize(made["a.png"]) + os.path.getsize(made["c.png"])
    assert workbench.prune_thumbnails(cache, keep) == 1
    assert [os.path.exists(made[n]) for n in ("a.png", "b.png", "c.png")] == [True, False, True]
    assert workbench.prune_thumbnails(cache, keep) == 0


@pytest.mark.slow  # a subprocess that imports torch and diffusers: 40-60 s on a loaded 2-core machine
def test_compare_checkpoints_runs_as_a_tool_job(wb, allowed, tmp_path):
    """The checkpoint grid queued from the API: its progress is the cells' bar, its grid.json lands
    in the relative output folder inside the allowed folder; a run folder outside is refused."""
    from tests.outputs.test_gen_img import write_lora

    run = allowed / "run"
    run.mkdir()
    write_lora("sd15", str(run / "sks-000001.safetensors"), seed=1)
    write_lora("sd15", str(run / "sks.safetensors"), seed=2)
    c = wb.client
    args = ["--ckpt", "tiny-sd15", "--prompt", "red cube", "--W", "64", "--H", "64", "--steps", "1",
            "--outdir", "grid"]
    r = c.post("/api/jobs", json={"tool": "tools/compare_checkpoints.py",
                                  "args": [*args, "--lora_dir", str(tmp_path / "server")]})
    assert r.status_code == 403 and "outside the allowed paths" in r.json()["errors"][0]["message"]
    r = c.post("/api/jobs", json={"tool": "tools/compare_checkpoints.py", "args": [*args, "--lora_dir", str(run)]})
    assert r.status_code == 201
    j = wb.wait(r.json()["id"], lambda j: j["state"] in ("done", "failed"), timeout=300)
    assert j["state"] == "done", _log_tail(wb, j["id"])
    assert (j["step"], j["total_steps"]) == (2, 2)
    layout = json.loads((allowed / "grid" / "grid.json").read_text())
    assert [r["name"] for r in layout["rows"]] == ["sks-000001", "sks"]
    assert (allowed / "grid" / "grid.png").is_file()
