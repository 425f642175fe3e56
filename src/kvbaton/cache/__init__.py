"""KV block accounting without tensors: block pool, radix prefix cache, chained block hashes, KV events."""
