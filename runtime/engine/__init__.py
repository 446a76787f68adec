"""The serving engine: KV pool, block manager, scheduler, runner, sampler, step loop."""
