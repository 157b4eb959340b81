"""Toy training that shows jattn's attention learns (``python -m train``)."""
