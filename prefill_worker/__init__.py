"""The prefill pool: Ray actors that run prompts and stream their KV to decode actors."""
