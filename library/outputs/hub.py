"""A run's saves uploaded to the Hugging Face Hub, and a resume from a state there: sd-scripts'
``huggingface_*`` options (its library/huggingface_util.py and the calls after each save), through
huggingface_hub's ``HfApi``.

    HubTarget.of(opts) -> HubTarget | None      where saves go (None: huggingface_repo_id unset)
    Uploader(target, api, async_upload=False)
        .upload(path)    a model file, or a folder (a diffusers model, a training state), to
                         ``<huggingface_path_in_repo>/<its name>`` (unset: the repository's root);
                         the repository is created first when it does not exist (private unless
                         huggingface_repo_visibility = public)
        .settled(path)   waits until an upload of ``path`` queued earlier has finished (before the
                         rotation of old saves removes it)
        .close()         waits for every upload (the run's end, or its interruption)
    uploader_for(opts, api=None) -> Uploader | None
    download_state(resume, token, api=None) -> the local folder of the state ``resume`` names
    hub_api(token) -> HfApi

As sd-scripts: uploads happen in the main process after each model save and, with
``save_state_to_huggingface``, after each state save; ``async_upload`` uploads in a background
thread so that training goes on (one thread, in save order). Stronger than sd-scripts: an unset
``huggingface_path_in_repo`` puts a file at the repository's root under its own name (sd-scripts
passes no path and the upload of a file fails) and a folder there under its name (sd-scripts
spreads its files over the root); the run waits for every upload, not only the final model's,
before it ends; a save the rotation (save_last_n_*) removes is not removed while its upload is
still in flight. A failed upload (or repository creation) is one warning and never touches the
local file. The token is passed to HfApi only: options.SECRET_OPTIONS keeps it out of the saved
config, the state and the metadata.

A state on the Hub is named as sd-scripts reads ``resume`` with ``resume_from_huggingface``:
``<owner>/<repo>/<path in repo>[:<revision>[:<repo type>]]``; its files are downloaded into
huggingface_hub's cache (``HF_HUB_OFFLINE=1`` finds them there again) and resumed as a local state.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from library.errors import ResumeError, first_line

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options

logger = logging.getLogger("sdtk")


@dataclass(frozen=True)
class HubTarget:
    repo_id: str
    repo_type: str | None
    path_in_repo: str  # "" = the root
    private: bool
    token: str | None

    @staticmethod
    def of(opts: Options) -> HubTarget | None:
        if not opts.huggingface_repo_id:
            return None
        return HubTarget(opts.huggingface_repo_id, opts.huggingface_repo_type,
                         (opts.huggingface_path_in_repo or "").strip("/"),
                         opts.huggingface_repo_visibility != "public", opts.huggingface_token)

    def dest(self, path: str) -> str:
        name = os.path.basename(os.path.normpath(path))
        return f"{self.path_in_repo}/{name}" if self.path_in_repo else name


def hub_api(token: str | None):
    # lazy: imported by a run that uploads or resumes from the Hub only
    from huggingface_hub import HfApi

    return HfApi(token=token)


class Uploader:
    def __init__(self, target: HubTarget, api, async_upload: bool = False):
        self.target, self.api, self.async_upload = target, api, async_upload
        self._repo_checked = False
        self._pending: dict[str, threading.Event] = {}
        self._queue: queue.Queue = queue.Queue()  # (path, done) for the thread; None: stop
        self._thread: threading.Thread | None = None

    def upload(self, path: str) -> None:
        if not self.async_upload:
            self._upload(path)
            return
        done = self._pending[os.path.abspath(path)] = threading.Event()
        if self._thread is None:
            # not a daemon: an interpreter that exits without close() still finishes the uploads
            self._thread = threading.Thread(target=self._work, name="sdtk-hub-upload")
            self._thread.start()
        self._queue.put((path, done))

    def settled(self, path: str) -> None:
        done = self._pending.get(os.path.abspath(path))
        if done is not None:
            done.wait()

    def close(self) -> None:
        if self._thread is not None:
            if self._pending:
                logger.info(f"waiting for {len(self._pending)} upload(s) to {self.target.repo_id}")
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            path, done = item
            try:
                self._upload(path)
            except Exception as e:  # noqa: BLE001 - the thread serves the saves still queued
                logger.warning(f"upload of {path} failed ({first_line(e, typed=True)}); the local "
                               "file is kept")
            finally:
                done.set()
                if self._pending.get(os.path.abspath(path)) is done:  # not a later save's
                    del self._pending[os.path.abspath(path)]

    def _ensure_repo(self) -> None:
        t = self.target
        if self._repo_checked:
            return
        self._repo_checked = True
        try:
            if not self.api.repo_exists(t.repo_id, repo_type=t.repo_type):
                self.api.create_repo(t.repo_id, repo_type=t.repo_type, private=t.private,
                                     exist_ok=True)
                logger.info(f"created Hugging Face repository {t.repo_id} "
                            f"({'private' if t.private else 'public'})")
        except Exception as e:  # noqa: BLE001 - the upload below says whether it matters
            logger.warning(f"huggingface_repo_id {t.repo_id}: cannot create the repository: "
                           f"{first_line(e, typed=True)}")

    def _upload(self, path: str) -> None:
        t, dest = self.target, self.target.dest(path)
        self._ensure_repo()
        try:
            if os.path.isdir(path):
                self.api.upload_folder(repo_id=t.repo_id, repo_type=t.repo_type, folder_path=path,
                                       path_in_repo=dest)
            else:
                self.api.upload_file(repo_id=t.repo_id, repo_type=t.repo_type,
                                     path_or_fileobj=path, path_in_repo=dest)
        except Exception as e:  # noqa: BLE001 - a failed upload never stops the run
            logger.warning(f"upload of {path} to {t.repo_id}/{dest} failed "
                           f"({first_line(e, typed=True)}); the local file is kept")
            return
        logger.info(f"uploaded {path} to {t.repo_id}/{dest}")


def uploader_for(opts: Options, api=None) -> Uploader | None:
    """The run's uploader (main process), or None when huggingface_repo_id is unset."""
    target = HubTarget.of(opts)
    if target is None:
        return None
    return Uploader(target, api if api is not None else hub_api(target.token), opts.async_upload)


