"""HTTP server, OpenAI-compatible routes and the engine facade."""
