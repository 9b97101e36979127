"""`specbeam serve`: OpenAI's API (and LibreTranslate's) over the engine, for the tools people already use."""
