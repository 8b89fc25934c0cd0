"""``kvpilot router``: a prefix- and load-aware OpenAI-compatible proxy in front of engine replicas.

:mod:`.policy` (the pure replica choice), :mod:`.prefix` (prompt -> the engine's block hashes),
:mod:`.app` (the aiohttp proxy, scraper and debug endpoints), :mod:`.cli` (the subcommand).
"""
