"""batcher: a dynamic-batching inference broker over ZeroMQ and msgpack."""

from batcher.client import BatcherError, Client, ClientTimeout

__all__ = ["BatcherError", "Client", "ClientTimeout"]
__version__ = "0.1.0"
