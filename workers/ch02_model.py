"""Kept for one release for outside code that imports ``workers.ch02_model``: the names now live in
``workers/data_parallel/model.py`` and ``workers/data_parallel/buckets.py``; import them from there."""
from workers.data_parallel.buckets import *  # noqa: F401,F403
from workers.data_parallel.model import *  # noqa: F401,F403
