"""Tests of GPU reading (proxy/gpu/) and the GPU harness (scripts/gpu/)."""
