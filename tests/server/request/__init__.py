"""Tests of proxy/server/request/."""
