"""Serving: the K3 hybrid prefix cache (prefix_cache), the continuous-batching engine (scheduler, engine) and the
OpenAI-compatible API (api, command). Sampling and the tokenizers with the chat template are shared with training
and generation one level up (openk3.sampling, openk3.tokenizer)."""
