"""Tests of proxy/bench/verdict/."""
