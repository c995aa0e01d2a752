"""The scheduler side: rounds and their members, the round book, the plugin's side of the round
core's plan, the token account, the session store's index. No vLLM import, no torch."""
