"""Upload to the Hugging Face Hub and resume from it (library/outputs/hub.py), offline.

``FakeHub`` stands in for huggingface_hub's ``HfApi`` (passed to the run as ``hub_api``): each call
is checked against HfApi's own signature (a keyword HfApi does not take fails here as it would
there), recorded with what the output folder held at that moment, and carried out on folders
(one per repository), so that a state uploaded by one run can be downloaded and resumed by the
next. References: the bytes of the local files, the weights of an uninterrupted run (one thread,
bit for bit), sd-scripts' resume form and its visibility rule, written out by hand.
"""
from __future__ import annotations

import fnmatch
import inspect
import logging
import os
import shutil
import threading
import time

import pytest

from tests.conftest import read, reset_accelerate

from library.config.parse import parse_args
from library.errors import ResumeError
from library.outputs import hub

TOKEN = "hf_SECRETtoken123"
LORA = ["--pretrained_model_name_or_path", "tiny-sd15", "--resolution", "64", "--cache_latents",
        "--network_dim", "4", "--network_alpha", "2", "--learning_rate", "1e-3",
        "--optimizer_type", "AdamW", "--seed", "3"]


class FakeHub:
    """Repositories are folders under ``root``; ``fail``: paths in the repository whose upload
    raises; ``before_upload(path_in_repo)``: called first in each upload (a test's hold)."""

    def __init__(self, root: str, existing=(), fail=(), before_upload=None, watch: str | None = None):
        self.root, self.repos, self.fail = root, set(existing), set(fail)
        self.before_upload, self.watch = before_upload, watch
        self.calls: list[tuple] = []
        self.lock = threading.Lock()

    def _record(self, name: str, *args, **kwargs) -> None:
        from huggingface_hub import HfApi

        inspect.signature(getattr(HfApi, name)).bind(None, *args, **kwargs)  # HfApi takes it
        seen = sorted(os.listdir(self.watch)) if self.watch and os.path.isdir(self.watch) else None
        with self.lock:
            self.calls.append((name, args, kwargs, seen))

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]

    def uploads(self) -> list[tuple[str, str]]:
        return [(c[0], c[2]["path_in_repo"]) for c in self.calls if c[0].startswith("upload_")]

    def repo_exists(self, repo_id, *, repo_type=None, token=None):
        self._record("repo_exists", repo_id, repo_type=repo_type)
        return repo_id in self.repos

    def create_repo(self, repo_id, *, private=None, repo_type=None, exist_ok=False, token=None):
        self._record("create_repo", repo_id, private=private, repo_type=repo_type, exist_ok=exist_ok)
        self.repos.add(repo_id)

    def _target(self, repo_id: str, path_in_repo: str) -> str:
        return os.path.join(self.root, repo_id, path_in_repo)

    def upload_file(self, *, path_or_fileobj, path_in_repo, repo_id, repo_type=None):
        self._record("upload_file", path_or_fileobj=path_or_fileobj, path_in_repo=path_in_repo,
                     repo_id=repo_id, repo_type=repo_type)
        if self.before_upload is not None:
            self.before_upload(path_in_repo)
        if path_in_repo in self.fail:
            raise RuntimeError("500 Server Error: Internal Server Error for url\nmore detail")
        target = self._target(repo_id, path_in_repo)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(path_or_fileobj, target)

    def upload_folder(self, *, repo_id, folder_path, path_in_repo=None, repo_type=None):
        self._record("upload_folder", repo_id=repo_id, folder_path=folder_path,
                     path_in_repo=path_in_repo, repo_type=repo_type)
        shutil.copytree(folder_path, self._target(repo_id, path_in_repo or ""), dirs_exist_ok=True)

    def snapshot_download(self, repo_id, *, repo_type=None, revision=None, allow_patterns=None):
        self._record("snapshot_download", repo_id, repo_type=repo_type, revision=revision,
                     allow_patterns=allow_patterns)
        src = os.path.join(self.root, repo_id)
        if not os.path.isdir(src):
            raise RuntimeError(f"404 Client Error. Repository Not Found for url: {repo_id}")
        out = os.path.join(self.root, "download", repo_id)
        for folder, _, files in os.walk(src):
            for name in files:
                rel = os.path.relpath(os.path.join(folder, name), src)
                if any(fnmatch.fnmatch(rel, p) for p in allow_patterns or ["*"]):
                    os.makedirs(os.path.dirname(os.path.join(out, rel)), exist_ok=True)
                    shutil.copyfile(os.path.join(folder, name), os.path.join(out, rel))
        return out


def _file(tmp_path, name="a.safetensors", data=b"weights") -> str:
    p = tmp_path / name
    p.write_bytes(data)
    return str(p)


