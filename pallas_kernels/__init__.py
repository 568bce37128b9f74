"""Pallas kernels (Mosaic GPU for Hopper; interpret mode on CPU). Import the kernel modules directly."""
