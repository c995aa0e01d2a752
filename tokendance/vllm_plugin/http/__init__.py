"""The HTTP part: the rounds endpoint in vLLM's API server, chat requests gathered into rounds,
the tool-call parser."""
