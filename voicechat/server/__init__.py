"""`voicechat serve`: the realtime WebSocket server (docs/server.md).

Modules: `protocol` (wire format), `worker` (the MLX thread), `app` (Starlette app),
`runner` (startup), `client` (the reference client), `cli` (serve / client / talk).
"""