def parse_resume(resume: str) -> tuple[str, str, str | None, str | None]:
    """sd-scripts' form -> (repo id, path in repo, revision, repo type)."""
    parts = resume.split("/")
    path, _, rest = "/".join(parts[2:]).partition(":")
    if len(parts) < 3 or not all(parts[:2]) or not path.strip("/"):
        raise ResumeError(f"resume {resume!r}: with resume_from_huggingface, give "
                          "<owner>/<repo>/<path in repo>[:<revision>[:<repo type>]]")
    revision, _, repo_type = rest.partition(":")
    if ":" in repo_type:
        raise ResumeError(f"resume {resume!r}: more than <path>:<revision>:<repo type>")
    return f"{parts[0]}/{parts[1]}", path.strip("/"), revision or None, repo_type or None


def download_state(resume: str, token: str | None, api=None) -> str:
    """The state ``resume`` names on the Hub, downloaded; its local folder."""
    repo_id, path, revision, repo_type = parse_resume(resume)
    api = api if api is not None else hub_api(token)
    where = f"{repo_id}/{path}" + (f" at {revision}" if revision else "")
    try:
        root = api.snapshot_download(repo_id, repo_type=repo_type, revision=revision,
                                     allow_patterns=[f"{path}/*"])
    except Exception as e:  # noqa: BLE001 - one line naming what could not be had
        raise ResumeError(f"resume {resume}: cannot download {where} from the Hugging Face Hub: "
                          f"{first_line(e, typed=True)}") from None
    folder = os.path.join(root, path)
    if not os.path.isdir(folder) or not os.listdir(folder):
        raise ResumeError(f"resume {resume}: no files under {where} on the Hugging Face Hub")
    logger.info(f"resume: downloaded {where} to {folder}")
    return folder
