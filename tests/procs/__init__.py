"""Tests of proxy/procs/."""
