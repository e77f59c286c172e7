"""Tests of the bench wing (proxy/bench/, the bench, report and tune commands)."""
