"""The OpenAI wing: ``POST /v1/chat/completions`` and the agent loop behind it,
``POST /v1/completions`` (text in, text out) and ``GET /v1/models[/{id}]``.

A request walks the modules in this order:

* ``routes.py``: the route (authenticate, validate, plan, run), and the answer
  made of the loop's events: one ``chat.completion`` or a stream of chunks;
* ``wire.py``: the wire format: the request schema and its validation, ids,
  stream chunks and server-sent events;
* ``plan.py``: a validated request to a ``CompletionPlan``: prompt tokens,
  sampling, the constraints of ``tool_choice`` / ``response_format``, the
  server-side tools it may use;
* ``completions.py``: the agent loop: generate, parse tool calls as they
  stream, run server-side tools while the context is paused, resume;
* ``streaming.py``: what both completion routes share to answer with
  server-sent events (the first event before the response starts, an error
  event then ``[DONE]`` after it);
* ``text_completions.py``: ``/v1/completions``: a raw prompt (text or token
  ids) through the same loop, without a chat template or tools.

What the API surfaces share (the served models, errors, prompt rendering, and
``retention.py``: finished contexts kept across client-side tool calls, which
the Responses API's ``previous_response_id`` names too) lives at the gateway
root, not here.  The agent loop (``completions.py``) and the planning
(``routes.prepare_plan``) are the chat wing's and serve the other two APIs as
well: the Responses wing (gateway/responses/) and the Messages wing
(gateway/anthropic/) translate their requests to this wing's internal request
(a validated chat-completions body) and make their answers of the same loop
events; nothing below the wire modules knows which API called.
"""
