"""Tests of proxy/bench/report/."""
