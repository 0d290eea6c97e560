"""The Semantic Variables wing: Parrot's sessions, variables and semantic calls
(Lin et al., OSDI 2024; contract: docs/semantic-variables.md).

An application submits its LLM calls and tool nodes as a DAG linked by
Semantic Variables; the server runs each call the moment its inputs exist,
shares prompt prefixes between calls by forking engine contexts, and turns
the criteria of fetched variables into scheduling preferences.

    routes.py        the HTTP routes under /v1/sessions
    sessions.py      sessions: token, ttl, limits, freeing what a session holds
    dag.py           the data model: Variable, Call, Output, the template syntax
    submit.py        a submitted body read and checked into calls, linked without cycles
    graph.py         one session's graph and its executor (dispatch, run, generate, tool nodes)
    prompt.py        a call's prompt as token ids cut at its variable boundaries
    prefix_share.py  prefix contexts filled once and forked (Parrot section 5.3)
    objectives.py    performance objectives deduced from the DAG (section 5.2)
    transforms.py    output transforms between calls (strip, json_field, regex)

Imports run one way: routes -> sessions -> graph -> submit -> dag.  Sampling
limits come from gateway/sampling.py, the chat route's; errors are the
HTTP-neutral ones of gateway/errors.py.
"""
