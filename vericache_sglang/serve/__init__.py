"""``vericache serve``: the reference engine behind an OpenAI-compatible HTTP API."""
