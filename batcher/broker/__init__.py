"""The broker process: one event loop over its frontend and backend sockets, control, stats and metrics."""
