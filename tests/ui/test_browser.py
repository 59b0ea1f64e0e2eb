"""The pages end to end in a real headless browser (chromium driven by Playwright): load the page,
type a misspelled option and see the error with its suggestion, start a run on the built-in tiny
model and watch the step counter reach the end and a sample image appear, stop a longer run and
see its state saved; open a folder on the Dataset page, edit a caption and find it saved on disk.

Skipped when Playwright or a chromium is missing, unless SDTK_BROWSER_TEST=required (.ci/run sets
it), which makes that a failure. SDTK_UI_SCREENSHOTS=<folder> writes the pages' screenshots
(docs/images/ holds the ones docs/UI.md shows).
"""
from __future__ import annotations

import os
import re
import shutil
import threading
import time

import pytest

from library.accelerator import free_port
from tests.ui.conftest import UI, tiny_config

REQUIRED = os.environ.get("SDTK_BROWSER_TEST") == "required"


def _browser() -> str | None:
    for p in (os.environ.get("SDTK_BROWSER"), "/usr/bin/chromium", shutil.which("chromium"),
              shutil.which("chromium-browser")):
        if p and os.path.exists(p):
            return p
    return None


def _need(what: str):
    if REQUIRED:
        pytest.fail(f"SDTK_BROWSER_TEST=required but {what}")
    pytest.skip(what)