def _opts(tmp_path, *extra) -> object:
    return parse_args("train_lora", [*LORA, "--train_data_dir", str(tmp_path), "--output_dir",
                                     str(tmp_path / "out"), "--max_train_steps", "1", *extra])


# -- the uploader -------------------------------------------------------------------------------
def test_upload_creates_a_private_repository_once_and_puts_files_under_the_path(tmp_path):
    fake = FakeHub(str(tmp_path / "hub"))
    up = hub.uploader_for(_opts(tmp_path, "--huggingface_repo_id", "me/lora",
                                "--huggingface_path_in_repo", "/runs/a/"), api=fake)
    state = tmp_path / "last-state"
    state.mkdir()
    (state / "state.json").write_text("{}")
    up.upload(_file(tmp_path))
    up.upload(str(state))
    assert fake.names() == ["repo_exists", "create_repo", "upload_file", "upload_folder"]
    assert fake.calls[1][2] == {"private": True, "repo_type": None, "exist_ok": True}
    assert fake.uploads() == [("upload_file", "runs/a/a.safetensors"),
                              ("upload_folder", "runs/a/last-state")]
    assert (tmp_path / "hub" / "me/lora/runs/a/a.safetensors").read_bytes() == b"weights"
    assert (tmp_path / "hub" / "me/lora/runs/a/last-state/state.json").read_text() == "{}"


@pytest.mark.parametrize("visibility, private", [(None, True), ("private", True), ("public", False)])
def test_visibility_and_repo_type_as_sd_scripts(tmp_path, visibility, private):
    fake = FakeHub(str(tmp_path / "hub"))
    extra = ["--huggingface_repo_visibility", visibility] if visibility else []
    up = hub.uploader_for(_opts(tmp_path, "--huggingface_repo_id", "me/data", *extra,
                                "--huggingface_repo_type", "dataset"), api=fake)
    up.upload(_file(tmp_path))
    assert fake.calls[1][2]["private"] is private and fake.calls[1][2]["repo_type"] == "dataset"
    # no path in the repository: the file at its root, under its own name (sd-scripts passes None)
    assert fake.calls[2][2]["path_in_repo"] == "a.safetensors"
    assert fake.calls[2][2]["repo_type"] == "dataset"


def test_an_existing_repository_is_not_created(tmp_path):
    fake = FakeHub(str(tmp_path / "hub"), existing={"me/lora"})
    up = hub.uploader_for(_opts(tmp_path, "--huggingface_repo_id", "me/lora"), api=fake)
    up.upload(_file(tmp_path))
    up.upload(_file(tmp_path, "b.safetensors"))
    assert fake.names() == ["repo_exists", "upload_file", "upload_file"]


def test_a_failed_upload_is_one_warning_and_keeps_the_file(tmp_path, caplog):
    fake = FakeHub(str(tmp_path / "hub"), fail={"a.safetensors"})
    up = hub.uploader_for(_opts(tmp_path, "--huggingface_repo_id", "me/lora"), api=fake)
    path = _file(tmp_path)
    with caplog.at_level(logging.INFO, logger="sdtk"):
        up.upload(path)
        up.upload(_file(tmp_path, "b.safetensors"))  # the next one is still tried
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert warnings[0].startswith(f"upload of {path} to me/lora/a.safetensors failed (RuntimeError: 500")
    assert warnings[0].endswith("the local file is kept")
    assert open(path, "rb").read() == b"weights"
    assert os.path.exists(tmp_path / "hub" / "me/lora/b.safetensors")


def test_a_failed_repository_creation_is_one_warning(tmp_path, caplog):
    class NoCreate(FakeHub):
        def create_repo(self, *a, **k):
            raise PermissionError("403 Forbidden: token has no write access")

    fake = NoCreate(str(tmp_path / "hub"), fail={"a.safetensors"})
    up = hub.uploader_for(_opts(tmp_path, "--huggingface_repo_id", "me/lora"), api=fake)
    with caplog.at_level(logging.WARNING, logger="sdtk"):
        up.upload(_file(tmp_path))
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs[0] == ("huggingface_repo_id me/lora: cannot create the repository: "
                       "PermissionError: 403 Forbidden: token has no write access")
    assert len(msgs) == 2 and "failed" in msgs[1]


