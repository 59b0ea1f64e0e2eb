"""The JSON API in process (FastAPI's TestClient): every route, state and refusal of docs/UI.md.

References are independent of the API: the schema's tables, the command-line parser's own error
for the same file, ``plan_run`` and ``memory_estimate.estimate`` called directly, the saved
weights of an uninterrupted run, the SQLite file read by a second store.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import read
from tests.ui.conftest import UI, tiny_config

from library.config.options import OPTIONS
from library.config.parse import parse_args
from library.errors import UserError

pytest.importorskip("fastapi", reason="the ui extra (pip install -e \".[ui]\")")
pytest.importorskip("httpx", reason="the ui extra (pip install -e \".[ui]\")")


@pytest.fixture
def data(tmp_path):
    from tools.make_sample_dataset import make_sample_dataset

    root = tmp_path / "data"
    make_sample_dataset(str(root), n_images=2, size=64, repeats=2)
    return str(root)


def test_schema_is_the_option_table(ui):
    s = ui.client.get("/api/schema").json()
    assert s["scripts"] == ["train_lora", "train_dreambooth", "finetune", "train_textual_inversion"]
    by_name = {o["name"]: o for o in s["options"]}
    # config: command line only; train_leco's own options (prompts_file ...): it runs from the
    # command line, and is in no option's scripts here
    image = set(s["scripts"])
    ui_options = [o for o in OPTIONS if not o.cli_only and image & set(o.scripts)]
    assert set(by_name) == {o.name for o in ui_options} and "prompts_file" not in by_name
    for o in ui_options:
        got = by_name[o.name]
        assert set(got) >= {"name", "type", "default", "help", "section", "scripts", "choices"}
        assert (got["type"], got["help"], got["section"], tuple(got["scripts"])) == \
            (o.type, o.help, o.section, tuple(x for x in o.scripts if x in image))
        assert got["choices"] == (list(o.choices) if o.choices else None)
        assert got["default"] == (list(o.default) if isinstance(o.default, tuple) else o.default)
    assert by_name["network_dim"]["scripts"] == ["train_lora"]


def test_validate_typo_gets_the_parsers_error_with_the_closest_name(ui, data, tmp_path):
    text = tiny_config(data, str(tmp_path / "out")) + "netwrk_dim = 8\n"
    r = ui.client.post("/api/validate", json={"script": "train_lora", "config": text})
    assert r.status_code == 200
    v = r.json()
    assert v["ok"] is False and len(v["errors"]) == 1
    e = v["errors"][0]
    assert e["option"] == "netwrk_dim" and e["suggestion"] == "network_dim"
    # the command line's message for the same file, its path read as "config"
    path = tmp_path / "config.toml"
    path.write_text(text)
    with pytest.raises(UserError) as cli:
        parse_args("train_lora", ["--config", str(path)])
    assert e["message"] == str(cli.value).replace(str(path), "config")
    assert "did you mean network_dim?" in e["message"] and e["message"].startswith("config:10: ")


def test_validate_gives_the_dry_runs_plan_and_memory_estimate(ui, data, tmp_path):
    from library.config.options import METHOD_OF_SCRIPT
    from library.training import memory_estimate
    from library.training.plan import plan_run

    text = tiny_config(data, str(tmp_path / "out"), steps=5, gradient_accumulation_steps=2)
    t0 = time.perf_counter()
    v = ui.client.post("/api/validate", json={"script": "train_lora", "config": text,
                                              "memory": False}).json()
    fast = time.perf_counter() - t0
    assert v["ok"], v
    assert v["memory"] is None and fast < 5  # every edit (measured ~0.01 s; docs/UI.md)
    v = ui.client.post("/api/validate", json={"script": "train_lora", "config": text}).json()
    path = tmp_path / "c.toml"
    path.write_text(text)
    opts, tset, plan = plan_run(parse_args("train_lora", ["--config", str(path)]), 1)
    for k in ("total_steps", "global_batch", "steps_per_epoch", "epochs"):
        assert v["plan"][k] == getattr(plan, k), k
    assert v["plan"]["global_batch"] == 2 and v["plan"]["total_steps"] == 5
    # 4 samples per epoch: the global batch is 2 x P, the steps per epoch ceil(4 / (2 P)) or less
    assert [v["plans"][str(p)]["global_batch"] for p in (1, 2, 4, 8)] == [2, 4, 8, 16]
    assert [v["plans"][str(p)]["steps_per_epoch"] for p in (1, 2, 4, 8)] == [2, 1, 1, 1]
    est = memory_estimate.estimate(opts, METHOD_OF_SCRIPT["train_lora"], tset, 1)
    assert v["memory"]["total_gib"] == pytest.approx(est.total / 1024 ** 3, rel=1e-6)
    assert v["dataset"]["subsets"][0]["images"] == 2 and v["dataset"]["subsets"][0]["repeats"] == 2
    assert v["dataset"]["buckets"] == [{"width": 64, "height": 64, "samples": 4}]
    assert v["dataset"]["captions"][0]["caption"] == "sks shape, a red circle"
    bad = ui.client.post("/api/validate", json={"script": "train_lora",
                                                "config": text.replace('output_dir', '#')}).json()
    assert bad["errors"][0]["option"] == "output_dir"
    assert ui.client.post("/api/validate", json={"script": "nope", "config": ""}).status_code == 400


# A kohya_ss GUI LoRA preset as the GUI saves it (its field names, every field present)
GUI_PRESET = {
    "LoRA_type": "Standard", "adaptive_noise_scale": 0, "bucket_no_upscale": True,
    "bucket_reso_steps": 64, "cache_latents": True, "caption_extension": ".caption", "epoch": 4,
    "flip_aug": False, "gradient_checkpointing": False, "learning_rate": 0.0001, "lr_scheduler": "cosine",
    "lr_warmup": 10, "max_resolution": "64,64", "max_train_steps": 3, "mixed_precision": "no",
    "network_alpha": 2, "network_dim": 4, "noise_offset_type": "Original", "optimizer": "AdamW",
    "output_name": "last", "save_model_as": "safetensors", "sdxl": False, "seed": 1,
    "shuffle_caption": False, "text_encoder_lr": 0.0001, "unet_lr": 0.0001, "xformers": "sdpa",
    "flux1_checkbox": False, "clip_l": "", "mem_eff_attn": False, "weird_fieldd": 3,
    "reg_data_dir": "", "vae_chunk_size": 0, "train_batch_size": 1,
}


def test_import_a_gui_preset_with_notes(ui, data, tmp_path):
    r = ui.client.post("/api/import", json={"script": "train_lora", "text": json.dumps(GUI_PRESET)})
    assert r.status_code == 200
    out = r.json()
    notes = "\n".join(out["notes"])
    assert "epoch: dropped; no effect" in notes  # GUI_KEYS: the GUI folds it into max_train_steps
    assert "noise_offset_type: dropped; no effect" in notes
    assert "sdxl: dropped" in notes and "weird_fieldd: dropped; unknown key" in notes
    assert "lr_warmup: 10 % of the steps -> lr_warmup_steps = 0.1" in notes
    assert "flux1_checkbox" not in notes and "clip_l" not in notes  # empty GUI fields: silent
    import tomllib

    cfg = tomllib.loads(out["config"])
    assert cfg["optimizer_type"] == "AdamW" and cfg["resolution"] == "64,64" and cfg["sdpa"] is True
    assert cfg["network_module"] == "networks.lora" and cfg["lr_warmup_steps"] == 0.1
    assert "reg_data_dir" not in cfg and "epoch" not in cfg
    # with the paths filled in, the imported config is a valid run
    full = out["config"] + f'train_data_dir = "{data}"\noutput_dir = "{tmp_path}/o"\n' \
        'pretrained_model_name_or_path = "tiny-sd15"\n'
    v = ui.client.post("/api/validate", json={"script": "train_lora", "config": full,
                                              "memory": False}).json()
    assert v["ok"], v["errors"]
    # the TOML the GUI writes: kept as is, a LyCORIS type noted, other family keys noted when set
    toml_text = '[model]\nnetwork_dim = 4\nsave_clip = true\nnetwrk_alpha = 1\n'
    out = ui.client.post("/api/import", json={"script": "train_lora", "text": toml_text}).json()
    assert tomllib.loads(out["config"]) == {"network_dim": 4}
    assert any(n.startswith("save_clip: dropped;") for n in out["notes"]), out["notes"]
    assert "netwrk_alpha: dropped; unknown key (did you mean network_alpha?)" in out["notes"]
    lyco = dict(GUI_PRESET, LoRA_type="LyCORIS/LoHa", conv_dim=4)  # (tests/ui/test_gui_import_network.py)
    out = ui.client.post("/api/import", json={"script": "train_lora", "text": json.dumps(lyco)}).json()
    cfg = tomllib.loads(out["config"])
    assert cfg["network_module"] == "lycoris.kohya" and {"algo=loha", "conv_dim=4"} <= set(cfg["network_args"])
    assert not any(n.startswith("LoRA_type") for n in out["notes"]), out["notes"]
    bad = ui.client.post("/api/import", json={"script": "train_lora", "text": "{nope"})
    assert bad.status_code == 422 and "invalid JSON" in bad.json()["error"]


def test_an_invalid_config_is_422_and_nothing_is_queued(ui, data, tmp_path):
    text = tiny_config(data, str(tmp_path / "out")) + "netwrk_dim = 8\n"
    r = ui.client.post("/api/jobs", json={"script": "train_lora", "config": text})
    assert r.status_code == 422 and r.json()["errors"][0]["suggestion"] == "network_dim"
    assert ui.client.get("/api/jobs").json()["jobs"] == [] and ui.store.all() == []
    r = ui.client.post("/api/jobs", json={"script": "train_lora", "config": "x", "processes": 0})
    assert r.status_code == 400


def test_paths_outside_allowed_paths_are_refused(tmp_path, data):
    ui = UI(tmp_path, allowed_paths=[str(tmp_path / "data"), str(tmp_path / "outputs")])
    try:
        ok = tiny_config(data, str(tmp_path / "outputs" / "a"))
        outside = tiny_config(data, str(tmp_path / "elsewhere"))
        r = ui.client.post("/api/jobs", json={"script": "train_lora", "config": outside})
        assert r.status_code == 403
        assert r.json()["errors"][0]["option"] == "output_dir" and "outside the allowed" in r.text
        escape = tiny_config(data, str(tmp_path / "outputs" / ".." / "elsewhere"))
        assert ui.client.post("/api/jobs", json={"script": "train_lora", "config": escape}).status_code == 403
        link = tmp_path / "outputs"
        link.mkdir()
        os.symlink(tmp_path, link / "up")  # a symlink inside an allowed folder pointing out of it
        via_link = tiny_config(data, str(link / "up" / "x"))
        assert ui.client.post("/api/jobs", json={"script": "train_lora", "config": via_link}).status_code == 403
        prompts = tmp_path / "p.txt"
        prompts.write_text("a\n")
        reads_outside = tiny_config(data, str(tmp_path / "outputs" / "a"), sample_prompts=str(prompts))
        r = ui.client.post("/api/jobs", json={"script": "train_lora", "config": reads_outside})
        assert r.status_code == 403 and r.json()["errors"][0]["option"] == "sample_prompts"
        assert ui.store.all() == []
        r = ui.client.post("/api/jobs", json={"script": "train_lora", "config": ok})
        assert r.status_code == 201
        ui.client.post(f"/api/jobs/{r.json()['id']}/stop")  # dropped from the queue before it runs
    finally:
        ui.close()


def test_token_bearer_and_login_cookie(tmp_path):
    ui = UI(tmp_path, token="s3cret")
    try:
        c = ui.client
        assert c.get("/api/jobs").status_code == 401
        assert c.get("/api/schema").status_code == 401
        assert c.get("/api/jobs", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/api/jobs", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert c.post("/api/login", json={"token": "wrong"}).status_code == 401
        r = c.post("/api/login", json={"token": "s3cret"})
        assert r.status_code == 200
        cookie = r.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie
        assert c.get("/api/jobs").status_code == 200  # the client now sends the cookie
        assert c.get("/").status_code == 200  # the page itself (it asks for the token)
    finally:
        ui.close()


def test_cross_origin_host_and_body_size_refusals(tmp_path):
    ui = UI(tmp_path, max_body=2000)
    try:
        c = ui.client
        body = {"script": "train_lora", "config": ""}
        assert c.post("/api/validate", json=body, headers={"Origin": "http://evil.example"}).status_code == 403
        assert c.post("/api/validate", json=body, headers={"Sec-Fetch-Site": "cross-site"}).status_code == 403
        assert c.post("/api/validate", json=body, headers={"Origin": "http://testserver"}).status_code == 200
        assert c.delete("/api/jobs/1", headers={"Origin": "http://evil.example"}).status_code == 403
        assert c.get("/api/jobs", headers={"Host": "evil.example"}).status_code == 403  # DNS rebinding
        big = {"script": "train_lora", "config": "# " + "x" * 3000}
        r = c.post("/api/validate", json=big)
        assert r.status_code == 413 and "2000 bytes" in r.json()["error"]
    finally:
        ui.close()


def _fake_job(ui, out_dir: str, processes: int = 1) -> int:
    os.makedirs(out_dir, exist_ok=True)
    return ui.store.add("train_lora", "# snapshot\n", processes, out_dir, "last")


def test_files_only_from_the_jobs_output_folder(ui, tmp_path):
    out = tmp_path / "out"
    jid = _fake_job(ui, str(out))
    (out / "sample").mkdir()
    (out / "last.safetensors").write_bytes(b"weights")
    (out / "sample" / "s.png").write_bytes(b"png")
    secret = tmp_path / "secret.txt"
    secret.write_text("secret")
    os.symlink(secret, out / "link.txt")
    os.symlink(tmp_path, out / "dirlink")
    c = ui.client
    assert c.get(f"/api/jobs/{jid}/files/last.safetensors").content == b"weights"
    assert c.get(f"/api/jobs/{jid}/files/sample/s.png").content == b"png"
    for name in ("..%2Fsecret.txt", "%2E%2E/secret.txt", "sample/..%2F..%2Fsecret.txt",
                 "%2F" + str(secret).lstrip("/").replace("/", "%2F"), "link.txt", "dirlink/secret.txt"):
        r = c.get(f"/api/jobs/{jid}/files/{name}")
        assert r.status_code == 403 and b"secret" not in r.content.replace(b"secret.txt", b""), name
    assert c.get(f"/api/jobs/{jid}/files/nothing.png").status_code == 404
    assert c.get("/api/jobs/999/files/last.safetensors").status_code == 404


def test_state_refusals_delete_and_move(ui, tmp_path):
    c = ui.client
    a, b, d = (_fake_job(ui, str(tmp_path / n)) for n in ("a", "b", "d"))
    two = _fake_job(ui, str(tmp_path / "two"), processes=2)
    assert [j["queue_index"] for j in c.get("/api/jobs").json()["jobs"]] == [0, 1, 2, 3]
    assert c.post(f"/api/jobs/{d}/move", json={"index": 0}).status_code == 200
    assert [j["id"] for j in ui.store.queued()] == [d, a, b, two]
    r = c.post(f"/api/jobs/{two}/save_now")
    assert r.status_code == 409 and "needs a running job" in r.json()["error"]  # queued
    assert c.post(f"/api/jobs/{a}/sample_now").status_code == 409  # not running
    assert c.post(f"/api/jobs/{a}/resume").status_code == 409  # queued, not stopped
    ui.store.update(b, state="done", exit_code=0)
    assert c.post(f"/api/jobs/{b}/stop").status_code == 409
    assert c.post(f"/api/jobs/{b}/move", json={"index": 0}).status_code == 409
    ui.store.update(a, state="running")
    r = c.delete(f"/api/jobs/{a}")
    assert r.status_code == 409 and "stop it first" in r.json()["error"]
    assert c.delete(f"/api/jobs/{b}").status_code == 200  # a finished job leaves the list
    assert c.delete(f"/api/jobs/{d}").status_code == 200  # a queued job is dropped
    assert c.get(f"/api/jobs/{b}").status_code == 404
    assert sorted(j["id"] for j in c.get("/api/jobs").json()["jobs"]) == [a, two]
    assert os.path.isdir(tmp_path / "b")  # files stay


def test_a_held_queue_starts_no_job_until_released(ui, tmp_path):
    c = ui.client
    ui.runner.python = shutil.which("true")  # a job that ends at once, done
    assert c.get("/api/queue").json() == {"held": False, "queued": []}
    assert c.post("/api/queue", json={"held": True}).json() == {"held": True, "queued": []}
    a, b = (_fake_job(ui, str(tmp_path / n)) for n in ("a", "b"))
    for _ in range(3):
        ui.runner.tick()
    assert c.get("/api/queue").json() == {"held": True, "queued": [a, b]}
    assert not ui.runner.procs
    for bad in ({}, {"held": "no"}, {"held": 0}):
        r = c.post("/api/queue", json=bad)
        assert r.status_code == 400 and "held" in r.json()["error"], bad
    assert c.post("/api/queue", json={"held": False}).json() == {"held": False, "queued": [b]}
    assert c.get(f"/api/jobs/{a}").json()["state"] == "running"  # started by the release itself
    ui.wait(b, lambda j: j["state"] == "done")
    assert c.get(f"/api/jobs/{a}").json()["state"] == "done"


def test_restart_keeps_the_queue_and_marks_a_running_job_interrupted(tmp_path):
    ui = UI(tmp_path)
    from library.ui.jobs import job_dir

    queued = _fake_job(ui, str(tmp_path / "q"))
    running = _fake_job(ui, str(tmp_path / "r"))
    folder = job_dir(ui.data_dir, running)
    os.makedirs(folder)
    # the job's process outlives the server: its command line names the job's folder
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", folder],
                              start_new_session=True)
    ui.store.update(running, state="running", pid=orphan.pid)
    ui.store.close()  # the server dies (no runner.close: nothing is stopped cleanly)
    again = UI(tmp_path)  # a new server on the same database
    try:
        jobs = {j["id"]: j for j in again.client.get("/api/jobs").json()["jobs"]}
        assert jobs[running]["state"] == "interrupted" and jobs[queued]["state"] == "queued"
        assert "server stopped" in jobs[running]["error"]
        assert orphan.wait(timeout=10) == -signal.SIGTERM  # told to write a state and exit
        again.runner.resume(running)  # (the route also starts the queue: tested with real jobs)
        assert [j["id"] for j in again.store.queued()] == [queued, running]
    finally:
        again.store.update(queued, state="stopped")
        again.store.update(running, state="stopped")
        again.close()


def test_queue_save_now_stop_resume_matches_an_uninterrupted_run(gated_ui, data, tmp_path):
    """Two real jobs: the second waits for the first; it is saved and stopped mid-run, resumed,
    and ends with the same weights as the first (uninterrupted) run, bit for bit (one thread).
    The second job waits for the test at two steps (tests/step_gate.py), so the commands land at
    known steps however loaded the machine is: save_now, asked while it waits in step 2, is read at
    step 3's start and saves after step 3; the stop signal, which releases it in step 4, stops it
    after step 4."""
    ui, c, steps = gated_ui, gated_ui.client, 12
    assert c.post("/api/queue", json={"held": True}).json()["held"] is True
    ref = c.post("/api/jobs", json={"script": "train_lora", "config": tiny_config(
        data, str(tmp_path / "ref"), steps=steps)}).json()["id"]
    job = c.post("/api/jobs", json={"script": "train_lora", "config": tiny_config(
        data, str(tmp_path / "job"), steps=steps)}).json()["id"]
    asked = tmp_path / "save_now_asked"
    ui.hold(job, (2, "file", str(asked)), (4, "signal"))
    assert c.post("/api/queue", json={"held": False}).json() == {"held": False, "queued": [job]}
    ui.wait(ref, lambda j: j["state"] == "running")
    assert c.get(f"/api/jobs/{job}").json()["state"] == "queued"
    seen_queued = ui.wait(ref, lambda j: j["state"] not in ("queued", "running"))
    assert seen_queued["state"] == "done" and seen_queued["step"] == steps, seen_queued
    assert seen_queued["outputs"] == ["last.safetensors"] and seen_queued["exit_code"] == 0
    ui.wait(job, lambda j: j["state"] == "running" and j["step"] >= 1)
    r = c.post(f"/api/jobs/{job}/save_now")
    assert r.status_code == 200
    asked.write_text("")
    j = ui.wait(job, lambda j: any("-step" in o for o in j["outputs"]))
    assert j["outputs"] == ["last-step00000003.safetensors"], j
    r = c.post(f"/api/jobs/{job}/stop")
    assert r.status_code == 200 and r.json()["state"] == "stopping"
    j = ui.wait(job, lambda j: j["state"] not in ("running", "stopping"))
    assert j["state"] == "stopped" and j["exit_code"] == 130, (j, c.get(f"/api/jobs/{job}/log").text)
    assert j["step"] == 4
    assert os.path.isdir(tmp_path / "job" / "last-step00000004-state")
    ui.hold(job)  # the resumed run goes straight on
    assert c.post(f"/api/jobs/{job}/resume").json()["state"] in ("queued", "running")
    j = ui.wait(job, lambda j: j["state"] in ("done", "failed"))
    assert j["state"] == "done" and j["step"] == steps, c.get(f"/api/jobs/{job}/log").text
    assert "resum" in c.get(f"/api/jobs/{job}/log", params={"lines": 1000}).text.lower()
    a, b = read(str(tmp_path / "ref" / "last.safetensors"))[0], read(str(tmp_path / "job" / "last.safetensors"))[0]
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    # the events: every step of both attempts, the stop's state, two plans, and the end
    with c.stream("GET", f"/api/jobs/{job}/events") as s:
        text = "".join(s.iter_text())
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {\"event")]
    kinds = [e["event"] for e in events]
    assert kinds.count("plan") == 2 and kinds[-1] == "end" and events[-1]["status"] == "done"
    assert [e["step"] for e in events if e["event"] == "step"] == list(range(1, steps + 1))
    assert 'event: state\ndata: {"state": "done"}' in text


FAKE_INTERPRETER = """#!{python}
# stands in for the Python interpreter a job is started with: records its devices and argument
# list, then waits until the test releases it (exit code in the release file)
import json, os, sys, time
args = sys.argv[1:]
folder = os.path.dirname(args[args.index("--config") + 1])
with open(os.path.join(folder, "seen.tmp"), "w") as f:
    json.dump({{"devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "args": args}}, f)
os.replace(os.path.join(folder, "seen.tmp"), os.path.join(folder, "seen.json"))  # whole when seen
release = os.path.join(folder, "release")
while not os.path.exists(release):
    time.sleep(0.02)
code, _, end = open(release).read().partition(",")
if end:  # the run's own last line, e.g. done, before the launcher's exit code
    with open(args[args.index("--progress_file") + 1], "a") as f:
        f.write(json.dumps({{"event": "end", "status": end, "exit_code": 0}}) + "\\n")
sys.exit(int(code or 0))
"""


def test_one_job_per_device_set_first_come_first_served_and_failures_do_not_stop_the_queue(tmp_path):
    from library.ui.jobs import JobStore, Runner, job_dir

    fake = tmp_path / "python"
    fake.write_text(FAKE_INTERPRETER.format(python=sys.executable))
    fake.chmod(0o755)
    store = JobStore(str(tmp_path / "db.sqlite3"))
    runner = Runner(store, str(tmp_path / "files"), ["0", "1"], python=str(fake))
    a, b, c, d = (store.add("train_lora", "# x\n", n, str(tmp_path / f"o{i}"), "last")
                  for i, n in enumerate((1, 2, 1, 1)))

    def seen(jid):
        path = os.path.join(job_dir(runner.data_dir, jid), "seen.json")
        t0 = time.time()
        while not os.path.exists(path):
            assert time.time() - t0 < 30
            time.sleep(0.02)
        with open(path) as f:
            return json.load(f)

    def release(jid, code=0):
        with open(os.path.join(job_dir(runner.data_dir, jid), "release"), "w") as f:
            f.write(str(code))
        t0 = time.time()
        while runner.procs.get(jid) is not None and runner.procs[jid][0].poll() is None:
            assert time.time() - t0 < 30
            time.sleep(0.02)

    def states():
        runner.tick()
        return [store.get(j)["state"] for j in (a, b, c, d)]

    try:
        assert states() == ["running", "queued", "queued", "queued"]
        assert seen(a)["devices"] == "0"
        # b needs both devices: it waits, and c (which would fit on device 1) waits behind it
        assert states() == ["running", "queued", "queued", "queued"]
        release(a)
        assert states() == ["done", "running", "queued", "queued"]
        s = seen(b)
        assert s["devices"] == "0,1"
        launch = s["args"]  # python -m accelerate.commands.launch ... train_lora.py --config ...
        assert launch[:2] == ["-m", "accelerate.commands.launch"] and "--multi_gpu" in launch
        assert launch[launch.index("--num_processes") + 1] == "2"
        assert launch[launch.index("--config") - 1].endswith("train_lora.py")
        release(b)
        assert states() == ["done", "done", "running", "queued"]
        assert seen(c)["args"][0].endswith("train_lora.py")  # one process: the script itself
        release(c, 3)  # a failed job: the next one starts
        assert states() == ["done", "done", "failed", "running"]
        assert store.get(c)["exit_code"] == 3
        release(d, "130,done")  # the run ended, then its launcher got a stop signal
        assert states() == ["done", "done", "failed", "done"]
    finally:
        for j in (a, b, c, d):
            os.makedirs(job_dir(runner.data_dir, j), exist_ok=True)
            open(os.path.join(job_dir(runner.data_dir, j), "release"), "w").close()
        runner.close()
        store.close()


def test_a_job_is_a_snapshot_of_its_config_and_dataset_config(ui, data, tmp_path):
    ds = tmp_path / "dataset.toml"
    ds.write_text(f'[general]\nresolution = 64\n[[datasets]]\n[[datasets.subsets]]\nimage_dir = "{data}/2_sks shape"\n'
                  "num_repeats = 3\n")
    text = (f'pretrained_model_name_or_path = "tiny-sd15"\noutput_dir = "{tmp_path}/o"\n'
            f'max_train_steps = 3\n[data]\ndataset_config = "{ds}"\n')
    ui.client.post("/api/queue", json={"held": True})  # not needed to run: the snapshot is what it runs
    jid = ui.client.post("/api/jobs", json={"script": "train_lora", "config": text}).json()["id"]
    ds.write_text("[general]\nresolution = 128\n")  # edited after the job was queued
    assert ui.client.post(f"/api/jobs/{jid}/stop").json()["state"] == "stopped"  # still queued
    snap = ui.store.get(jid)["config"]
    path = tmp_path / "snap.toml"
    path.write_text(snap)
    opts = parse_args("train_lora", ["--config", str(path)])
    assert opts.dataset_config_path == str(path) and "dataset_config" not in snap
    sub = opts.dataset_config["datasets"][0]["subsets"][0]
    assert sub["num_repeats"] == 3 and opts.dataset_config["general"]["resolution"] == 64


@pytest.mark.slow
def test_a_two_process_job_stops_and_resumes(gated_ui, data, tmp_path):
    """accelerate launch of two CPU processes (gloo): save_now writes a model file, stop writes a
    state in every process's agreed step, resume runs to the end (about a minute: slow). Both
    processes wait in step 2 until save_now has been asked (taken after step 3) and in step 4 for
    the stop signal (stopped after step 4), as in the one-process test above."""
    ui, c = gated_ui, gated_ui.client
    c.post("/api/queue", json={"held": True})
    jid = c.post("/api/jobs", json={"script": "train_lora", "processes": 2, "config": tiny_config(
        data, str(tmp_path / "two"), steps=40)}).json()["id"]
    asked = tmp_path / "save_now_asked"
    ui.hold(jid, (2, "file", str(asked)), (4, "signal"))
    c.post("/api/queue", json={"held": False})
    ui.wait(jid, lambda j: j["state"] == "running" and j["step"] >= 1, timeout=300)
    assert c.post(f"/api/jobs/{jid}/save_now").status_code == 200
    asked.write_text("")
    j = ui.wait(jid, lambda j: any("-step" in f for f in j["outputs"]), timeout=300)
    assert j["outputs"] == ["last-step00000003.safetensors"], j
    assert c.post(f"/api/jobs/{jid}/stop").json()["state"] == "stopping"
    j = ui.wait(jid, lambda j: j["state"] not in ("running", "stopping"), timeout=300)
    assert j["state"] == "stopped" and "training state written" in j["error"], j
    assert j["step"] == 4 and os.path.isdir(tmp_path / "two" / "last-step00000004-state")
    ui.hold(jid)
    c.post(f"/api/jobs/{jid}/resume")
    j = ui.wait(jid, lambda j: j["state"] in ("done", "failed"), timeout=300)
    assert j["state"] == "done" and j["step"] == 40, c.get(f"/api/jobs/{jid}/log").text
    assert "processes: 2" in c.get(f"/api/jobs/{jid}/log", params={"lines": 2000}).text


def test_dataset_view_shows_caption_weights():
    """weighted_captions: the dataset page's captions carry each piece's weight, as the text
    encoder's output is scaled (A1111 syntax: (x:1.2), nesting multiplies by 1.1)."""
    from library.ui import checks

    c = checks._caption("a.png", "a (red:1.2) ((big)) circle", weighted=True)
    assert c["weights"] == [["a ", 1.0], ["red", 1.2], [" ", 1.0], ["big", pytest.approx(1.21)],
                            [" circle", 1.0]]
    assert "weights" not in checks._caption("a.png", "a (red:1.2)", weighted=False)


def test_secrets_stay_out_of_the_stored_job_and_reach_the_run(ui, data, tmp_path):
    """huggingface_token / wandb_api_key: not in the SQLite snapshot, the API's view or the job's
    config.toml; the run gets them in its environment (HF_TOKEN, which huggingface_hub's HfApi
    reads when given no token; WANDB_API_KEY, which wandb reads), from a 0600 file outside the
    served job folders that is removed once the job is done."""
    import stat

    from library.ui.jobs import job_dir

    token, key = "hf_SECRETtoken123", "wandbSECRETkey456"
    seen = tmp_path / "seen.json"
    fake = tmp_path / "python"  # the job's interpreter: records what the run would get
    fake.write_text(f"#!{sys.executable}\nimport json, os\nfrom huggingface_hub import get_token\n"
                    f"json.dump({{'hub': get_token(), 'wandb': os.environ.get('WANDB_API_KEY')}}, "
                    f"open({str(seen)!r}, 'w'))\n")
    fake.chmod(0o755)
    ui.runner.python = str(fake)
    ui.client.post("/api/queue", json={"held": True})
    text = tiny_config(data, str(tmp_path / "out")) + \
        f'[hub]\nhuggingface_repo_id = "me/run"\nhuggingface_token = "{token}"\nwandb_api_key = "{key}"\n'
    r = ui.client.post("/api/jobs", json={"script": "train_lora", "config": text})
    assert r.status_code == 201, r.text
    jid = r.json()["id"]
    snap = ui.store.get(jid)["config"]
    assert token not in snap and key not in snap and 'huggingface_repo_id = "me/run"' in snap
    assert token not in ui.client.get(f"/api/jobs/{jid}").text
    secret_file = os.path.join(ui.data_dir, "secrets", f"{jid}.json")
    assert stat.S_IMODE(os.stat(secret_file).st_mode) == 0o600
    assert not secret_file.startswith(job_dir(ui.data_dir, jid) + os.sep)  # not among the served files
    ui.client.post("/api/queue", json={"held": False})
    ui.wait(jid, lambda j: j["state"] == "done")
    assert json.loads(seen.read_text()) == {"hub": token, "wandb": key}
    assert not os.path.exists(secret_file)  # done: removed
    stored = [ui.db] + [os.path.join(d, n) for d, _, names in os.walk(ui.data_dir) for n in names]
    for path in stored:
        with open(path, "rb") as f:
            body = f.read()
        assert token.encode() not in body and key.encode() not in body, path
    with open(os.path.join(job_dir(ui.data_dir, jid), "config.toml"), encoding="utf-8") as f:
        assert "huggingface_token" not in f.read()
