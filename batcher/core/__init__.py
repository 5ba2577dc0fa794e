"""The decision core: scheduling, the worker pool, streams, the link (back-off, heartbeats).

Pure: no zmq, no asyncio; the time is an argument.
"""
