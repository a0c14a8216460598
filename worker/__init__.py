"""kiviq worker: drains the Redis queues into the engine."""
