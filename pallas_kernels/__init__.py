"""Pallas kernels (Mosaic GPU for Hopper; interpret mode on CPU). Import the kernel modules directly."""

from pallas_kernels import kernel_cache as _kernel_cache

_kernel_cache.install()  # identical kernels at many call sites (one per layer) compile once
