"""ZeroMQ as batcher uses it: socket helpers, CURVE security, addresses, stop signals, the allocator."""
