"""An OpenAI-compatible HTTP server over the engine: `specdec serve MODEL` or `create_app(llm)`.

Kept import-light (the CLI imports `specdec.server.cli` on every run); the app lives in
`specdec.server.app`.
"""
