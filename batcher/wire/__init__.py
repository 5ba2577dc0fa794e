"""The wire layer: bytes to values and back (frames, msgpack bodies, tensors, signatures).

Pure: no sockets, no clock.
"""
