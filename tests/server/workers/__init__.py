"""Tests of proxy/server/workers/."""
