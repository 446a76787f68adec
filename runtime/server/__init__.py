"""The OpenAI-compatible HTTP server: wire models, the async engine bridge, routes and metrics."""
