"""The decision core: scheduling, the worker pool, streams.

Pure: no zmq, no asyncio; the time is an argument.
"""
