"""The csrc CUDA library: its build, its loader and the ``cuda`` backend built on it."""
