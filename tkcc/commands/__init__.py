"""The `tkcc` command's subcommands: compile, passes, golden, serve (the engine, and --http the OpenAI server),
submit, engine, campaign, watch, report, export.

They belong to the API layer (they call tkcc.compile and tkcc.load, and reach the engine, the agents and the
server), so they live here rather than in the packages they drive, which import nothing above themselves.
``http_forwards`` builds what ``tkcc serve --http`` serves, through tkcc.compile and tkcc.load.
"""
