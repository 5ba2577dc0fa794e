"""batcher: a dynamic-batching inference broker over ZeroMQ and msgpack."""

from batcher.aio import AsyncClient
from batcher.client import BatcherError, Client, ClientTimeout, MultiClient

__all__ = ["AsyncClient", "BatcherError", "Client", "ClientTimeout", "MultiClient"]
__version__ = "0.1.0"