def test_async_uploads_run_in_order_beside_the_caller_and_close_waits(tmp_path):
    release = threading.Event()
    fake = FakeHub(str(tmp_path / "hub"), before_upload=lambda p: release.wait(30))
    up = hub.uploader_for(_opts(tmp_path, "--huggingface_repo_id", "me/lora", "--async_upload"),
                          api=fake)
    a, b = _file(tmp_path), _file(tmp_path, "b.safetensors")
    t0 = time.monotonic()
    up.upload(a)
    up.upload(b)
    assert time.monotonic() - t0 < 5  # returned while the first upload waits
    settled = threading.Event()
    threading.Thread(target=lambda: (up.settled(a), settled.set()), daemon=True).start()
    assert not settled.wait(0.3)  # the rotation would wait for it
    release.set()
    assert settled.wait(30)
    up.close()
    assert fake.uploads() == [("upload_file", "a.safetensors"), ("upload_file", "b.safetensors")]
    assert os.path.exists(tmp_path / "hub" / "me/lora/b.safetensors")
    up.settled(a)  # nothing in flight: returns at once


def test_the_default_client_is_huggingface_hubs_with_the_token(tmp_path):
    from huggingface_hub import HfApi

    up = hub.uploader_for(_opts(tmp_path, "--huggingface_repo_id", "me/lora",
                                "--huggingface_token", TOKEN))
    assert isinstance(up.api, HfApi) and up.api.token == TOKEN
    assert hub.uploader_for(_opts(tmp_path)) is None  # no repository: nothing uploads


# -- sd-scripts' resume form ----------------------------------------------------------------------
@pytest.mark.parametrize("resume, expected", [
    ("me/lora/runs/a/last-state", ("me/lora", "runs/a/last-state", None, None)),
    ("me/lora/last-state:v2", ("me/lora", "last-state", "v2", None)),
    ("me/data/s/last-state:main:dataset", ("me/data", "s/last-state", "main", "dataset")),
    ("me/lora/last-state/:refs/pr/1", ("me/lora", "last-state", "refs/pr/1", None)),
])
def test_resume_form(resume, expected):
    assert hub.parse_resume(resume) == expected


@pytest.mark.parametrize("resume", ["latest", "me/lora", "me/lora/", "/lora/x", "me/lora/x:a:b:c"])
def test_resume_form_refusals(resume):
    with pytest.raises(ResumeError, match="resume"):
        hub.parse_resume(resume)


def test_download_of_a_missing_state_is_one_line(tmp_path):
    fake = FakeHub(str(tmp_path / "hub"))
    with pytest.raises(ResumeError) as e:
        hub.download_state("me/lora/last-state:main", None, api=fake)
    assert str(e.value) == ("resume me/lora/last-state:main: cannot download me/lora/last-state at "
                            "main from the Hugging Face Hub: RuntimeError: 404 Client Error. "
                            "Repository Not Found for url: me/lora")
    (tmp_path / "hub" / "me/lora/other").mkdir(parents=True)
    (tmp_path / "hub" / "me/lora/other/f").write_text("x")
    with pytest.raises(ResumeError, match="no files under me/lora/last-state"):
        hub.download_state("me/lora/last-state", None, api=fake)


# -- the options ----------------------------------------------------------------------------------
def test_option_combinations(tmp_path, caplog):
    from library.config.parse import ConfigError

    with pytest.raises(ConfigError, match="--save_state_to_huggingface: uploading states needs huggingface_repo_id"):
        _opts(tmp_path, "--save_state", "--save_state_to_huggingface")
    with pytest.raises(ConfigError, match="--huggingface_repo_id: 'lora' is not a repository id"):
        _opts(tmp_path, "--huggingface_repo_id", "lora")
    with caplog.at_level(logging.WARNING, logger="sdtk"):
        _opts(tmp_path, "--async_upload", "--huggingface_path_in_repo", "x")
        _opts(tmp_path, "--huggingface_repo_id", "me/l", "--save_state_to_huggingface")
        _opts(tmp_path, "--resume_from_huggingface")
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == [  # (flags: named as given; a config file's key: with its file and line)
        "--huggingface_path_in_repo has no effect: nothing is uploaded without huggingface_repo_id",
        "--async_upload has no effect: nothing is uploaded without huggingface_repo_id",
        "--save_state_to_huggingface has no effect: no training state is saved (set save_state or "
        "save_state_on_train_end)",
        "--resume_from_huggingface has no effect without resume (<owner>/<repo>/<path in repo>"
        "[:<revision>[:<repo type>]])"]


# -- runs -----------------------------------------------------------------------------------------
@pytest.fixture
def data(tmp_path):
    from tools.make_sample_dataset import make_sample_dataset

    make_sample_dataset(str(tmp_path / "data"), n_images=2, size=64, repeats=2)
    return str(tmp_path / "data")


def _train(args: list, api) -> None:
    from library.run import trainer

    reset_accelerate()
    try:
        trainer.run(parse_args("train_lora", [*LORA, *args]), "lora", hub_api=api)
    finally:
        reset_accelerate()


