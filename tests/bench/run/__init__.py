"""Tests of proxy/bench/run/."""
