"""``make lab`` serves JupyterLab on the course: the chapters are listed, the widgets extension is installed.

The real target, started as a learner would (plus options for a headless machine), asked over HTTP.
"""
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.read().decode()


def test_make_lab_serves_the_course(tmp_path):
    port, token = _free_port(), uuid.uuid4().hex
    args = f"--no-browser --ip=127.0.0.1 --port={port} --IdentityProvider.token={token} --ServerApp.port_retries=0"
    log = open(tmp_path / "lab.log", "w")
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"))
    proc = subprocess.Popen(["make", "-s", "lab", f"LAB_ARGS={args}"], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline, listing = time.time() + 120, None
        while time.time() < deadline and proc.poll() is None:
            try:
                _, body = _get(f"{base}/api/contents/notebooks?token={token}")
                listing = json.loads(body)
                break
            except OSError:
                time.sleep(1)
        assert listing is not None, (tmp_path / "lab.log").read_text()[-3000:]
        names = {item["name"] for item in listing["content"]}
        shipped = {p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")}
        assert shipped and shipped <= names
        status, page = _get(f"{base}/lab?token={token}")
        assert status == 200 and "JupyterLab" in page
        # the page's config lists the extensions the lab loads: the widgets manager makes ipywidgets render
        assert "@jupyter-widgets/jupyterlab-manager" in page
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
