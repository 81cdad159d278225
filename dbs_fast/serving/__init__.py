"""The service: HTTP (FastAPI), the OpenAI-compatible endpoints, continuous batching, Ray Serve."""
