"""Tests of proxy/server/switch/."""
