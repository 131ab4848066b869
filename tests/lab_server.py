"""Start ``make lab`` as a learner would (plus what a headless machine needs), for the lab and browser tests."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
import uuid
from contextlib import contextmanager
from pathlib import Path
from course_utils.paths import ROOT
from workers.runtime import free_port  # noqa: F401 (the lab tests take a port from here)



def get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.read().decode()


def request(url: str, method: str = "GET", body: dict | None = None) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status, r.read().decode()


class Lab:
    def __init__(self, proc: subprocess.Popen, base: str, token: str, log: Path):
        self.proc, self.base, self.token, self.log = proc, base, token, log

    def url(self, path: str) -> str:
        return f"{self.base}/{path.lstrip('/')}{'&' if '?' in path else '?'}token={self.token}"

    def log_tail(self, n: int = 3000) -> str:
        return self.log.read_text()[-n:]


@contextmanager
def make_lab(tmp_path: Path, settings: dict[str, dict] | None = None, env: dict[str, str] | None = None):
    """Yield a ``Lab`` once the server answers; stop it and everything under it on the way out.

    ``settings`` maps a JupyterLab plugin id to its user settings (written to a private settings directory, so
    the learner's own settings are neither read nor changed); ``env``: extra environment for the server and the
    kernels it starts.
    """
    port, token = free_port(), uuid.uuid4().hex
    args = f"--no-browser --ip=127.0.0.1 --port={port} --IdentityProvider.token={token} --ServerApp.port_retries=0"
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "lab-settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "lab-workspaces"), **(env or {}))
    for plugin, values in (settings or {}).items():
        package, name = plugin.rsplit(":", 1)
        path = tmp_path / "lab-settings" / package / f"{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    log_path = tmp_path / "lab.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(["make", "-s", "lab", f"LAB_ARGS={args}"], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    lab = Lab(proc, f"http://127.0.0.1:{port}", token, log_path)
    try:
        deadline = time.time() + 120
        while True:
            try:
                get(lab.url("api/status"))
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise AssertionError(f"make lab did not serve within 120 s:\n{lab.log_tail()}") from None
                time.sleep(1)
        yield lab
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
