"""Tests of proxy/server/mirror/."""
