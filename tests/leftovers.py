"""What a test's processes may leave behind: nothing. Chapter 17's tests ask both questions after every run."""
from __future__ import annotations

import socket
import time

import psutil


def children() -> set[int]:
    """Every process this test process started, at any depth, now."""
    return {p.pid for p in psutil.Process().children(recursive=True)}


def new_children(before: set[int], within: float = 10.0) -> list[psutil.Process]:
    """Processes started since ``before`` (any depth) that are still alive after ``within`` seconds."""
    deadline = time.time() + within
    while True:
        alive = []
        for p in psutil.Process().children(recursive=True):
            try:
                if p.pid not in before and p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:  # ended between the listing and the question
                pass
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.1)


def port_free(port: int) -> bool:
    """Nobody listens on ``port`` and a new server could take it. SO_REUSEADDR as every server sets it (TCPStore
    does): the closed job's connections may sit in TIME_WAIT on that port for a minute, which holds no process."""
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        try:
            probe = socket.socket(family)
        except OSError:  # no IPv6 on this machine
            continue
        with probe as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
                s.listen()
            except OSError as exc:
                if family == socket.AF_INET6 and exc.errno == 99:  # EADDRNOTAVAIL: IPv6 loopback absent
                    continue
                return False
        with socket.socket(family) as s:
            if s.connect_ex((host, port)) == 0:  # accepted: a listener is left
                return False
    return True
