"""Tests of proxy/server/record/."""
