"""Serving a model over HTTP: OpenAI's chat and completions API on the continuous-batching engine, and a chat
page, in one process (`minigpt serve`)."""
