"""Model layer: Llama-family decoder over a paged KV cache, and its loaders."""
