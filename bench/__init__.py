"""Benchmarks of jattn against its peers (``python -m bench``)."""