@pytest.fixture
def server(tmp_path):
    try:
        import fastapi  # noqa: F401
        import httpx  # noqa: F401
        import uvicorn
        from playwright.sync_api import sync_playwright  # noqa: F401
    except ImportError as e:
        _need(f"{e.name} is not installed (the ui extra)")
    browser = _browser()
    if browser is None:
        _need("no chromium found (apt-get install chromium)")
    ui = UI(tmp_path, gated=True)
    port = free_port()
    ui.settings.allowed_hosts = ("127.0.0.1",)
    srv = uvicorn.Server(uvicorn.Config(ui.client.app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    ui.runner.poll_s = 0.2
    ui.runner.start()
    while not srv.started:
        time.sleep(0.05)
    yield ui, f"http://127.0.0.1:{port}/", browser
    srv.should_exit = True
    t.join(timeout=10)
    ui.close()


def open_page(p, browser: str, address: str):
    """(the headless chromium, a 1400x1000 page at ``address``)."""
    b = p.chromium.launch(executable_path=browser, args=["--no-sandbox"], headless=True)
    page = b.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(address)
    return b, page


def test_new_run_typo_start_watch_samples_and_stop(server, tmp_path):
    from playwright.sync_api import expect, sync_playwright
    from tools.make_sample_dataset import make_sample_dataset

    ui, url, browser = server
    # every expectation waits on a condition: a loaded machine (the first validation imports
    # torch) may take longer than Playwright's default 5 s to get there
    expect.set_options(timeout=60000)
    data = str(tmp_path / "data")
    make_sample_dataset(data, n_images=2, size=64, repeats=2)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle --w 64 --h 64 --s 2 --d 1\n")
    shots = os.environ.get("SDTK_UI_SCREENSHOTS")
    with sync_playwright() as p:
        b, page = open_page(p, browser, url + "#/new")
        expect(page.locator("#opt-pretrained_model_name_or_path")).to_be_visible()
        good = tiny_config(data, str(tmp_path / "out"), steps=3, sample_prompts=str(prompts),
                           sample_every_n_steps=3)
        page.fill("#toml", good)
        page.locator("#toml").press("End")
        page.locator("#toml").type("netwrk_dim = 8")  # typed: validation as you type
        expect(page.locator("#errors")).to_contain_text("unknown option 'netwrk_dim'; did you mean network_dim?")
        page.fill("#toml", good)
        page.locator("#toml").type("\n")
        expect(page.locator("#errors")).to_contain_text("config OK")
        expect(page.locator("#opt-network_dim")).to_have_value("4")  # the form follows the TOML
        expect(page.locator("#plans")).to_contain_text("total steps")
        expect(page.locator("#memory")).to_contain_text("GiB per process", timeout=30000)
        if shots:
            page.screenshot(path=os.path.join(shots, "new_run.png"), full_page=False)
        page.click("#start")
        page.wait_for_url("**#/run/*")
        expect(page.locator("#run-state")).to_have_text("done", timeout=120000)
        expect(page.locator("#run-step")).to_have_text("3")
        expect(page.locator("#run-total")).to_have_text("3")
        img = page.locator("#samples img").first
        expect(img).to_be_visible()
        page.wait_for_function("document.querySelector('#samples img').naturalWidth === 64")
        if shots:
            page.screenshot(path=os.path.join(shots, "run.png"), full_page=True)
            page.goto(url + "#/dataset")
            expect(page.locator("#captions")).to_contain_text("sks shape, a red circle")
            page.screenshot(path=os.path.join(shots, "dataset.png"))
        # a longer run, stopped from its page: its state is written, and it can be resumed (it
        # waits in its 2nd step for the stop signal, so the stop lands mid-run however slow the
        # machine: tests/step_gate.py)
        ui.hold(2, (2, "signal"))
        page.goto(url + "#/new")
        page.fill("#toml", tiny_config(data, str(tmp_path / "long"), steps=500))
        page.locator("#toml").type("\n")
        expect(page.locator("#errors")).to_contain_text("config OK")
        page.click("#start")
        page.wait_for_url("**#/run/2")
        expect(page.locator("#run-id")).to_have_text("#2")
        page.wait_for_function("document.querySelector('#run-state').textContent === 'running' && "
                               "Number(document.querySelector('#run-step').textContent) >= 1",
                               timeout=120000)
        page.click("#btn-stop")
        expect(page.locator("#run-state")).to_have_text("stopped", timeout=60000)
        expect(page.locator("#run-error")).to_contain_text("training state written to")
        expect(page.locator("#btn-resume")).to_be_enabled()
        states = [d for d in os.listdir(tmp_path / "long") if d.endswith("-state")]
        assert states == ["last-step00000002-state"], os.listdir(tmp_path / "long")
        page.goto(url + "#/queue")
        expect(page.locator("#jobs tr[data-id]")).to_have_count(2)
        expect(page.locator("#jobs")).to_contain_text("stopped")
        if shots:
            page.screenshot(path=os.path.join(shots, "queue.png"))
        b.close()


def test_dataset_workbench_opens_a_folder_and_saves_a_caption(server, tmp_path):
    from PIL import Image
    from playwright.sync_api import expect, sync_playwright

    ui, url, browser = server
    folder = tmp_path / "img" / "3_sks cat"
    folder.mkdir(parents=True)
    for name, color in (("a.png", (200, 40, 40)), ("b.png", (40, 40, 200))):
        Image.new("RGB", (96, 64), color).save(folder / name)
    (folder / "a.caption").write_text("sks cat, red", encoding="utf-8")
    (folder / "c.png").write_bytes(b"\x89PNG\r\n\x1a\nbroken")
    shots = os.environ.get("SDTK_UI_SCREENSHOTS")
    with sync_playwright() as p:
        b, page = open_page(p, browser, url + "#/dataset")
        expect(page.locator("#ds-empty")).to_be_visible()
        # the picker: from the folder typed, into its concept folder, chosen
        page.fill("#ds-folder", str(tmp_path / "img"))
        page.click("#ds-browse")
        page.click('#picker-list li:has-text("[dir] 3_sks cat")', timeout=120000)
        expect(page.locator("#picker-list")).to_contain_text("a.caption")
        page.click("#picker-choose")
        expect(page.locator("#ds-folder")).to_have_value(str(folder))
        # (the first answer may wait for the server's first import of the trainer's checks)
        expect(page.locator("#ds-grid .tile")).to_have_count(3, timeout=120000)
        # the tile names the file once (its label) and the box says why, without the path
        expect(page.locator('.tile[data-name="c.png"] .broken')).to_have_text(
            "cannot decode it (cannot identify image file)")
        page.wait_for_function("document.querySelector('.tile[data-name=\"a.png\"] img').naturalWidth === 96")
        expect(page.locator("#ds-tags")).to_contain_text("sks cat")
        expect(page.locator("#ds-trained")).to_contain_text("sks cat, red", timeout=120000)
        box = page.locator('.tile[data-name="b.png"] textarea')
        box.fill("sks cat, blue")
        box.press("Control+Enter")
        expect(page.locator('.tile[data-name="b.png"] .status')).to_have_text("saved")
        assert (folder / "b.caption").read_text(encoding="utf-8") == "sks cat, blue"
        # uploads: an image is added to the grid, a file that is not an image is refused in one line
        (tmp_path / "d.png").write_bytes((folder / "a.png").read_bytes())
        (tmp_path / "notes.txt").write_text("x")
        page.set_input_files("#ds-files", [str(tmp_path / "d.png"), str(tmp_path / "notes.txt")])
        expect(page.locator("#ds-grid .tile")).to_have_count(4)
        expect(page.locator("#ds-msg")).to_contain_text("notes.txt: not an image type the trainer reads")
        assert (folder / "d.png").read_bytes() == (folder / "a.png").read_bytes()
        if shots:
            page.screenshot(path=os.path.join(shots, "dataset.png"))
        b.close()


def test_compare_panel_and_generate_page(server, tmp_path):
    """A finished tiny run's page queues its checkpoint grid (2 saved files x 2 multipliers) and
    shows the grid image with its labels and the single images; the Generate page renders one
    image with its A1111 text."""
    from playwright.sync_api import expect, sync_playwright
    from tools.make_sample_dataset import make_sample_dataset

    ui, url, browser = server
    expect.set_options(timeout=60000)
    data = str(tmp_path / "data")
    make_sample_dataset(data, n_images=2, size=64, repeats=1)
    out = tmp_path / "out"
    import httpx

    r = httpx.post(url + "api/jobs", json={"script": "train_lora", "config": tiny_config(
        data, str(out), steps=2, save_every_n_steps=1, output_name="sks")}, timeout=120)
    assert r.status_code == 201, r.text
    run = r.json()["id"]
    shots = os.environ.get("SDTK_UI_SCREENSHOTS")
    with sync_playwright() as p:
        b, page = open_page(p, browser, url + f"#/run/{run}")
        expect(page.locator("#run-state")).to_have_text("done", timeout=180000)
        expect(page.locator("#compare")).to_be_visible()
        page.fill("#cmp-prompts", "a red circle")
        page.fill("#cmp-muls", "0 1")
        for k, v in (("steps", "2"), ("width", "64"), ("height", "64")):
            page.fill(f"#cmp-{k}", v)
        page.click("#cmp-queue")
        expect(page.locator("#cmp-state")).to_contain_text("done", timeout=240000)
        page.wait_for_function("document.querySelector('#cmp-grid-img') && "
                               "document.querySelector('#cmp-grid-img').naturalWidth > 128")
        cells = page.locator("#cmp-cells")
        expect(cells.locator("tr")).to_have_count(3)  # the header and one row per saved file
        # row labels: the file and its ss_epoch / ss_steps (a step save records the epoch it ran in,
        # counted from 0 as sd-scripts does)
        expect(cells.locator("tr").nth(1).locator("td").first).to_have_text(re.compile(r"^sks-step00000001, epoch \d+, step 1$"))
        expect(cells.locator("tr").nth(2).locator("td").first).to_have_text(re.compile(r"^sks, epoch \d+, step 2$"))
        expect(cells.locator("th").nth(1)).to_have_text("prompt 1, x0")
        expect(cells.locator("th").nth(2)).to_have_text("prompt 1, x1")
        expect(cells.locator("img.cell")).to_have_count(4)
        page.wait_for_function("[...document.querySelectorAll('#cmp-cells img')].every(i => i.naturalWidth === 64)")
        grids = os.listdir(out / "compare")
        assert len(grids) == 1 and (out / "compare" / grids[0] / "grid.png").is_file()
        if shots:
            page.locator("#compare").screenshot(path=os.path.join(shots, "compare.png"))
        page.goto(url + "#/generate")
        page.fill("#gen-model", "tiny-sd15")
        page.fill("#gen-prompt", "a blue square")
        page.fill("#gen-negative", "blurry")
        for k, v in (("seed", "3"), ("steps", "2"), ("width", "64"), ("height", "64")):
            page.fill(f"#gen-{k}", v)
        page.click("#gen-start")
        expect(page.locator("#gen-state")).to_have_text("done", timeout=240000)
        expect(page.locator("#gen-images figure")).to_have_count(1)
        page.wait_for_function("document.querySelector('#gen-images img').naturalWidth === 64")
        text = page.locator("#gen-images pre.infotext")
        expect(text).to_contain_text("a blue square\nNegative prompt: blurry\nSteps: 2, Sampler: DDIM, CFG scale: 7.5, Seed: 3, Size: 64x64")
        if shots:
            page.screenshot(path=os.path.join(shots, "generate.png"))
        b.close()
