"""The OpenAI Responses wing: ``POST /v1/responses`` (plain, streamed with
typed events, or in the background), ``GET`` / ``DELETE
/v1/responses/{id}``, ``GET /v1/responses/{id}/input_items`` and ``POST
/v1/responses/{id}/cancel``.

A request walks the modules in this order:

* ``routes.py``: the routes (authenticate, validate, continue a stored
  conversation, plan, run, store, answer), and the background runs;
* ``wire.py``: the wire format: the request schema and its validation, the
  translation to the internal request (a chat-completions body, planned and
  run by the OpenAI wing's ``prepare_plan`` and agent loop), and the answer
  made of the loop's events (output items, the ``Response`` object, the typed
  server-sent events);
* ``store.py``: the stored responses (``store: true``) behind a small
  interface, an embedded SQLite file by default: what ``previous_response_id``
  continues, per API key, until their TTL.

The engine context a stored response ends with is kept by the gateway's
retention store (gateway/retention.py), as for a client-side tool call: the
follow-up's prompt starts with the stored prompt + reply and adopts it.
"""
