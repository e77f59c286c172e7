"""Tests of the engine dialects, the embedded engines and the fakes (proxy/engines/, proxy/embedded/, fakes/)."""
