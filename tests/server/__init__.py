"""Tests of the proxy server (proxy/server/)."""
