"""A worker as a process: the Ray actor around the engine, the delta channel its front
ends read, and KV blocks over gRPC (disaggregated prefill and decode)."""
