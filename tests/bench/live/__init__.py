"""Tests of proxy/bench/live/."""
