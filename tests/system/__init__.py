"""Tests of the whole program as a user runs it: real processes, the CLI, workers, monitoring, docs, the package's shape."""
