"""Serving: the K3 hybrid prefix cache (prefix_cache), the continuous-batching engine (scheduler, engine,
sampling), tokenizers and the chat template (tokenizer), and the OpenAI-compatible API (api, command)."""
