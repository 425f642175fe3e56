"""Router policy layer: global prefix index, load tracking, prefill-time model, placement policies (pure Python)."""
