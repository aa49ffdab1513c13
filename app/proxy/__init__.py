"""The conversation proxy: an OpenAI-compatible endpoint in front of llama-server that pins
every request to a slot, brings conversations back from their parks by itself, and judges and
explains each request's cache reuse (issue #19)."""
