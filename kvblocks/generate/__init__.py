"""Generation: one request's prefill and decode over the cache, sampling, prompts, grammars, tools."""