def _all_bytes(folder: str) -> bytes:
    out = b""
    for d, _, files in os.walk(folder):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                out += fh.read()
    return out


def test_a_run_uploads_each_save_and_state_after_it_and_resumes_from_the_hub(tmp_path, data):
    """Steps 2 and 4 (4 steps, a save every 2 with its state): each file is uploaded right after
    its save, to <path_in_repo>/<name>, with the bytes on disk; the token is nowhere in them. A run
    resumed from the uploaded step-2 state ends with the uninterrupted run's weights."""
    out, out2 = str(tmp_path / "out"), str(tmp_path / "resumed")
    fake = FakeHub(str(tmp_path / "hub"), watch=out)
    hub_args = ["--huggingface_repo_id", "me/lora", "--huggingface_path_in_repo", "runs/a",
                "--huggingface_token", TOKEN]
    _train(["--train_data_dir", data, "--output_dir", out, "--max_train_steps", "4",
            "--save_every_n_steps", "2", "--save_state", "--save_state_to_huggingface",
            *hub_args], fake)
    assert fake.uploads() == [("upload_file", "runs/a/last-step00000002.safetensors"),
                              ("upload_folder", "runs/a/last-step00000002-state"),
                              ("upload_file", "runs/a/last.safetensors"),
                              ("upload_folder", "runs/a/last-state")]
    first_upload = next(c for c in fake.calls if c[0] == "upload_file")
    assert "last.safetensors" not in first_upload[3]  # uploaded when saved, not at the end
    assert "last-step00000002-state" not in first_upload[3]  # the model first, then its state
    repo = tmp_path / "hub" / "me/lora/runs/a"
    for name in ("last-step00000002.safetensors", "last.safetensors"):
        assert (repo / name).read_bytes() == open(os.path.join(out, name), "rb").read()
    assert _all_bytes(str(repo / "last-state")) == _all_bytes(os.path.join(out, "last-state"))
    everything = _all_bytes(out) + _all_bytes(str(tmp_path / "hub"))
    assert TOKEN.encode() not in everything and b"huggingface_token" not in everything

    resumed = FakeHub(str(tmp_path / "hub"), existing={"me/lora"})
    _train(["--train_data_dir", data, "--output_dir", out2, "--max_train_steps", "4",
            "--resume", "me/lora/runs/a/last-step00000002-state:main", "--resume_from_huggingface",
            "--huggingface_repo_id", "me/lora", "--huggingface_path_in_repo", "runs/b"], resumed)
    download = resumed.calls[0]
    assert download[0] == "snapshot_download" and download[1] == ("me/lora",)
    assert download[2] == {"repo_type": None, "revision": "main",
                           "allow_patterns": ["runs/a/last-step00000002-state/*"]}
    assert resumed.uploads() == [("upload_file", "runs/b/last.safetensors")]
    a, b = read(os.path.join(out, "last.safetensors"))[0], read(os.path.join(out2, "last.safetensors"))[0]
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_async_upload_does_not_hold_the_steps_and_rotation_waits_for_it(tmp_path, data):
    """A save every step, the last 1 kept (step 1's file is removed after step 3's save), async:
    the upload of step 1's file waits until step 3's file exists, so training went on meanwhile;
    the rotation waits for that upload before it removes the file, and the run returns only when
    every upload is done."""
    out = str(tmp_path / "out")
    step3 = os.path.join(out, "last-step00000003.safetensors")
    done: list[str] = []

    def hold(path_in_repo):
        if path_in_repo.endswith("step00000001.safetensors"):
            t0 = time.monotonic()
            while not os.path.exists(step3):
                assert time.monotonic() - t0 < 60, "training waited for the upload"
                time.sleep(0.01)

    class Recording(FakeHub):
        def upload_file(self, **kw):
            super().upload_file(**kw)
            done.append(kw["path_in_repo"])

    fake = Recording(str(tmp_path / "hub"), before_upload=hold)
    _train(["--train_data_dir", data, "--output_dir", out, "--max_train_steps", "4",
            "--save_every_n_steps", "1", "--save_last_n_steps", "1", "--async_upload",
            "--huggingface_repo_id", "me/lora"], fake)
    names = [f"last-step0000000{i}.safetensors" for i in (1, 2, 3)] + ["last.safetensors"]
    assert done == names  # all of them, in order, before the run returned
    assert not os.path.exists(os.path.join(out, names[0]))  # rotated away after its upload
    for name in names:
        assert (tmp_path / "hub" / "me/lora" / name).stat().st_size > 1000
