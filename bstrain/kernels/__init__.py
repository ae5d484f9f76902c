"""Triton kernels and their launchers (shape checks, grid, output allocation). No autograd here.

Importing a submodule needs triton; the ops layer imports them only when a kernel path runs.
"""
