"""The Open Inference Protocol (KServe v2) gateway: HTTP and gRPC in front of a broker.

`oip` holds the protocol's rules without I/O; `core` the one broker connection;
`http_api` and `grpc_api` the two front ends; `server` the process; `process` its
start from `batcher serve`. Install `batcher[gateway]` for aiohttp and grpcio.
"""
