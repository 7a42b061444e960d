"""The HTTP layer: the FastAPI app, its routes, request and response schemas, auth, middleware and errors. It
converts requests into the engine's calls and the engine's results into responses."""
