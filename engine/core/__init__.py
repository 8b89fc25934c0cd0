"""The engine core: request state, scheduler, KV-cache manager, the step loop, output processing."""
