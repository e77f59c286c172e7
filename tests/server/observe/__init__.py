"""Tests of proxy/server/observe/."""
