"""The Open Inference Protocol (KServe v2) gateway: HTTP and gRPC in front of a broker.

`oip` holds the protocol's rules without I/O; `core` the one broker connection;
`http_api` (an ASGI app, served by `http_server` on uvicorn) and `grpc_api` the two
front ends; `server` the process; `process` its start from `batcher serve`. Install
`batcher[gateway]` for uvicorn, httptools and grpcio.
"""
