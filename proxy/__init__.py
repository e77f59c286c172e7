"""enginemeter: an OpenAI-compatible measuring proxy for self-hosted LLM engines."""

__version__ = "0.1.0"
