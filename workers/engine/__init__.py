"""The step loop of one worker: schedule -> run -> postprocess, continuous batching.

``engine.Engine`` owns a worker's batch, KV pool and model; ``async_engine.AsyncEngine``
runs its steps on a thread for an event loop; ``batcher.Batcher`` chooses each step's
tokens; ``model_runner.ModelRunner`` runs the forward over the paged KV cache.
"""
