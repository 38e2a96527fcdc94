"""The decode pool: Ray actors that receive prefilled KV and decode with continuous batching."""
