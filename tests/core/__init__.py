"""Tests of the shared base (proxy/*.py)."""
