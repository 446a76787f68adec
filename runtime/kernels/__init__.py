"""Kernels behind one dispatch point per op; reference.py is the torch oracle."""
