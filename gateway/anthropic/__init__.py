"""The Anthropic Messages API (``/v1/messages``, ``/v1/messages/count_tokens``),
the API Claude Code speaks: wire.py checks a request and translates it to the
internal request (a chat-completions body) and the loop's events back to
Anthropic's message and stream events; routes.py serves it through the same
planning and agent loop as every other API (gateway/openai/)."""
