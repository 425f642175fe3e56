"""The live executor: KV tensor storage, torch model runner, sampler and the engine step loop."""
