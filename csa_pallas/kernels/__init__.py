"""Pallas TPU kernels, one module per kernel family; `common` holds the shared layout helpers."""
