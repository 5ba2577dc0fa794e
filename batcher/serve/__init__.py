"""`batcher serve`'s body (a broker and the workers it supervises) and its launcher for tests and demos."""
