"""Test-run defaults: notebooks execute at their small size (COLA_NOTEBOOK_SIZE)."""

import os

os.environ.setdefault("COLA_NOTEBOOK_SIZE", "small")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
