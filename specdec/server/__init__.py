"""An OpenAI-compatible HTTP server over the engine: `specdec serve MODEL`, or `create_app(EngineSpec(...))`
(the engine in a process of its own) / `create_app(llm)` (on a thread of this process).

Kept import-light (the CLI imports `specdec.server.cli` on every run); the app lives in
`specdec.server.app`.
"""
