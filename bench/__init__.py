"""The gradhooks benchmark suite: ``python -m bench --help`` (see bench/run.py)."""
